"""The device's practical peaks, measured at the start of a run: copy bandwidth and dense matmul throughput."""
from __future__ import annotations

import time

import torch


CPU_REPEATS = (3, 10)  # (warm-up, timed) calls on a CPU; tests lower it


def timeit(fn, device: torch.device, warmup: int | None = None, reps: int | None = None) -> float:
    """Median seconds per call (CUDA: triton's do_bench with its L2 flush; CPU: wall clock)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    warmup = CPU_REPEATS[0] if warmup is None else warmup
    reps = CPU_REPEATS[1] if reps is None else reps
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_peaks(device: torch.device) -> dict:
    """{'copy_GBps', 'matmul_TFLOPs', 'matmul_dtype'}: one large copy and one large matmul."""
    if device.type == "cuda":
        n_bytes, dim, dtype = 2 << 30, 8192, torch.bfloat16
    else:
        n_bytes, dim, dtype = 256 << 20, 2048, torch.float32
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t_copy = timeit(lambda: dst.copy_(src), device)
    a = torch.randn(dim, dim, device=device, dtype=dtype)
    b = torch.randn(dim, dim, device=device, dtype=dtype)
    t_mm = timeit(lambda: a @ b, device)
    return {"copy_GBps": 2 * n_bytes / t_copy / 1e9, "matmul_TFLOPs": 2 * dim**3 / t_mm / 1e12,
            "matmul_dtype": str(dtype).replace("torch.", "")}
