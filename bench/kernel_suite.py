"""Per-kernel benchmarks: each kernel record's problems (bench/record.py) timed against its peers at BERT
shapes, torch eager and torch.compile included (GPU), and the memory of ops whose point is memory (the MLM loss,
on a CPU too).

Times are medians from triton.testing.do_bench. Bandwidth counts the bytes a kernel must move (each input read
once, each output written once); TFLOP/s counts real tokens only, with the backward taken as 2.5x the forward's
FLOPs (FlashAttention's convention: the recomputed QK^T included). Extra peak memory is that of one forward +
backward from a clean allocator state (GPU), or the peak RSS growth of a fresh process doing one (CPU).

An optimizer's problem (`Bench.step`) times one step over a model's parameters instead: `step_ms`, bandwidth
from the bytes the step must move (`step_GBps`, `copy_share`), and on a GPU the peak memory of its first step, the
optimizer's state included; its correctness is the smoke check's (bench.smoke).

Where a problem has an exact reference, each row also says how right the implementation is: `rel_err_fp64`, the
largest over its output and every input gradient of ||ours - exact|| / ||exact||, the exact values computed in
float64 on the same inputs, so that nobody wins by being wrong. Implementations that draw dropout have none.
"""
from __future__ import annotations

import torch

from .peaks import timeit
from .tune_timed import rel_err

# Set in bench.precompile's workers: each suite then runs only this project's implementations, once, untimed,
# so that their kernels compile (in parallel processes) into Triton's on-disk cache before the timed run.
WARM_ONLY = False


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _fwd_bwd_times(fn, inputs, device):
    """(forward, backward, forward+backward) seconds of fn(*inputs) -> tensor."""
    out = fn(*inputs)
    grad = torch.randn_like(out)
    t_fwd = timeit(lambda: fn(*inputs), device)
    t_bwd = timeit(lambda: out.backward(grad, retain_graph=True), device)
    t_all = timeit(lambda: fn(*inputs).backward(grad), device)
    for t in inputs:
        t.grad = None
    return t_fwd, t_bwd, t_all


def _backward(out: torch.Tensor) -> None:
    out.backward(torch.ones_like(out))  # a gradient of the output's size, as training passes one


def _run_once(case, fn, inputs) -> None:
    """One forward + backward, or one step of an optimizer's case."""
    if case.step:
        fn(*inputs)
    else:
        _backward(fn(*inputs))


def _gpu_peak(case, fn, inputs) -> float:
    """Bytes allocated beyond the inputs at the peak of one forward + backward (`_run_once`: of an optimizer's
    case, its first step, the state it allocates included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _run_once(case, fn, inputs)
    torch.cuda.synchronize()
    if not case.step:  # a step's inputs are the optimizer's parameters, whose gradients it reads again
        for t in inputs:
            t.grad = None
    return torch.cuda.max_memory_allocated() - base


def exact_error(case, impl: str, fn, inputs) -> float | None:
    """The largest ||ours - exact|| / ||exact|| over fn's output and the gradients of its inputs (for a fixed
    upstream gradient), the exact values by case.reference in float64 on the same inputs; None without a reference
    or for an impl that draws dropout. A gradient an implementation does not compute (None) is not compared."""
    if case.reference is None or "dropout" in impl:
        return None
    out = fn(*inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device)
    leaves = [t for t in inputs if t.requires_grad]
    got = [out, *torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)]
    exact_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    ref = case.reference(*exact_inputs)
    want = [ref, *torch.autograd.grad(ref, [t for t in exact_inputs if t.requires_grad], upstream.double(),
                                      allow_unused=True)]
    return max(rel_err(a, b) for a, b in zip(got, want) if a is not None and b is not None)


def _measure(case, impl, fn, device) -> dict:
    """A row's peak memory (on a GPU; an optimizer's, that of its first step, the state it allocates included) and
    times: forward, backward and both with their error to the exact reference, or an optimizer's step."""
    inputs = case.inputs()
    row = {}
    if device.type == "cuda":
        row["peak_extra_MB"] = _gpu_peak(case, fn, inputs) / 2**20
    if case.step:
        row["step_ms"] = timeit(lambda: fn(*inputs), device) * 1e3
        return row
    t_fwd, t_bwd, t_all = _fwd_bwd_times(fn, inputs, device)
    row.update(fwd_ms=t_fwd * 1e3, bwd_ms=t_bwd * 1e3, fwd_bwd_ms=t_all * 1e3)
    error = exact_error(case, impl, fn, inputs)
    if error is not None:
        row["rel_err_fp64"] = error
    return row


def _cpu_child(name: str, shape, index: int, impl: str, full: bool):
    """In a fresh process: (peak RSS growth in bytes during one forward+backward, the error to the float64
    reference or None). No time: on a CPU the Triton rows run in Triton's interpreter, whose speed says nothing
    of the kernels', so no row of the CPU table is timed."""
    from bertfuse.bench.ops import record

    from .e2e import peak_rss_mb, rss_mb

    case = list(record(name).bench(shape, torch.device("cpu"), torch.float32, full))[index]
    fn, inputs = case.impls[impl], case.inputs()
    before = rss_mb()
    _run_once(case, fn, inputs)
    extra = (peak_rss_mb() - before) * 2**20
    return extra, exact_error(case, impl, fn, case.inputs())


def _rates(row: dict, case, peaks: dict) -> dict:
    if case.step:
        gbps = case.bytes_fwd / (row["step_ms"] / 1e3) / 1e9
        return dict(row, step_GBps=gbps, copy_share=gbps / peaks["copy_GBps"])
    if case.bytes_fwd:
        gbps = (case.bytes_fwd + case.bytes_bwd) / (row["fwd_bwd_ms"] / 1e3) / 1e9
        row.update(fwd_bwd_GBps=gbps, copy_share=gbps / peaks["copy_GBps"])
    if case.flops_fwd:
        row.update(fwd_TFLOPs=case.flops_fwd / row["fwd_ms"] / 1e9,
                   bwd_TFLOPs=2.5 * case.flops_fwd / row["bwd_ms"] / 1e9)
    return row


def _case_rows(record, shape, index, case, peaks, device, full, fresh):
    """One row per implementation of one problem, yielded as each is measured; `fresh`: each in its own process
    (CPU memory)."""
    impls = dict(case.impls)
    if device.type == "cuda" and "torch-eager" in impls:  # compiling on a CPU takes minutes and says nothing
        impls["torch-compile"] = torch.compile(impls["torch-eager"])
    for name, fn in impls.items():
        row = {"kernel": case.kernel, "shape": case.shape, "impl": name,
               "dtype": str(_dtype(device)).replace("torch.", ""), **case.extra,
               **({"measure": "step"} if case.step else {})}
        if isinstance(fn, str):
            yield dict(row, status=f"skipped: {fn}")
            continue
        if WARM_ONLY:
            if "ours" in name:
                _run_once(case, fn, case.inputs())
            continue
        try:
            if fresh:
                from .e2e import in_fresh_process

                extra, error = in_fresh_process(_cpu_child, record.name, shape, index, name, full,
                                                env={"TRITON_INTERPRET": "1"})  # Triton on a CPU
                row.update(peak_extra_MB=extra / 2**20)
                if error is not None:
                    row["rel_err_fp64"] = error
            else:
                row.update(_rates(_measure(case, name, fn, device), case, peaks))
            row["status"] = "ok"
        except Exception as e:  # one implementation failing costs its row only
            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield row


def rows(record, peaks: dict, quick: bool, device: torch.device, shapes=None, on_row=None) -> list[dict]:
    """The rows of one kernel record at its quick or full shapes on a GPU, its CPU shapes on a CPU (none: the op
    is timed on GPUs only), or at `shapes` (the tests' tiny ones); on_row(row) as each row is measured (a run cut
    short by its time budget keeps every finished row)."""
    cuda, known = device.type == "cuda", record.bench_shapes
    fresh = not cuda and known.cpu is not None
    if shapes is None:
        shapes = (known.quick if quick else known.full) if cuda else known.cpu
    out = []
    for shape in shapes or []:
        for index, case in enumerate(record.bench(shape, device, _dtype(device), not quick)):
            for row in _case_rows(record, shape, index, case, peaks, device, not quick, fresh):
                out.append(row)
                if on_row is not None:
                    on_row(row)
    return out
