"""`python -m bertfuse.bench.hf_fuzz`: a configuration fuzzer for bert.hf.fuse, fused against unfused.

Every case is one random tiny model and one random call, drawn by hypothesis (which shrinks a failure to its
smallest case): a family (every one bert.hf knows, DistilBERT with sinusoidal positions too), a configuration
over the fields that change the math (head counts and widths, head_dim 1 and odd ones included, activations,
position types, rope types and scaling, windows and layer types, key/value heads, DeBERTa's relative settings,
ALBERT's groups, MPNet's buckets, the attention implementation: eager or sdpa), a task head with labels, and
inputs (padding on the right, on the left or in the middle, empty and length-1 rows, no mask, 2-D and 4-D boolean
and float masks, explicit position ids, position ids restarting inside rows (padding-free packing), inputs_embeds,
token types, token-level labels on padded positions, a head mask where the release's forward takes one,
output_hidden_states: True, or transformers 5's selection of layers by an index or a list). Besides the families,
the model types fused as BERT's code under their own names (ERNIE, LayoutLM, MarkupLM, RoCBert, Splinter, TAPAS,
VisualBERT, Data2VecText, BertGeneration) are drawn.
The fused model must give the unfused model's answer, and, unfused again, the unfused answer to the bit: both
raise, or every output the fused drop-in promises (real positions of token-level outputs, all of pooled ones,
of question answering's logits, of every hidden state and of the last one where hidden states are asked for, the
loss) within `OUT_TOL`, and every parameter gradient
within `GRAD_TOL`, scaled as bench.hf_parity.worst_grad (where float32 rounding puts them further apart, each
within twice the unfused model's own distance from its float64 copy). A failing case prints one line that reruns
it.

    python -m bertfuse.bench.hf_fuzz --cases 10000 [--seed 0] [--families bert,esm] [--interpret] [--unchecked]
    python -m bertfuse.bench.hf_fuzz --case '<the JSON a failure printed>'

flex attention is not drawn: on the CPU (torch 2.13) it is no reference, giving NaN on some calls and not others
for the same inputs, corrupting memory given a tensor mask, and without a backward; tests/test_hf_meaning.py checks
flex calls (padded and padding-free BlockMasks run fused) on loss and logits. --interpret runs the real kernels in
Triton's interpreter (slow: small cases only); by default, the fused modules' PyTorch path (the rules deciding what
runs fused are the same). tests/test_hf_fuzz.py runs a fixed seed in the fast tier and bounded hypothesis runs in the
slow tier.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import os
import sys
import time
import warnings
from typing import NamedTuple

from bertfuse.bench.hf_parity import COPIES
from bertfuse.bench.hf_parity import FAMILIES as OWN_FAMILIES  # the drop-in's families, DistilBERT sinusoidal too

# ... and the model types fused as BERT's code under their own names (ERNIE, LayoutLM, TAPAS...).
FAMILIES = [*OWN_FAMILIES, *COPIES]

OUT_TOL = 1e-5     # relative error of outputs and losses (max |fused - unfused| / max |unfused|)
GRAD_TOL = 1e-4    # worst parameter gradient, scaled per parameter (bench.hf_parity.worst_grad)
HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
MASKS = ("none", "long", "bool", "float", "bool4", "float4")
LAYOUTS = ("right", "left", "holes")


@dataclasses.dataclass(frozen=True)
class Case:
    """One fuzz case: the model (family, head, implementation, configuration changes in the family's own field
    names), how it is fused, and the call (its shape, padding and mask; values drawn from `seed`)."""
    family: str
    head: str
    impl: str
    config: dict
    lengths: tuple
    seqlen: int
    layout: str = "right"
    mask: str = "long"
    position_ids: bool = False
    packed: bool = False           # position ids restarting inside rows: sequences packed end to end (padding-free)
    embeds: bool = False
    segments: bool = False
    labels: bool = True
    padded_labels: bool = False    # token-level labels on padded positions too (with a 2-D mask)
    mlm_logits: bool = True
    head_mask: bool = False        # a head mask of 0s and 1s, where the model's forward takes one
    hidden_states: object = False  # output_hidden_states: False, True, an index or a list of them
    seed: int = 0

    def line(self) -> str:
        """The one line that reruns this case."""
        return f"python -m bertfuse.bench.hf_fuzz --case '{json.dumps(dataclasses.asdict(self))}'"


# ---- drawing cases (hypothesis strategies) ----------------------------------------------------------------
def _family_config(draw, st, family: str, hidden: int, heads: int) -> dict:
    """What a configuration of `family` may set besides the sizes, drawn."""
    c: dict = {}
    bert_like = ("bert", "roberta", "xlm-roberta", "camembert", "electra", *COPIES)
    if family in (*bert_like, "roformer", "nomicbert"):
        c["hidden_act"] = draw(st.sampled_from(["gelu", "gelu_new", "relu", "gelu_pytorch_tanh", "silu"]))
    if family in bert_like:
        c["position_embedding_type"] = draw(st.sampled_from(["absolute", "relative_key", "relative_key_query"]))
    if family == "electra":
        c["embedding_size"] = draw(st.sampled_from([16, hidden]))
    if family == "distilbert":
        c["activation"] = draw(st.sampled_from(["gelu", "relu"]))
    if family == "albert":
        c.update(embedding_size=draw(st.sampled_from([8, 16, hidden])), inner_group_num=draw(st.sampled_from([1, 2])),
                 num_hidden_groups=draw(st.sampled_from([1, 2])),
                 hidden_act=draw(st.sampled_from(["gelu_new", "gelu", "relu"])))
    if family == "mpnet":
        c["relative_attention_num_buckets"] = draw(st.sampled_from([8, 32, 64]))
    if family == "modernbert":
        c.update(local_attention=draw(st.sampled_from([2, 4, 8])),
                 global_attn_every_n_layers=draw(st.sampled_from([1, 2, 3])),
                 hidden_activation=draw(st.sampled_from(["gelu", "gelu_pytorch_tanh", "silu"])),
                 classifier_pooling=draw(st.sampled_from(["cls", "mean"])))
    if family in ("eurobert", "nomicbert"):
        c["rope_parameters"] = _rope(draw, st)
    if family == "eurobert":
        c["num_key_value_heads"] = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
        c["hidden_act"] = draw(st.sampled_from(["silu", "gelu"]))
    if family == "esm":
        c["position_embedding_type"] = draw(st.sampled_from(["rotary", "absolute"]))
    if family == "roformer":
        c["rotary_value"] = draw(st.booleans())
    if family.startswith("deberta"):
        c.update(relative_attention=draw(st.booleans()), max_relative_positions=draw(st.sampled_from([-1, 4, 12])),
                 pos_att_type=draw(st.sampled_from([[], ["c2p"], ["p2c"], ["c2p", "p2c"]])),
                 position_biased_input=draw(st.booleans()))
    if family == "deberta-v2":
        c.update(position_buckets=draw(st.sampled_from([-1, 4, 8])), share_att_key=draw(st.booleans()),
                 norm_rel_ebd=draw(st.sampled_from(["none", "layer_norm"])))
    return c


def _rope(draw, st) -> dict:
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "proportional"]))
    rope = {"rope_type": kind, "rope_theta": draw(st.sampled_from([10000.0, 500.0]))}
    if kind != "default":
        rope["factor"] = 2.0
    if kind == "yarn":
        rope["original_max_position_embeddings"] = 16
    if kind in ("linear", "proportional"):
        rope["partial_rotary_factor"] = draw(st.sampled_from([1.0, 0.5]))
    return rope


def cases(families=None):
    """A hypothesis strategy of `Case`s over `families` (default: every family bench.hf_parity builds)."""
    from hypothesis import strategies as st

    @st.composite
    def draw_case(draw):
        family = draw(st.sampled_from(list(families or FAMILIES)))
        heads = draw(st.sampled_from([1, 2, 4]))
        head_dim = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
        hidden = heads * head_dim
        base = family.removesuffix("-sinusoidal")
        config = {"hidden_size": hidden, "num_attention_heads": heads,
                  "num_hidden_layers": draw(st.sampled_from([1, 2])),
                  "intermediate_size": draw(st.sampled_from([7, 24]))}
        config.update(_family_config(draw, st, base, hidden, heads))
        seqlen = draw(st.integers(1, 9))
        batch = draw(st.integers(1, 3))
        lengths = tuple(draw(st.lists(st.integers(0, seqlen), min_size=batch, max_size=batch)))
        head = draw(st.sampled_from(HEADS))
        impl = draw(st.sampled_from(["eager", "sdpa"]))
        mask = draw(st.sampled_from(MASKS))
        return Case(family, head, impl, config, lengths, seqlen,
                    layout=draw(st.sampled_from(LAYOUTS)), mask=mask,
                    position_ids=draw(st.booleans()), packed=draw(st.integers(0, 3)) == 0,
                    embeds=draw(st.integers(0, 4)) == 0,
                    segments=draw(st.booleans()), labels=draw(st.integers(0, 3)) > 0,
                    padded_labels=mask in ("long", "bool", "float") and draw(st.integers(0, 3)) == 0,
                    mlm_logits=draw(st.booleans()), head_mask=draw(st.integers(0, 5)) == 0,
                    hidden_states=draw(st.sampled_from([True, True, 1, -1, [0, -1]])) if draw(st.integers(0, 7)) == 0
                    else False, seed=draw(st.integers(0, 2**16)))

    return draw_case()


# ---- building and running a case -----------------------------------------------------------------------------
def _model(case: Case):
    """The unfused model of `case` (eval mode, no dropout), or None where transformers has no such head."""
    import torch

    from bertfuse.bench.hf_parity import _record, build, model_class

    record = _record(case.family)
    if model_class(case.family, case.head) is None:
        return None
    names = dict(record.config_names)
    changes = {names.get(k, k): v for k, v in case.config.items()}
    torch.manual_seed(case.seed)
    model = build(case.family, case.head, **changes).eval()
    try:
        model.set_attn_implementation(case.impl)
    except (ValueError, ImportError):  # a family without it keeps its own
        pass
    if getattr(model.config, "_attn_implementation", case.impl) != case.impl:
        # a model that takes its implementation only when built (ModernBERT on transformers 5.1 and 5.2, which
        # otherwise asks for flash attention): built so, where it builds
        try:
            model = build(case.family, case.head, attn_implementation=case.impl, **changes).eval()
        except (ValueError, ImportError):
            pass
    return model


def _padding(case: Case):
    """[batch, seq] True at real tokens, laid out as `case.layout` says (every token, without a mask)."""
    import torch

    if case.mask == "none":
        return torch.ones(len(case.lengths), case.seqlen, dtype=torch.bool)
    rows = []
    for n in case.lengths:
        row = torch.arange(case.seqlen) < n
        if case.layout == "left":
            row = row.flip(0)
        elif case.layout == "holes" and 0 < n < case.seqlen:  # the real tokens around a gap of padding
            row = torch.zeros(case.seqlen, dtype=torch.bool)
            row[: (n + 1) // 2] = True
            row[case.seqlen - n // 2:] = True
        rows.append(row)
    return torch.stack(rows)


def _mask(case: Case, keys):
    import torch

    b, s = keys.shape
    if case.mask == "none":
        return None
    if case.mask == "long":
        return keys.long()
    if case.mask == "bool":
        return keys
    if case.mask == "float":
        return keys.float()
    if case.mask == "bool4":
        return keys[:, None, None, :].expand(b, 1, s, s)
    if case.family.startswith("deberta"):  # DeBERTa's code reads any mask as 1 = keep (mask.bool(), and scales by it)
        return keys.float()[:, None, None, :]
    return torch.where(keys, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]


def inputs(case: Case, model) -> dict:
    """The call's arguments: token ids (or their embeddings), mask, position ids, token types, labels."""
    import torch

    g = torch.Generator().manual_seed(case.seed)
    keys = _padding(case)
    b, s = keys.shape
    cfg = model.config
    vocab = cfg.vocab_size
    ids = torch.randint(5, vocab, (b, s), generator=g)
    x = {"attention_mask": _mask(case, keys)}
    if case.embeds:
        x["inputs_embeds"] = model.get_input_embeddings()(ids).detach()
    else:
        x["input_ids"] = ids
    if case.packed:  # a new sequence at random places: position ids from 0 at each
        token = torch.arange(s).expand(b, s)
        starts = (torch.rand(b, s, generator=g) < 0.3) | (token == 0)
        x["position_ids"] = token - torch.where(starts, token, 0).cummax(1).values
    elif case.position_ids:
        x["position_ids"] = torch.arange(s)[None].expand(b, s) + torch.randint(0, 3, (b, 1), generator=g)
    if case.segments and getattr(cfg, "type_vocab_size", 0) >= 2:
        x["token_type_ids"] = torch.randint(0, 2, (b, s), generator=g)
    if case.labels:
        x.update(_labels(case, keys, vocab, g))
    if case.head_mask and "head_mask" in inspect.signature(model.forward).parameters:  # what this release takes
        x["head_mask"] = torch.randint(0, 2, (cfg.num_hidden_layers, cfg.num_attention_heads), generator=g).float()
    if case.hidden_states is not False:
        x["output_hidden_states"] = case.hidden_states
    return x


def _labels(case: Case, keys, vocab: int, g) -> dict:
    import torch

    b, s = keys.shape
    labelled = keys | case.padded_labels
    if case.head == "ForMaskedLM":
        chosen = (torch.rand(b, s, generator=g) < 0.4) & labelled
        return {"labels": torch.where(chosen, torch.randint(0, vocab, (b, s), generator=g), -100)}
    if case.head == "ForTokenClassification":
        return {"labels": torch.where(labelled, torch.randint(0, 2, (b, s), generator=g), -100)}
    if case.head == "ForSequenceClassification":
        return {"labels": torch.randint(0, 2, (b,), generator=g)}
    if case.head == "ForQuestionAnswering":
        return {"start_positions": torch.randint(0, s, (b,), generator=g),
                "end_positions": torch.randint(0, s, (b,), generator=g)}
    return {}


def _call(model, x):
    """(output, None) or (None, the exception's type name)."""
    try:
        return model(**x), None
    except Exception as e:  # the original code refuses it: the fused code must too
        return None, type(e).__name__


def _compared(case: Case, out, keys) -> dict:
    """The outputs the fused drop-in promises to match: token-level ones at real positions, pooled ones and
    question answering's logits whole, the loss."""
    import torch

    got = {}
    every = case.hidden_states is not False  # every position of every hidden state, the last one's too
    for name in ("last_hidden_state", "logits", "pooler_output", "start_logits", "end_logits", "loss"):
        value = getattr(out, name, None)
        if value is None:
            continue
        token_level = (name == "last_hidden_state" and not every) or (name == "logits" and case.head in (
            "ForMaskedLM", "ForTokenClassification", "Model"))
        got[name] = value[keys] if token_level and value.dim() >= 2 and value.shape[:2] == keys.shape else value
    for i, state in enumerate(getattr(out, "hidden_states", None) or ()):  # one not selected: None, as empty
        got[f"hidden_states[{i}]"] = torch.empty(0) if state is None else state
    return got


def _differs(a, b) -> float:
    """max |a - b| / max |a|, NaN where they agree and equal infinities counting as equal; inf where only one
    is NaN."""
    import torch

    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return float("inf")
    a, b = a[~nan_a], b[~nan_b]
    if a.numel() == 0:
        return 0.0
    apart = torch.where(a == b, 0.0, (a - b).abs())  # equal infinities agree (their difference is NaN)
    finite = a[torch.isfinite(a)]
    scale = finite.abs().max().clamp_min(1e-6) if finite.numel() else torch.tensor(1e-6, dtype=a.dtype)
    return (apart.max() / scale).item()


def _grad_error(ours: dict, theirs: dict) -> float:
    """The worst parameter-gradient error, each scaled by max(its own largest reference gradient, 1e-2 of the
    model's largest, 1e-4) as bench.hf_parity.worst_grad does (some gradients are rounding noise around 0); a
    gradient on one side only counts as its size; no gradient anywhere, 0."""
    top = max((g.abs().max().item() for g in theirs.values()), default=0.0)
    worst = 0.0
    for name in set(ours) | set(theirs):
        mine, want = ours.get(name), theirs.get(name)
        mine = mine.double() if mine is not None else 0 * want.double()
        want = want.double() if want is not None else 0 * mine
        scale = max(want.abs().max().item(), 1e-2 * top, 1e-4)  # 1e-4 x GRAD_TOL: noise for an O(1) loss
        worst = max(worst, (mine - want).abs().max().item() / scale)
    return worst


class Answer(NamedTuple):
    outputs: dict   # the compared outputs (`_compared`), detached
    grads: dict     # parameter name -> gradient of the loss ({} without a finite loss)


def _answer(case: Case, model, x: dict, keys):
    """The model's `Answer` to the call, or the name of the exception it raises."""
    import torch

    out, err = _call(model, x)
    if err:
        return err
    got = _compared(case, out, keys)
    loss = got.get("loss")
    if loss is not None and loss.requires_grad and torch.isfinite(loss):
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return Answer({k: v.detach() for k, v in got.items()}, grads)


def _mismatch(case: Case, ours: Answer, theirs: Answer, x: dict, truth: Answer | None = None,
              jittered: Answer | None = None) -> str | None:
    """What differs between the fused answer and the unfused one (None: nothing beyond OUT_TOL / GRAD_TOL); given
    the float64 `truth`, what is further from it than twice PyTorch's own float32 error is (and than the
    tolerances): the unfused answer's, or that of the unfused model with its weights moved by a random 1e-6 of
    themselves (`jittered`), where the configuration amplifies float32 rounding (a LayerNorm over equal features
    divides by sqrt(eps))."""
    float32 = [a for a in (theirs, jittered) if a is not None]
    for name, value in theirs.outputs.items():
        if name not in ours.outputs:  # fuse(mlm_logits=False) forms no vocabulary logits where labels are given
            if name == "logits" and not case.mlm_logits and "labels" in x:
                continue
            return f"{name} missing"
        err = _differs(value, ours.outputs[name]) if truth is None else _differs(truth.outputs[name], ours.outputs[
            name]) - 2 * max(_differs(truth.outputs[name], a.outputs[name]) for a in float32)
        if err > OUT_TOL:
            return f"{name} differs by {err:.2e}" + (" beyond twice PyTorch's float32 error" if truth else "")
    err = _grad_error(ours.grads, theirs.grads) if truth is None else \
        _grad_error(ours.grads, truth.grads) - 2 * max(_grad_error(a.grads, truth.grads) for a in float32)
    if err > GRAD_TOL:
        return f"parameter gradients differ by {err:.2e}" + (" beyond twice PyTorch's float32 error" if truth else "")
    return None


SAME, BOTH_RAISE, NOT_BUILT, NOT_FINITE = "same answer", "both raise", "not built", "both not finite"
OUTCOMES = (SAME, BOTH_RAISE, NOT_BUILT, NOT_FINITE)


def run(case: Case, unchecked: bool = False) -> str:
    """SAME where the fused model gives the unfused model's answer to `case` (BOTH_RAISE where both refuse the
    call; NOT_BUILT where transformers builds no such model; NOT_FINITE where the unfused answer holds inf or NaN
    and the fused one does too: arithmetic on inf, in another order, need not agree further), and unfused again
    gives it to the bit, else what differs. `unchecked`: fuse code not recorded as checked too
    (fuse(..., unchecked_code=True)), to check a new release."""
    import torch

    from bertfuse.bert.hf import fuse

    transformers_logging().set_verbosity_error()  # tiny random configurations draw many notices
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref = _model(case)
        except Exception:  # a configuration transformers refuses to build: nothing to fuse
            return NOT_BUILT
        if ref is None:
            return NOT_BUILT
        try:
            fused = fuse(copy.deepcopy(ref), mlm_logits=case.mlm_logits, unchecked_code=unchecked)
        except Exception as e:  # fuse itself must never fail on a model transformers builds
            return f"fuse raises {type(e).__name__}: {e}"
        x, keys = inputs(case, ref), _padding(case)
        theirs, ours = _answer(case, ref, x, keys), _answer(case, fused, x, keys)
        if why := _unfused_again(case, fused, x, keys, theirs):
            return why
        if isinstance(theirs, str) or isinstance(ours, str):
            both = isinstance(theirs, str) and isinstance(ours, str)
            return BOTH_RAISE if both else f"unfused {_raised(theirs)}, fused {_raised(ours)}"
        if any(not torch.isfinite(v).all() for v in theirs.outputs.values()):
            finite = all(torch.isfinite(v).all() for v in ours.outputs.values())
            return "unfused not finite, fused finite" if finite else NOT_FINITE
        why = _mismatch(case, ours, theirs, x)
        if why:  # judged against float64, as the kernels' own tests are
            pristine = _model(case)  # the same weights again (seeded), never run
            wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in x.items()}
            truth = _answer(case, copy.deepcopy(pristine).double(), wide, keys)
            g = torch.Generator().manual_seed(case.seed)
            with torch.no_grad():  # each weight moved by a random 1e-6 of itself
                for p in pristine.parameters():
                    p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            jittered = _answer(case, pristine, x, keys)
            if not isinstance(truth, str) and not isinstance(jittered, str):
                why = _mismatch(case, ours, theirs, x, truth, jittered)
    return why or SAME


def _unfused_again(case: Case, fused, x: dict, keys, theirs) -> str | None:
    """What differs, to the bit, between the unfused model's answer and that of the fused one unfused (None:
    nothing)."""
    from bertfuse.bert.hf import unfuse

    fused.zero_grad(set_to_none=True)
    back = _answer(case, unfuse(fused), x, keys)
    if isinstance(theirs, str) or isinstance(back, str):
        return None if back == theirs else f"unfused {_raised(theirs)}, fused then unfused {_raised(back)}"
    if theirs.outputs.keys() != back.outputs.keys() or theirs.grads.keys() != back.grads.keys() or \
            any(_differs(v, back.outputs[k]) for k, v in theirs.outputs.items()) or \
            _grad_error(back.grads, theirs.grads):
        return "fused then unfused, the answer differs from the unfused model's"
    return None


def _raised(answer) -> str:
    return answer if isinstance(answer, str) else "runs"


def transformers_logging():
    from transformers.utils import logging

    return logging


# ---- the command ----------------------------------------------------------------------------------------------
def fuzz(n: int, seed: int, families=None, minutes: float | None = None, unchecked: bool = False) -> dict:
    """Run hypothesis over `n` cases (stopping early after `minutes`); raises AssertionError (hypothesis' shrunk
    case, with the line that reruns it) at the first case whose answers differ. Returns the counts of each
    outcome (`run`) and the time."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    start, counts = time.monotonic(), dict.fromkeys(OUTCOMES, 0)

    @with_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(cases(families))
    def check(case):
        if minutes is not None and time.monotonic() - start > 60 * minutes:
            return
        why = run(case, unchecked)
        assert why in counts, f"{why}: {case.line()}" + (" --unchecked" if unchecked else "")
        counts[why] += 1

    check()
    return {"cases": sum(counts.values()), **counts, "seconds": round(time.monotonic() - start, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.hf_fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=200, help="how many cases hypothesis draws")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", default=None, help="comma-separated (default: all)")
    p.add_argument("--minutes", type=float, default=None, help="stop drawing new cases after this long")
    p.add_argument("--interpret", action="store_true", help="the real kernels in Triton's interpreter")
    p.add_argument("--case", default=None, help="rerun one case: the JSON a failure printed")
    p.add_argument("--unchecked", action="store_true",
                   help="fuse transformers code not recorded as checked too (fuse(..., unchecked_code=True))")
    args = p.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by bert.hf's kernels)
    if args.case:
        try:
            case = Case(**json.loads(args.case))
        except (ValueError, TypeError) as e:
            print(f"hf_fuzz: --case is not a case: {e}", file=sys.stderr)
            return 2
        why = run(case, args.unchecked)
        print(why)
        return int(why not in OUTCOMES)
    families = args.families.split(",") if args.families else None
    try:
        result = fuzz(args.cases, args.seed, families, args.minutes, args.unchecked)
    except AssertionError as e:
        print(f"hf_fuzz: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
