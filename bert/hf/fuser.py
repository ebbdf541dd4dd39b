"""fuse, unfuse and fuse_report: the fuser that changes module classes in place and records each change.

`fuse` finds every encoder inside a model (bertfuse.bert.hf.recognise), gives the modules it fuses fused
classes (bertfuse.bert.hf.known.fused_class) with their family's forwards, fuses the blocks computing
[norm](GeLU(Linear(x))), the output blocks (dense -> dropout -> + residual -> LayerNorm) and every norm wherever
they are, and the task models' heads (bertfuse.bert.hf.heads); `unfuse` undoes the record in reverse.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
from typing import Callable, NamedTuple

from torch import nn

from bertfuse.bert.hf.code import checking, version_problem
from bertfuse.bert.hf.compute import _get, _output_block_forward, gelu_kind
from bertfuse.bert.hf.encoder import PADDED_POSITIONS, _EncoderState, _encoder_forward, padded_reads
from bertfuse.bert.hf.families import BLOCK_MODELS, FAMILY_NORMS, GELU_BLOCKS
from bertfuse.bert.hf.heads import (FusedMLMForward, _hook_labels, _is_masked_lm, _mlm_code_problem, _mlm_head,
                                    _reads_token_labels, _unhook_labels)
from bertfuse.bert.hf.known import _is_fused, fused_class, known_classes, self_bound_forward, unknown_code
from bertfuse.bert.hf.recognise import _attention_problems, _is_output_block, encoder_parts, encoder_stack, layer_kind
from bertfuse.bert.hf.records import EncoderReport
from bertfuse.bert.model import ops

_ORIGINALS = "_bertfuse_originals"
_REPORT = "_bertfuse_report"
# Blocks computing LayerNorm(dropout(dense(x)) + residual).
_OUTPUT_BLOCK_CLASSES = ("{P}SelfOutput", "{P}Output")


class _Saved(NamedTuple):
    """What fuse changed in a model, kept on it (under _ORIGINALS) for unfuse, and how it was fused."""
    record: list                   # _Fuser.record: the class changes and attributes, in order
    heads: list                    # task models whose forward was patched
    mlm_logits: bool
    padded_positions: str = "exact"
    labelled: tuple = ()           # token-level task models whose calls check their labels (`_labels_pre_hook`)


class _Fuser:
    """Changes module classes in place (every object stays: its hooks, its place in the model, its parameters),
    recording each change so that unfuse can undo it."""

    def __init__(self):
        # (module, "__class__", its class), (module, attribute, None): set by fuse, or (module, attribute, value):
        # removed by fuse (a hub kernel's forward, never None); each undone by unfuse
        self.record: list = []

    def retype(self, module: nn.Module, cls: type) -> None:
        """`module` becomes a `cls`. A hub kernel's forward kernelize bound to it goes (to come back with unfuse):
        the fused class's own forward then runs, and kernelize leaves fused classes alone. So does its own class's
        forward bound on the instance (what transformers 5.0's output capturing leaves there), which would
        shadow the fused class's."""
        if ops.hub_kernel(module) is not None:
            for name in ("forward", "_kernel_repo"):
                self.record.append((module, name, vars(module).pop(name)))
        elif self_bound_forward(module):
            self.record.append((module, "forward", vars(module).pop("forward")))
        self.record.append((module, "__class__", type(module)))
        module.__class__ = cls

    def fused(self, module: nn.Module, forward: Callable) -> None:
        """`module` runs `forward`, a fused forward of this module's, as an instance of fused_class."""
        self.retype(module, fused_class(type(module), forward))

    def attach(self, module: nn.Module, name: str, value) -> None:
        """Fuse's state on a module (not a submodule, not in its state_dict), removed by unfuse."""
        self.record.append((module, name, None))
        object.__setattr__(module, name, value)

    def gelu_blocks(self, root: nn.Module, report: EncoderReport) -> int:
        """Every module under root of a class that computes [norm](GeLU(Linear(x))) (`GELU_BLOCKS`) runs the
        Linear's matmul without bias and bias + GeLU in one kernel (`_linear_gelu`, which decides at each call).
        A GeLU without a kernel, or a look-alike of unknown code, is reported and keeps its code."""
        fused = 0
        for m in list(root.modules()):
            names = {n for n, _ in m.named_children()}
            shaped = [b for b in GELU_BLOCKS if names == set(b.children)]  # of several, the one of m's class
            block = next((b for b in shaped if not unknown_code(m, known_classes((b.cls,), BLOCK_MODELS))),
                         shaped[0] if shaped else None)
            if block is None or _is_fused(m) or not isinstance(getattr(m, block.children[0]), nn.Linear):
                continue
            # A block of one Linear calls its GeLU as a function (ESM's): known only by its class, so another
            # class of that shape is no look-alike worth reporting.
            act = getattr(m, block.children[1]) if len(block.children) > 1 else None
            if act is not None and gelu_kind(act) is None:
                if "gelu" in type(act).__name__.lower():
                    report.keep(f"Linear + {type(act).__name__}", "no fused kernel for this activation")
                continue
            if why := unknown_code(m, known_classes((block.cls,), BLOCK_MODELS)):
                if act is not None:
                    report.keep(f"Linear + GeLU in {type(m).__name__}", why)
                continue
            self.fused(m, block.forward)
            fused += 1
        return fused

    def output_blocks(self, root: nn.Module, report: EncoderReport) -> int:
        """dense -> dropout -> + residual -> LayerNorm blocks of known code: one LayerNorm kernel each, with the
        dropout and the residual add (`_add_norm`). A look-alike of unknown code keeps its own forward (its
        LayerNorm still runs the kernel, alone)."""
        known = known_classes(_OUTPUT_BLOCK_CLASSES, BLOCK_MODELS)
        fused = 0
        for block in [m for m in root.modules() if _is_output_block(m) and not _is_fused(m)]:
            if why := unknown_code(block, known):
                report.keep(f"dense + dropout + residual in {type(block).__name__}", why)
                continue
            self.fused(block, _output_block_forward)
            fused += 1
        return fused

    def layer_norms(self, root: nn.Module) -> int:
        return ops.kernels_package().fuse_layer_norms(root, retype=self.retype)

    def family_norms(self, root: nn.Module) -> tuple[int, int]:
        """Every norm of a family's own class (`FAMILY_NORMS`: RMSNorms, DebertaLayerNorm) under root runs the
        kernel: (LayerNorms, RMSNorms) fused."""
        counts = {False: 0, True: 0}
        for norm in FAMILY_NORMS:
            known = known_classes(norm.classes, norm.models)
            found = [m for m in root.modules()
                     if isinstance(m, known) and not _is_fused(m) and not unknown_code(m, known)]
            for m in found:
                self.fused(m, norm.forward)
            counts[norm.rms] += len(found)
        return counts[False], counts[True]


def _fuse_encoder_model(fuser: _Fuser, path: str, model: nn.Module, child: str, reads: str) -> EncoderReport:
    """Fuse one encoder model; its report also names the hub kernels (bound by transformers' kernelize) whose
    function the fused code now computes: those on modules fuse changed, or inside them."""
    hub = {m: type(m).kernel_layer_name for m in model.modules() if ops.hub_kernel(m) is not None}
    report = _fuse_encoder(fuser, path, model, child, reads)
    parents = {c: m for m in model.modules() for c in m.children()}
    replaced = collections.Counter(name for m, name in hub.items() if _is_fused(m) or _is_fused(parents.get(m, m)))
    if replaced:
        report.fused.append("the function of transformers' hub kernels on or inside fused modules (where a fused "
                            "kernel computes it): " + ", ".join(f"{n} x{k}" for n, k in sorted(replaced.items())))
    return report


def _fuse_encoder(fuser: _Fuser, path: str, model: nn.Module, child: str, reads: str) -> EncoderReport:
    encoder = getattr(model, child) if child else model  # "": the model holds its layers itself
    stack, layers = encoder_stack(encoder)
    kinds = {layer_kind(layer) for layer in layers}
    kind = kinds.pop() if len(kinds) == 1 else None
    kind = kind if kind is not None and kind.stack is stack else None
    report = EncoderReport(path, type(model).__name__, kind.name if kind else "unknown")
    # Judged on the model as it came, before any module of it changes class.
    reasons = ["the layers' structure is not one the fused attention knows"] if kind is None else \
        _attention_problems(model, kind, encoder)
    n_blocks = fuser.output_blocks(model, report)
    n_gelus = fuser.gelu_blocks(model, report)
    n_family, n_rms = fuser.family_norms(model)
    n_norms = fuser.layer_norms(model) + n_family
    report.fused.append(f"{n_norms} LayerNorms ({n_blocks} with dense dropout + residual)"
                        + (f", {n_rms} RMSNorms" if n_rms else ""))
    if n_gelus:
        report.fused.append(f"{n_gelus} Linear + GeLU")
    if reasons:
        report.keep("attention", "; ".join(reasons))
        return report
    for layer in layers:  # each once: ALBERT's layers are shared by the passes its config counts
        for path_in_layer, forward in kind.forwards:
            fuser.fused(_get(layer, path_in_layer) if path_in_layer else layer, forward)
    for group in stack.groups(encoder):
        fuser.fused(group, stack.group_forward)
    fuser.attach(encoder, "_bertfuse_encoder", _EncoderState(kind, getattr(model, "config", None), report, reads))
    fuser.fused(encoder, kind.encoder_forward or _encoder_forward)
    if kind.model_forward:
        fuser.fused(model, kind.model_forward)
    if encoder is model or kind.model_forward:
        _register_recorded_outputs(model)
    report.fused.append(kind.fused)
    return report


def _register_recorded_outputs(model: nn.Module) -> None:
    """transformers looks up which submodules' outputs a model records (output_hidden_states, output_attentions) by
    the name of the model's class, registered when a model is built: a model fused whole has its fused class's
    name, registered here to the same answer, in every registry the installed release has (transformers.utils
    .generic's before 5.2, output_capturing's from 5.2: a dict keyed by the class's name, or from 5.24 a registry
    taking the model)."""
    if not getattr(model, "_can_record_outputs", None):
        return
    for where in ("transformers.utils.generic", "transformers.utils.output_capturing"):
        try:
            registry = importlib.import_module(where)._CAN_RECORD_REGISTRY
        except (ImportError, AttributeError):  # not in this release
            continue
        if type(registry) is dict:
            registry[str(type(model))] = model._can_record_outputs
        else:
            registry[model] = model._can_record_outputs


def _fuse_heads(fuser: _Fuser, model: nn.Module, encoders, reports, mlm_logits: bool) -> list:
    """The task models around each encoder model: their GeLUs and LayerNorms, and (mlm_logits=False) the
    masked-only MLM loss."""
    patched = []
    for (path, enc_model, _), report in zip(encoders, reports):
        for task in model.modules():
            base = next((name for name, c in task.named_children() if c is enc_model), None)
            if base is None:
                continue
            n = fuser.gelu_blocks(task, report) + fuser.layer_norms(task)
            if n:
                report.fused.append(f"{n} head modules ({type(task).__name__})")
            head = _mlm_head(task) if _is_masked_lm(task) else None
            if head is None or task in patched:
                continue
            if mlm_logits:
                report.kept.append((f"MLM loss ({type(task).__name__})", "mlm_logits=True: the full vocabulary "
                                    "logits are formed, as transformers returns them"))
                continue
            if why := _mlm_code_problem(task, head):
                report.keep(f"MLM loss ({type(task).__name__})", why)
                continue
            task.forward = FusedMLMForward(task, head, base)
            patched.append(task)
            report.fused.append(f"MLM loss at labelled positions, no logits ({type(task).__name__})")
    return patched


def fuse(model: nn.Module, mlm_logits: bool = True, padded_positions: str = "exact",
         unchecked_code: bool = False) -> nn.Module:
    """Fuse every encoder inside `model` in place (see the module docstring); returns `model`.

    mlm_logits: True (the default) keeps transformers' contract for masked-LM and pre-training models given
    labels: the full [batch, seq, vocab] logits are formed and returned with the loss. False computes the loss
    at the labelled positions only, by the masked-only kernel, and never forms the logits (memory bounded by the
    labelled tokens): `logits` / `prediction_logits` are then None, and the output refuses integer indexing and
    to_tuple() (positions would shift). The loss itself means the same either way.

    padded_positions: the fused encoder computes real tokens only and leaves padded positions of its output 0.
    "exact" (the default): a call with padding where a head over the encoder reads it (question answering's start
    and end logits, whose loss spans every position; a pooler or classifier reading a padded first position, as
    left padding gives; a masked-LM or token-classification label on a padded position of a 2-D mask, seen by a
    forward pre-hook on the task model that unfuse removes) runs the original code, so every head's answer is
    transformers'. "zero": such calls run fused too, and those heads read 0 there (a QA loss over padded
    positions, a pooled padded first token, then differ from transformers'), for speed.

    unchecked_code: False (the default) fuses a module only where its transformers code, as installed, is a
    variant checked to give the same answer fused (bertfuse.bert.hf.code); any other keeps its code, with a warning
    naming the class and the installed transformers, listed by fuse_report. True fuses unchecked code too: for
    testing a release not yet checked (python -m bertfuse.bench.hf_fuzz --unchecked), never for results.
    A transformers older than the oldest checked release stops with an error naming both."""
    if padded_positions not in PADDED_POSITIONS:
        raise ValueError(f"fuse: padded_positions must be one of {PADDED_POSITIONS}, got {padded_positions!r}")
    if why := version_problem():
        raise RuntimeError(f"fuse: {why}")
    saved = getattr(model, _ORIGINALS, None)
    if saved:  # already fused
        if (saved.mlm_logits, saved.padded_positions) != (mlm_logits, padded_positions):
            raise ValueError(f"fuse: this model is already fused with mlm_logits={saved.mlm_logits}, "
                             f"padded_positions={saved.padded_positions!r}; unfuse it first")
        return model
    encoders = encoder_parts(model)
    if not encoders:
        raise ValueError(f"fuse: no encoder inside {type(model).__name__} (looked for a module with `embeddings` "
                         "and an `encoder` or `transformer` holding a `layer` list)")
    fuser = _Fuser()
    with checking(not unchecked_code):
        reports = [_fuse_encoder_model(fuser, *part, padded_reads(model, part[1], padded_positions))
                   for part in encoders]
        heads = _fuse_heads(fuser, model, encoders, reports, mlm_logits)
    labelled = () if padded_positions == "zero" else tuple(m for m in model.modules() if _reads_token_labels(m))
    for task in labelled:
        _hook_labels(task)
    for report in reports:
        report.warn()
    object.__setattr__(model, _ORIGINALS, _Saved(fuser.record, heads, mlm_logits, padded_positions, labelled))
    object.__setattr__(model, _REPORT, reports)
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Give every module fuse changed its own class back (the objects never changed: what they learned, loaded
    or had registered on them while fused stays); returns `model`."""
    saved = getattr(model, _ORIGINALS, None)
    if not saved:
        return model
    for module, name, old in reversed(saved.record):
        if name == "__class__":
            if self_bound_forward(module):  # the fused forward, bound there while fused: it must not outlive it
                del vars(module)["forward"]
            module.__class__ = old
        elif old is None:
            object.__delattr__(module, name)
        else:
            vars(module)[name] = old
    for task in saved.labelled:
        _unhook_labels(task)
    for task in saved.heads:
        original = task.forward.original
        del task.forward
        if original is not None:
            task.forward = original
    object.__delattr__(model, _ORIGINALS)
    object.__delattr__(model, _REPORT)
    return model


def fuse_report(model: nn.Module) -> list[EncoderReport]:
    """Per encoder of a fused model: what was fused and what was kept, with the reason ([] if not fused), and the
    backend its fused layers take now, on the device and dtype of the encoder's parameters when the report is
    read (`backend`: the Triton kernels, Triton's interpreter, or the PyTorch path and why). Under autocast the
    activations' dtype decides instead: bfloat16 autocast on a GPU runs bfloat16."""
    return [dataclasses.replace(r, backend=_backend(model, r.path)) for r in getattr(model, _REPORT, [])]


def _backend(model: nn.Module, path: str) -> str:
    from bertfuse import kernels

    try:
        encoder = model.get_submodule(path) if path else model
    except AttributeError:  # a report of a module since removed: the model's own parameters say it
        encoder = model
    first = next((p for p in encoder.parameters() if p.is_floating_point()), None)
    return "unknown (no floating-point parameter)" if first is None else kernels.backend_of(first.device,
                                                                                              first.dtype)[1]
