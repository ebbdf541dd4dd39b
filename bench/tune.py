"""`python -m bench.tune`: measure every kernel's launch configs on this GPU and write the winners to a table.

For each kernel at the shapes BERT uses (base and large: hidden 768/1024, intermediate 3072/4096, head_dim 64,
sequences of 128 and 512; bfloat16, then float16), the candidates (block sizes, num_warps, num_stages; the
launcher's default always among them) are

1. pruned, in parallel worker processes, to those that compile for this GPU's architecture without register
   spills, within shared memory, with half-precision dots on wgmma and 16-byte vectors where the compile check
   demands them (bench/compile_check.py, the rules of tests/compile_sm90.py); on a GPU the same workers then run
   each survivor once, so that Triton's on-disk cache holds it before timing starts;
2. timed one after another (triton's do_bench, median, after warm-up) through the real launcher, with the
   config forced (kernels.tuned.forced);
3. checked: the winner's outputs (or gradients) against the default config's on the same inputs and the same
   dropout seed (dropout masks depend on coordinates only, not on tiles); a winner that differs is dropped
   for the next best;

and the winners are merged into `<output>/<arch>.json` (written to a temporary name, then renamed). Launchers
read that table at first launch (kernels/tuned.py). The budget stops the sweep between problems: what was
measured by then is written.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import multiprocessing
import os
import sys
import time
from typing import Callable, NamedTuple

import torch

FAMILIES = ("attention", "layer_norm", "bias_gelu", "mlm_loss")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class Problem(NamedTuple):
    kernel: str          # table name: "attention.fwd", "layer_norm.bwd", ...
    dtype: torch.dtype
    size: int            # head_dim or hidden size: the table key
    seq_len: int | None  # the attention's max_seqlen (its table bucket); None elsewhere
    shape: tuple         # the family's problem size (see setup)

    @property
    def key(self) -> str:
        from kernels import tuned

        return tuned.entry_key(self.dtype, self.size, tuned.bucket(self.seq_len))

    def __str__(self):
        return f"{self.kernel} {self.key} {self.shape}"


def _grid(**axes) -> list[dict]:
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def candidates(kernel: str) -> list[dict]:
    """The configs swept per kernel, before pruning (the default is added to them)."""
    return {
        "attention.fwd": _grid(BLOCK_M=[64, 128], BLOCK_N=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3]),
        "attention.dkdv": _grid(BLOCK_M=[16, 32, 64], BLOCK_N=[64, 128], num_warps=[4, 8], num_stages=[1, 2]),
        "attention.dq": _grid(BLOCK_M=[64, 128], BLOCK_N=[16, 32, 64], num_warps=[4, 8], num_stages=[1, 2]),
        "layer_norm.fwd": _grid(BLOCK_M=[1, 2, 4, 8, 16], num_warps=[2, 4, 8, 16]),
        "layer_norm.bwd": _grid(BLOCK_M=[1, 2, 4, 8, 16], num_warps=[2, 4, 8, 16]),
        "bias_gelu.fwd": [c for c in _grid(BLOCK_M=[2, 4, 8, 16], BLOCK_N=[256, 512, 1024], num_warps=[4, 8])
                          if c["BLOCK_M"] * c["BLOCK_N"] <= 8192],
        "bias_gelu.bwd": [c for c in _grid(BLOCK_M=[2, 4, 8, 16], BLOCK_N=[256, 512, 1024], num_warps=[4, 8])
                          if c["BLOCK_M"] * c["BLOCK_N"] <= 8192],
        "mlm_loss.fwd": _grid(BLOCK_M=[64, 128], BLOCK_V=[64, 128, 256], BLOCK_H=[64], num_warps=[4, 8],
                              num_stages=[3]),
        "mlm_loss.dhidden": _grid(BLOCK_M=[64, 128], BLOCK_V=[64, 128], BLOCK_HO=[128, 256], num_warps=[8],
                                  num_stages=[2, 3]),
        "mlm_loss.dweight": _grid(BLOCK_M=[32, 64], BLOCK_V=[64, 128], BLOCK_HO=[128, 256], num_warps=[8],
                                  num_stages=[2, 3]),
    }[kernel]


def problems(families, dtypes) -> list[Problem]:
    """BERT's shapes, most used first: base before large, s128 before s512, the first dtype before the next."""
    out = []
    for dtype in dtypes:
        for seq in (128, 512):
            out += [Problem(f"attention.{k}", dtype, 64, seq, (24576 // seq, seq, 12)) for k in ("fwd", "dkdv", "dq")]
        for h, i in ((768, 3072), (1024, 4096)):
            out += [Problem(f"layer_norm.{k}", dtype, h, None, (16384, h)) for k in ("fwd", "bwd")]
            out += [Problem(f"bias_gelu.{k}", dtype, i, None, (16384, i)) for k in ("fwd", "bwd")]
            out += [Problem(f"mlm_loss.{k}", dtype, h, None, (4915, h, 30522)) for k in ("fwd", "dhidden", "dweight")]
    return [p for p in out if p.kernel.split(".")[0] in families]


def default_launch(kernel: str, dtype, size: int) -> NamedTuple:
    """The launcher's built-in config for a table kernel name ("attention.fwd", "layer_norm.bwd", ...)."""
    family, part = kernel.split(".")
    module = sys.modules[f"kernels.{family}"] if f"kernels.{family}" in sys.modules else None
    if module is None:
        import kernels  # noqa: F401  (imports every kernel module)
        module = sys.modules[f"kernels.{family}"]
    if family == "attention":
        return module._default_config(part, size, dtype)
    if family == "mlm_loss":
        return module._tiles(part, size, dtype)
    return module._config(part, torch.empty((1, size), dtype=dtype, device="meta"), size)


# -- one problem on the device: build inputs, return what to time and what to compare -------------------------------

class Run(NamedTuple):
    timed: Callable[[], object]       # the call whose time is the kernel's (a forward, or a backward)
    outputs: Callable[[], list]       # the tensors that kernel produces, to compare across configs


def _backward_run(forward, inputs, grad_of) -> Run:
    """A Run timing the backward of forward(*inputs) (graph kept), comparing the gradients of grad_of."""
    out = forward(*inputs)
    grad = torch.randn_like(out)

    def timed():
        out.backward(grad, retain_graph=True)

    def outputs():
        for t in inputs:
            t.grad = None
        forward(*inputs).backward(grad)
        return [t.grad for t in grad_of]

    return Run(timed, outputs)


def setup(problem: Problem, device: torch.device) -> Run:
    import kernels

    family, part = problem.kernel.split(".")
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, problem.dtype).requires_grad_()

    if family == "attention":
        batch, seq, heads = problem.shape
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        cu = cu.to(device)
        q, k, v = (randn(int(lengths.sum()), heads, problem.size) for _ in range(3))

        def fn(q, k, v):
            return kernels.varlen_attention(q, k, v, cu, seq, dropout_p=0.1, seed=1234, validate=False)
        inputs, grad_of = (q, k, v), ((q,) if part == "dq" else (k, v))
    elif family == "layer_norm":
        tokens, h = problem.shape
        x, r, w, b = randn(tokens, h), randn(tokens, h), randn(h), randn(h)

        def fn(x, r, w, b):
            return kernels.layer_norm(x, w, b, 1e-12, residual=r, dropout_p=0.1, seed=1234)
        inputs, grad_of = (x, r, w, b), (x, r, w, b)
    elif family == "bias_gelu":
        tokens, n = problem.shape
        x, b = randn(tokens, n), randn(n)
        fn, inputs, grad_of = kernels.bias_gelu, (x, b), (x, b)
    else:
        rows, h, vocab = problem.shape
        hid, w, b = randn(rows, h), randn(vocab, h, scale=0.05), randn(vocab, scale=0.05)
        labels = torch.randint(0, vocab, (rows,), generator=g).to(device)

        def fn(hid, w, b):
            return kernels.masked_lm_loss(hid, w, b, labels)
        inputs, grad_of = (hid, w, b), ((hid,) if part == "dhidden" else (w, b))
    if part == "fwd":
        def forward():
            with torch.no_grad():
                return fn(*inputs)
        return Run(forward, lambda: [forward()])
    return _backward_run(fn, inputs, grad_of)


def run_with(problem: Problem, config: dict, run: Run, what: str):
    from kernels import tuned

    with tuned.forced(problem.kernel, config):
        return getattr(run, what)()


def do_bench_timer(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


# -- pruning, in worker processes -----------------------------------------------------------------------------------

def _check_candidate(problem: Problem, config: dict, arch: int, warm: bool) -> str | None:
    """In a worker: None if the candidate compiles cleanly for `arch` (and, on a GPU, after running it once so
    that Triton's disk cache holds it), else the reason it was pruned."""
    from . import compile_check

    failure, _ = compile_check.check(compile_check.variant_for(problem.kernel, problem.dtype, problem.size, config),
                                     arch)
    if failure is None and warm:
        try:
            run_with(problem, config, setup(problem, torch.device("cuda")), "timed")
            torch.cuda.synchronize()
        except Exception as e:  # e.g. out of resources on this GPU
            failure = f"fails to run: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return failure


def prune(problem: Problem, configs: list[dict], arch: int, jobs: int, warm: bool) -> tuple[list[dict], dict]:
    """(configs that pass, {config as JSON: reason} for those that do not), checked in `jobs` spawned processes
    started without TRITON_INTERPRET (the compiler must be real)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            reasons = list(pool.map(_check_candidate, itertools.repeat(problem), configs, itertools.repeat(arch),
                                    itertools.repeat(warm)))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    kept = [c for c, r in zip(configs, reasons) if r is None]
    return kept, {json.dumps(c, sort_keys=True): r for c, r in zip(configs, reasons) if r is not None}


# -- the sweep ------------------------------------------------------------------------------------------------------

def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tune_problem(problem: Problem, device: torch.device, timer, prune_fn=None, configs=None) -> dict | None:
    """The table entry for one problem: {"config", "ms", "default_ms", "candidates", "pruned"}; None if no
    candidate survives (the default then stays)."""
    default = default_launch(problem.kernel, problem.dtype, problem.size)._asdict()
    swept = configs if configs is not None else candidates(problem.kernel)
    base = {k: default[k] for k in swept[0]}  # only the fields the sweep varies
    pool = []
    for config in [*swept, base]:
        config = dict(base, **config)
        if config not in pool:
            pool.append(config)
    kept, pruned = prune_fn(problem, pool) if prune_fn else (pool, {})
    if not kept:
        return None
    run = setup(problem, device)
    times = []
    for config in kept:
        try:
            times.append((timer(lambda c=config: run_with(problem, c, run, "timed")), config))
        except Exception as e:  # a config that compiles but cannot launch here
            pruned[json.dumps(config, sort_keys=True)] = f"fails to run: {type(e).__name__}"
    reference = run_with(problem, base, run, "outputs")
    default_ms = next((t for t, c in times if c == base), None)
    for t, config in sorted(times, key=lambda tc: tc[0]):
        outputs = run_with(problem, config, run, "outputs")
        if max(_rel_err(o, r) for o, r in zip(outputs, reference)) <= TOLERANCE[problem.dtype]:
            return {"config": config, "ms": t, "default_ms": default_ms, "candidates": len(pool),
                    "pruned": len(pruned)}
        pruned[json.dumps(config, sort_keys=True)] = "output differs from the default config's"
    return None


def write_table(folder: str, arch: str, results: dict, meta: dict) -> str:
    """Merge {kernel: {key: entry}} into <folder>/<arch>.json, atomically; returns the path."""
    from bert.checkpoint import atomic_write
    from kernels import tuned

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{arch}.json")
    table = tuned.load_table(folder, arch) or {"format": tuned.FORMAT, "arch": arch, "kernels": {}}
    table = json.loads(json.dumps(table))  # a copy: load_table's result is cached
    table.update(meta)
    for kernel, entries in results.items():
        table["kernels"].setdefault(kernel, {}).update(entries)
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")

    atomic_write(path, write)
    tuned.clear_cache()
    return path


def sweep(todo: list[Problem], device: torch.device, budget: float, timer, prune_fn, log=print) -> dict:
    """Tune problems in order until the budget is spent; {kernel: {key: entry}}."""
    deadline = time.monotonic() + budget
    results: dict = {}
    for problem in todo:
        if time.monotonic() > deadline:
            log(f"budget spent: {problem} and later problems not tuned")
            break
        t0 = time.monotonic()
        entry = tune_problem(problem, device, timer, prune_fn)
        if entry is None:
            log(f"{problem}: no candidate survived; the default stays")
            continue
        results.setdefault(problem.kernel, {})[problem.key] = entry
        gain = f", default {entry['default_ms']:.4f} ms" if entry["default_ms"] else ""
        log(f"{problem}: {entry['config']} {entry['ms']:.4f} ms{gain} ({entry['candidates']} candidates, "
            f"{entry['pruned']} pruned, {time.monotonic() - t0:.0f} s)")
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16"], default=["bfloat16", "float16"])
    p.add_argument("--budget", type=float, default=600, help="seconds; the sweep stops between problems")
    p.add_argument("--output", default=os.path.join("kernels", "configs"),
                   help="folder of the tables (default: kernels/configs, the committed ones)")
    p.add_argument("--skip-existing", action="store_true",
                   help="leave out problems the table in --output already has (a later run continues an earlier one)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="worker processes that compile candidates")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.tune: no CUDA GPU here; launch configs can only be measured on one", file=sys.stderr)
        return 2
    from kernels import tuned

    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    arch = tuned.arch_name(major, minor)

    def prune_fn(problem, configs):
        return prune(problem, configs, major * 10 + minor, args.jobs, warm=True)

    todo = problems(args.kernels, [getattr(torch, d) for d in args.dtypes])
    if args.skip_existing:
        have = tuned.load_table(args.output, arch).get("kernels", {})
        todo = [p for p in todo if p.key not in have.get(p.kernel, {})]
    print(f"# tuning {len(todo)} problems on {torch.cuda.get_device_name(device)} ({arch}), budget {args.budget:.0f} s")
    results = sweep(todo, device, args.budget, do_bench_timer, prune_fn)
    import triton

    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m bench.tune " + " ".join(sys.argv[1:] if argv is None else argv)}
    if results:
        print(f"wrote {write_table(args.output, arch, results, meta)}")
    else:
        print("nothing tuned: no table written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
