"""Helpers for comparing our models with transformers' on the same weights."""
from __future__ import annotations

import collections
import functools
import inspect
import json
import sys

import torch

TOL = 1e-5  # float32 relative error allowed against transformers


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the reference's scale."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def random_batch(vocab, batch=4, seqlen=17, lengths=None, seed=0, pairs=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seqlen), generator=g)
    if lengths is None:
        lengths = torch.randint(1, seqlen + 1, (batch,), generator=g)
        lengths[0] = seqlen
    lengths = torch.as_tensor(lengths)
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    tt = torch.randint(0, 2, (batch, seqlen), generator=g) if pairs else torch.zeros_like(ids)
    return ids, mask, tt


def mlm_features(lengths, seed=0) -> list[dict]:
    """MLM features (input_ids, labels: about 40% of tokens labelled) of these lengths, as a dataset holds them."""
    g = torch.Generator().manual_seed(seed)
    features = []
    for n in lengths:
        ids = torch.randint(3, 99, (n,), generator=g)
        features.append({"input_ids": ids.tolist(),
                         "labels": torch.where(torch.rand(n, generator=g) < 0.4, ids, -100).tolist()})
    return features


def flattened(lengths, seed=0, **flags):
    """transformers' DataCollatorWithFlattening (`flags` its options) of `mlm_features`: one padding-free row,
    position ids restarting at each sequence."""
    import transformers

    return transformers.DataCollatorWithFlattening(return_tensors="pt", **flags)(mlm_features(lengths, seed))


def mlm_labels(ids, mask, vocab, p=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.rand(ids.shape, generator=g) < p) & mask.bool()
    chosen[0, 0] = True  # at least one labelled token
    return torch.where(chosen, torch.randint(0, vocab, ids.shape, generator=g), -100)


def grad_errors(ours: torch.nn.Module, theirs: torch.nn.Module) -> dict[str, float]:
    """Relative error of every parameter gradient, matched by name.

    Each error is scaled by the larger of the tensor's own largest reference gradient and 1e-2 of the largest
    gradient in the model. The floor matters for gradients that are exactly zero in exact arithmetic, where both
    sides hold only rounding noise: softmax ignores a shift shared by all its inputs, so the key projection's bias
    always gets zero gradient, and so do the QA head's bias and the last LayerNorm's bias under the QA loss.
    """
    ref = dict(theirs.named_parameters())
    floor = 1e-2 * max(p.grad.abs().max().item() for p in theirs.parameters() if p.grad is not None)
    errs = {}
    for name, p in ours.named_parameters():
        g, r = p.grad, ref[name].grad
        if g is None and r is None:
            continue  # frozen (RoFormer's sinusoid table), ESM's contact head (only predict_contacts runs it), or
            # a parameter neither model's loss reaches (transformers 5.0's CamemBERT lm_head.bias, untied)
        assert g is not None and r is not None, f"no gradient for {name}"
        scale = max(r.abs().max().item(), floor)
        errs[name] = ((g.double() - r.double()).abs().max() / scale).item()
    return errs


def assert_same_gradients(ours: torch.nn.Module, theirs: torch.nn.Module, our_loss: torch.Tensor,
                          their_loss: torch.Tensor, exempt: tuple[str, ...] = ()) -> None:
    """Backpropagates both losses; every parameter gradient within TOL of the reference's (grad_errors' scaling),
    but those named in `exempt` (gradients exactly zero in exact arithmetic, which the caller checks itself)."""
    their_loss.backward()
    our_loss.backward()
    errs = {n: e for n, e in grad_errors(ours, theirs).items() if n not in exempt}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])


def assert_grads_no_worse(ours: torch.nn.Module, own: torch.nn.Module, truth: torch.nn.Module,
                          floor: float = 2e-3) -> None:
    """Per parameter (grad_errors' scaling): our gradient's error against `truth` (the model in a higher
    precision) at most twice the reference implementation's own error in the same precision as ours (float32,
    or half-precision autocast), or `floor` (below that a ratio of errors is rounding luck: two float16 ulps by
    default). Per parameter, so that no small gradient hides behind the embeddings' large ones."""
    mine, theirs = grad_errors(ours, truth), grad_errors(own, truth)
    too_far = {n: (round(e, 6), round(theirs[n], 6)) for n, e in mine.items() if e > max(2 * theirs[n], floor)}
    assert not too_far, too_far


class Calls:
    """Records the kernel calls the fused model makes (a silent fallback to PyTorch would make none): each
    call's entry point and its arguments by name. fixed_seeds: a call that takes a seed gets 1000 + its index,
    so that a test can rebuild the dropout mask the kernel drew."""

    def __init__(self, monkeypatch, fixed_seeds=False):
        from bertfuse import kernels
        from bertfuse.bert.model import ops

        self.calls = []
        for module, name in ops.TRITON.items():  # each op's entry point of kernels (the model's table)
            original = getattr(kernels, name)

            def recorded(*a, _name=name, _original=original, _signature=inspect.signature(original), **k):
                bound = _signature.bind(*a, **k)
                bound.apply_defaults()
                if fixed_seeds and "seed" in bound.arguments:
                    bound.arguments["seed"] = 1000 + len(self.calls)
                self.calls.append((_name, dict(bound.arguments)))
                return _original(*bound.args, **bound.kwargs)
            # the package's name (bert.model.ops calls it) and the op module's own (its drop-in module calls that)
            monkeypatch.setattr(kernels, name, recorded)
            monkeypatch.setattr(sys.modules[f"bertfuse.kernels.{module}"], name, recorded)

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(name for name, _ in self.calls)

    def of(self, name: str) -> list[dict]:
        """The arguments of every call of entry point `name`, in order."""
        return [arguments for n, arguments in self.calls if n == name]


def refused_here() -> dict[str, str]:
    """The model types whose attention fuse does not fuse on the installed transformers (code not checked there,
    bertfuse.bert.hf.code; a subclass of transformers' own; a mask made so that a plain call runs the original
    code), or that this release does not have: model type -> why. Read from the committed release table where it has the
    installed release (bench/results/hf_versions/results.json), else found by fusing a small model of each."""
    import transformers

    return dict(_refused(transformers.__version__))


@functools.cache
def _refused(version: str) -> tuple[tuple[str, str], ...]:
    from bertfuse.bench import hf_fuzz, hf_versions

    rows = json.loads((hf_versions.RESULTS / "results.json").read_text())
    if version in rows:
        cells = {f: c.get("cell", "") for f, c in rows[version]["families"].items()}
    else:
        cells = {f: hf_versions._probe(f) if hf_versions._head(f) else "absent" for f in hf_fuzz.FAMILIES}
    cells = {f: "not in this release" if why == "absent" else why for f, why in cells.items()}
    return tuple((f, why) for f, why in cells.items() if why != "fused")


def names_model_type(test_name: str, family: str) -> bool:
    """Whether a test's name names the model type (`test_nomicbert_post_norm...`), as a whole word."""
    return f"_{family.replace('-', '_')}_" in f"_{test_name.split('[')[0]}_"


def needs_transformers(version: str, what: str) -> None:
    """Skip the calling test on a transformers older than `version`, which does not have `what` (the compatibility
    tier runs the drop-in tests on older releases: a call the unfused model cannot make there tests nothing)."""
    import pytest
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(version):
        pytest.skip(f"transformers {transformers.__version__} has no {what} (from {version})")
