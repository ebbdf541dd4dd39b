"""Fuse Hugging Face encoders in place: `fuse(model)`, `unfuse(model)`, `fuse_report(model)`.

`fuse` finds every encoder inside any model (a bare BertModel, a task model, a sentence-transformers wrapper, a
PEFT model) and gives the modules it fuses fused forwards, in this model instance only: each module stays the
same object, its class a subclass of its own (`fused_class`, pickled as "this class, fused"), so its place,
Parameters, buffers and hooks are untouched; transformers' classes and other instances are too. state_dict
keys and values, optimizers and save_pretrained keep working, and `unfuse` puts the classes back, with whatever
the model learned.

What is fused:
  * every LayerNorm (and a family's own LayerNorm or RMSNorm class); "dense -> dropout -> + residual ->
    LayerNorm" in one kernel;
  * a Linear followed by its GeLU (intermediate layers, DistilBERT's FFN, head transforms, ELECTRA's heads): the
    matmul without bias, then bias + GeLU in one kernel, where the Linear is a plain biased nn.Linear without
    hooks; any other module there (a LoRA layer, a quantised Linear) is called, and the GeLU applied to what it
    returns;
  * the encoder: padding removed once per forward, every layer's attention run by the varlen kernel on packed
    tokens, padding restored at the end (padded positions of last_hidden_state are then 0). Every submodule is
    called through its own __call__ (q, k and v in one matmul only when all three are plain nn.Linears), so its
    hooks fire, on packed [tokens, features] tensors inside the encoder, and gradient checkpointing recomputes
    each layer. Under torch.compile and torch.export a static layout replaces unpadding (no host sync, one graph
    whatever the padding); an ONNX export exports each module's original code;
  * with fuse(model, mlm_logits=False), masked-LM heads given labels: the loss by the masked-only kernel at
    labelled positions, the vocabulary logits never formed (bertfuse.bert.hf.heads).

The rule is that fusing changes speed, never meaning (bench/hf_suite.py runs transformers' own model tests on
fused models; bench/hf_fuzz.py draws random configurations and calls). What cannot be fused keeps the original
module with one warning naming the reason, and `fuse_report` lists it: attention the kernel cannot express (each
family module names its own refusals), a head_dim over 128, decoders and their causal-LM heads, an activation
without a kernel, layers of an unknown structure or of a class whose code is not known (bertfuse.bert.hf.known),
and code of a known class that differs from every variant checked (another transformers release, or a class or
function patched at run time: bertfuse.bert.hf.code; `fuse(model, unchecked_code=True)` fuses it anyway, for
testing a release; the reason names the oldest newer release on which that code was checked, to upgrade to).
A transformers older than the oldest checked release stops fuse with an error. Every minor release from that
floor to the newest is checked (bench/results/hf_versions/: per release and model type, fused or why not): where
a release's code is laid out differently, the family's forwards read it as that release holds it (before
transformers 5, DistilBERT's encoder takes its own arguments and ALBERT's sdpa attention is a subclass with its
own dropout rate; before 5.6, ESM's attention rotates q and k by its own rotary module; before 5.1, ModernBERT's
model takes sliding_window_mask and each attention keeps its window and, before 5.0, its rotary module).
A call the fused layers do not compute exactly runs the original encoder code, counted in fuse_report
(bertfuse.bert.hf.encoder). The fused modules pick the kernels by device and dtype (float64 runs their PyTorch
path). Beside transformers' kernelize (hub kernels' forwards bound over decorated layers: activations, RMSNorm,
the rotary function) the fused code wins: fuse sets aside the hub forward of each module it changes and the
fused kernels compute the functions of those inside fused blocks (ops.hookless accepts a hub forward), while a
fused class has no kernel_layer_name, so kernelize (or train()/eval() re-kernelizing) binds nothing over it.

The package, in the order of its data flow:
  compute.py       the fused computations (Linear + GeLU, add + norm, gating, attention) and shared forwards
  records.py       the records a family fills in: Stack, Layers, Family, MLMHead, PairHead, GeluBlock, Group
  code.py          the digest of a class's installed code, the digests checked per release (checked.json), the
                   transformers floor
  known.py         whose code is known (`unknown_code`: a known class, its installed code a checked variant),
                   and the fused classes (`fused_class`)
  encoder.py       the fused encoder, and when a call runs the original code
  bert.py ... deberta.py   one module per family group: its forwards, records and refusal rules, and a GROUP
  families.py      the registry: one line per family module
  recognise.py     finding encoders and layer structures inside a model, and the attention's refusals
  heads.py         the masked-only MLM loss heads, and labels on padded positions
  fuser.py         fuse, unfuse, fuse_report
A new family is one module (its forwards, `Layers`, `Family` records and refusal rules, ending in a `GROUP`) and
one line in families.GROUPS. Names with a leading underscore are the package's own, shared between its modules.
"""
import sys

from bertfuse.bert.hf.compute import gelu_kind, glu_kind
from bertfuse.bert.hf.families import FAMILIES, GROUPS, LAYERS, PAIR_HEADS, family
from bertfuse.bert.hf.fuser import fuse, fuse_report, unfuse
from bertfuse.bert.hf.heads import pair_head
from bertfuse.bert.hf.known import fused_class, known_classes, unknown_code
from bertfuse.bert.hf.recognise import encoder_parts, encoder_stack, layer_kind
from bertfuse.bert.hf.records import EncoderReport, Family, GeluBlock, Group, Layers, MLMHead, PairHead, Stack

__all__ = ["fuse", "unfuse", "fuse_report", "family", "FAMILIES", "GROUPS", "LAYERS", "PAIR_HEADS", "pair_head",
           "encoder_parts", "encoder_stack", "layer_kind", "fused_class", "known_classes", "unknown_code",
           "gelu_kind", "glu_kind", "EncoderReport", "Family", "GeluBlock", "Group", "Layers", "MLMHead",
           "PairHead", "Stack"]


def __getattr__(name: str):
    """Any name of the package's modules, as bertfuse.bert.hf.<name>: a whole-object pickle of a fused model that
    names its forwards, records or output classes so (bertfuse.legacy_pickle reads older ones) loads."""
    if not name.startswith("__"):
        modules = [m for key, m in list(sys.modules.items())  # all imported here (None: an import blocked)
                   if key.startswith(f"{__name__}.") and m is not None]
        for found in modules:
            if name in vars(found):
                return vars(found)[name]
        heads = sys.modules.get(f"{__name__}.heads")
        if heads is not None and name in heads._NARROWED:  # the output classes without logits, made on first use
            return getattr(heads, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
