"""`python -m bertfuse.bench.smoke`: every kernel forward and backward once, and one BERT training step on the triton
backend against the torch backend; one `PASS`/`FAIL name: max error, tolerance` line per check.

On a GPU the checks run at one BERT-base shape (16 sequences of Wikipedia lengths up to 128, hidden 768,
12 heads of 64, intermediate 3072, vocabulary 30,522) in bfloat16 and float16, each check in its own worker
process (`--jobs`), so the kernels compile on all cores at once and fill Triton's on-disk cache for the later
stages. On a CPU the same checks run at small shapes in Triton's interpreter, in float32 and float16 (the
interpreter computes bfloat16 dots wrongly), so CI runs them too.

Each kernel check compares the kernel's outputs and the gradient of every input with a plain PyTorch reference
run in float64 on the same rounded inputs (with the kernel's own dropout mask): the error, max |ours - ref|
over max(|ref|, 1), must stay within twice PyTorch's own error in the same dtype plus one rounding unit
(float32: 1e-5). The model check compares the loss and all parameter gradients (relative norm error) of the
triton backend with the torch backend in float32, against twice the torch backend's own error at that
precision (float32: 1e-4). The exit status is 1 if any check fails.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import sys
import traceback
from typing import NamedTuple

import torch


class Shapes(NamedTuple):
    kernels: object       # bench.record.SmokeShapes: every kernel check's problem size
    config: str           # bert.BertConfig preset of the model checks
    batch: int            # model checks: sequences of up to seq_len tokens
    seq_len: int


def shapes_for(cuda: bool) -> Shapes:
    from bertfuse.bench.record import SmokeShapes  # imports triton: only once TRITON_INTERPRET is settled

    if cuda:
        return Shapes(SmokeShapes((128, 97, 64, 128, 31, 1, 110, 128, 76, 128, 55, 128, 9, 120, 128, 88), 12, 64,
                                  3072, 30522), "base", 16, 128)
    return Shapes(SmokeShapes((37, 0, 1, 16, 50), 2, 32, 96, 300), "tiny", 4, 32)


class Result(NamedTuple):
    name: str
    dtype: str
    passed: bool
    error: float
    tolerance: float
    worst: str           # the output whose error is shown
    detail: str = ""

    def line(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'} {self.name} {self.dtype}"
        if self.detail and not math.isfinite(self.error):
            return f"{head}: {self.detail.splitlines()[0]}"
        return f"{head}: max error {self.error:.3g} ({self.worst}), tolerance {self.tolerance:.3g}"


def _errors(ours, ref64, same, dtype) -> tuple[float, float]:
    """(our error, tolerance) at the reference's scale (at least 1: inputs are O(1))."""
    ref = ref64.double()
    if not ref.numel():
        return 0.0, 0.0
    scale = max(ref.abs().max().item(), 1.0)
    if not torch.isfinite(ours).all():
        return float("inf"), 0.0
    err = (ours.double() - ref).abs().max().item() / scale
    if dtype == torch.float32:
        return err, 1e-5
    base = (same.double() - ref).abs().max().item() / scale
    return err, 2 * base + torch.finfo(dtype).eps


def compare(name, dtype, inputs, ours_fn, ref_fn, names) -> Result:
    """Run ours_fn and ref_fn (float64 and dtype) on the same rounded inputs; compare outputs and gradients (none
    where `names` names the output only: an op without autograd, such as an optimizer step)."""
    g = torch.Generator().manual_seed(1)
    rounded = [t.to(dtype) for t in inputs]
    runs = []
    for fn, cast in ((ours_fn, dtype), (ref_fn, torch.float64), (ref_fn, dtype)):
        leaves = [t.to(cast).requires_grad_(len(names) > 1) for t in rounded]
        out = fn(*leaves)
        if len(names) == 1:
            runs.append([out])
            continue
        if not runs:
            dout = torch.randn(out.shape, generator=g).to(out.device)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        runs.append([out, *grads])
    worst = max(((*_errors(o, r, s, dtype), n) for o, r, s, n in zip(*runs, names)),
                key=lambda e: e[0] / e[1] if e[1] else (0.0 if e[0] == 0 else math.inf))
    return Result(name, str(dtype).replace("torch.", ""), worst[0] <= worst[1], worst[0], worst[1], worst[2])


# -- the checks -----------------------------------------------------------------------------------------------------

def kernel_check(build):
    """A check of one kernel record's smoke case (bench/record.py)."""
    def check(s: Shapes, dtype, device) -> Result:
        case = build(s.kernels, device)
        return compare(case.name, dtype, case.inputs, case.ours, case.reference, case.outputs)
    return check


def _model_step(model, batch, device, dtype):
    """(loss, flat gradient) of one forward + backward, under autocast for half precision."""
    from .batches import model_kwargs

    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(**model_kwargs(batch)).loss
    loss.backward()
    grads = [p.grad.flatten().double() for p in model.parameters() if p.grad is not None]
    return loss.detach().double(), torch.cat(grads)


def check_bert_step(s: Shapes, dtype, device, packed: bool = False) -> Result:
    """BertForPreTraining, dropout off: the triton backend in `dtype` against the torch backend in float32, on a
    padded batch or (packed) on a packed one of fixed shapes."""
    from bertfuse import bert

    from .batches import make_batch, make_packed_batch

    cfg = bert.BertConfig.preset(s.config, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 vocab_size=s.kernels.vocab)
    torch.manual_seed(0)
    reference = bert.BertForPreTraining(cfg.replace(backend="torch")).to(device)
    fused = bert.BertForPreTraining(cfg.replace(backend="triton")).to(device)
    fused.load_state_dict(reference.state_dict())
    batch = (make_packed_batch if packed else make_batch)(s.batch, s.seq_len, cfg.vocab_size, "wiki", seed=3).to(device)
    loss32, grad32 = _model_step(reference, batch, device, torch.float32)
    loss, grad = _model_step(fused, batch, device, dtype)
    if dtype == torch.float32:
        base, floor = 0.0, 1e-4
    else:
        loss_same, grad_same = _model_step(reference, batch, device, dtype)
        base = max(abs(loss_same - loss32).item() / abs(loss32).item(),
                   ((grad_same - grad32).norm() / grad32.norm()).item())
        floor = torch.finfo(dtype).eps
    errors = {"loss": abs(loss - loss32).item() / abs(loss32).item(),
              "gradients": ((grad - grad32).norm() / grad32.norm()).item()}
    worst = max(errors, key=errors.get)
    err = errors[worst] if all(math.isfinite(e) for e in errors.values()) else float("inf")
    tol = max(2 * base, floor)
    name = f"bert step ({s.config}{', packed' if packed else ''}) triton vs torch"
    return Result(name, str(dtype).replace("torch.", ""), err <= tol, err, tol, worst)


def check_bert_step_packed(s: Shapes, dtype, device) -> Result:
    return check_bert_step(s, dtype, device, packed=True)


CHECKS: dict = {}  # name -> fn(Shapes, dtype, device) -> Result, filled by checks() (tests may add their own)


def checks() -> dict:
    """Every kernel record's smoke cases (in the records' order), then the model checks. Importing the records
    imports triton, so this runs only once TRITON_INTERPRET is settled (main, or a worker it spawned). Filled once:
    the model checks, always present, say it has been."""
    if "bert_step" not in CHECKS:
        from bertfuse.bench.ops import records

        found = {name: kernel_check(build) for r in records() for name, build in r.smoke.items()}
        for name, check in dict(found, bert_step=check_bert_step, bert_step_packed=check_bert_step_packed).items():
            CHECKS.setdefault(name, check)
    return CHECKS


def run_one(check: str, dtype_name: str, device_name: str) -> Result:
    """One check, never raising: an exception is a failure with its message."""
    device = torch.device(device_name)
    try:
        return checks()[check](shapes_for(device.type == "cuda"), getattr(torch, dtype_name), device)
    except Exception as e:  # a crash is a failed check, reported on its line
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return Result(check, dtype_name, False, float("inf"), 0.0, "", f"{type(e).__name__}: {first}\n"
                      + traceback.format_exc(limit=-3))


def run_all(device: torch.device, dtypes, checks, jobs: int):
    """Yields the results in order, each as soon as it and those before it are done."""
    work = [(c, d, str(device)) for d in dtypes for c in checks]
    if jobs <= 1:
        yield from (run_one(*w) for w in work)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        yield from pool.map(run_one, *zip(*work))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "float16", "bfloat16"],
                   help="default: bfloat16 float16 on a GPU, float32 float16 on a CPU")
    p.add_argument("--checks", nargs="+", choices=list(checks()), default=list(checks()))
    p.add_argument("--jobs", type=int, help="worker processes (default: one per check on a GPU, up to the CPU "
                                            "count; none on a CPU)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    first = argparse.ArgumentParser(add_help=False)  # the device decides the interpreter, before triton loads
    first.add_argument("--device")
    wanted = first.parse_known_args(argv)[0].device
    device = torch.device(wanted or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernel records)
        if "triton" in sys.modules:
            print("bench.smoke: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
            return 2
    args = parse_args(argv)
    cuda = device.type == "cuda"
    dtypes = args.dtypes or (["bfloat16", "float16"] if cuda else ["float32", "float16"])
    jobs = args.jobs if args.jobs is not None else (min(len(dtypes) * len(args.checks), os.cpu_count() or 1)
                                                    if cuda else 1)
    shapes = shapes_for(cuda)
    print(f"# smoke on {torch.cuda.get_device_name(device) if cuda else 'cpu (Triton interpreter)'}: "
          f"{len(shapes.kernels.lengths)} sequences, {shapes.kernels.tokens} tokens, hidden {shapes.kernels.hidden}, "
          f"model {shapes.config}; {', '.join(dtypes)}; {jobs} worker(s)", flush=True)
    results = []
    for r in run_all(device, dtypes, args.checks, jobs):
        results.append(r)
        print(r.line(), flush=True)
        if r.detail and not r.passed:
            print("    " + "\n    ".join(r.detail.splitlines()[1:]), flush=True)
        if args.json:  # after every check: a run stopped at its time limit keeps what it checked
            with open(args.json + ".tmp", "w", encoding="utf-8") as f:
                json.dump([r._asdict() for r in results], f, indent=1)
            os.replace(args.json + ".tmp", args.json)
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
