"""Helpers for comparing our models with transformers' on the same weights."""
from __future__ import annotations

import collections
import inspect
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
        if g is None and r is None and (not p.requires_grad or ".contact_head." in name):
            continue  # frozen (RoFormer's sinusoid table), or ESM's contact head, which only predict_contacts runs
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
