"""Compile one kernel variant for a GPU architecture down to a cubin, with no GPU, and judge ptxas's report.

Shared by `tests/compile_sm90.py` (every variant the launchers pick by default must pass) and `bench/tune.py`
(candidate launch configs are pruned to those that pass before any is timed). It needs triton in compile mode:
import it in a process where TRITON_INTERPRET was never set (it removes the variable, which only helps if triton
was not imported yet, and raises if it was).

Variants are specialised as the JIT specialises them at BERT shapes: pointers 16-byte aligned, and integer
arguments marked "i32:16" (strides, hidden sizes) divisible by 16. Without those hints the compiler cannot
vectorise loads and the register counts say little about the real kernels.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels._common import INTERPRET  # noqa: E402
from bench.record import Variant, record, records  # noqa: E402

if INTERPRET:
    raise RuntimeError("bench.compile_check needs triton's compiler: import it in a process started without "
                       "TRITON_INTERPRET=1")

TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
         torch.int64: "*i64", torch.int8: "*i8"}
MAX_SHARED = 232448  # bytes of shared memory one block may use on an H100/H200 (sm_90)


def target(arch: int = 90) -> GPUTarget:
    return GPUTarget("cuda", arch, 32)


def _ptxas(arch: int):
    """Path of the ptxas triton uses, or None where this triton hides it."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            return get_ptxas(arch).path
        except TypeError:  # older releases take no architecture
            return get_ptxas().path
    except Exception:  # an internal helper: its name or signature may change between releases
        return None


def register_report(ptx: str, arch: int = 90):
    """(registers per thread, bytes of spill stores) from ptxas -v on the kernel's PTX; (None, None) if unknown."""
    ptxas = _ptxas(arch)
    if ptxas is None:
        return None, None
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    text = log.stdout + log.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if log.returncode or not regs or not spills:
        return None, None
    return int(regs.group(1)), int(spills.group(1))


class Compiled:
    def __init__(self, shared: int, registers, spilled, ptx: str):
        self.shared, self.registers, self.spilled = shared, registers, spilled
        # Hopper's warpgroup tensor-core instruction, and the older per-warp one Triton falls back to when a
        # dot's M side is too narrow for it.
        self.wgmma, self.mma_sync = ptx.count("wgmma.mma_async"), ptx.count("mma.sync")
        # Global loads and stores of one 16-bit element each: half-precision tensors moved without vectors.
        accesses = re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*", ptx)
        self.scalar16 = sum(1 for a in accesses if a.endswith("16") and ".v" not in a)

    def __str__(self):
        regs = "?" if self.registers is None else self.registers
        spilled = "?" if self.spilled is None else self.spilled
        return (f"shared memory {self.shared} B, {regs} registers, {spilled} B spilled, "
                f"{self.wgmma} wgmma / {self.mma_sync} mma.sync, {self.scalar16} scalar 16-bit accesses")


def compile_variant(fn, args: dict, num_warps: int, num_stages: int = 3, arch: int = 90) -> Compiled:
    """args: every parameter -> a torch dtype (pointer), 'i32' / 'i32:16' (divisible by 16) / 'i64' / 'fp32',
    None (absent pointer), or the value of a constexpr parameter."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = args[p.name]
        if p.is_constexpr or value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        elif isinstance(value, torch.dtype):
            signature[p.name] = TYPES[value]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are aligned
        else:
            signature[p.name], _, divisible = value.partition(":")
            if divisible:
                attrs[(i,)] = [["tt.divisibility", int(divisible)]]
    missing = set(args) - {p.name for p in fn.params}
    assert not missing, missing
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=target(arch), options={"num_warps": num_warps, "num_stages": num_stages})
    shared = compiled.metadata.shared
    if shared > MAX_SHARED:  # would fail at launch with "out of resource: shared memory"
        raise RuntimeError(f"needs {shared} bytes of shared memory; an sm_90 block gets at most {MAX_SHARED}")
    return Compiled(shared, *register_report(compiled.asm["ptx"], arch), compiled.asm["ptx"])


def spill_limit(variant: Variant) -> int:
    """Bytes a variant may spill. Half precision, the fast path: none, since spills in the inner loop make a
    kernel slow while it still passes every test. float32 runs its dots on the CUDA cores, where ptxas's
    allocation shifts a few bytes either way between releases: a handful, never a loop's worth."""
    return 64 if variant.dtype == torch.float32 else 0


def verdict(variant: Variant, result: Compiled, arch: int = 90) -> str | None:
    """Why a compiled variant is not good enough, or None when it is. What a variant `needs` (bench/record.py)
    is judged in half precision: every dot on wgmma, none on the slower mma.sync ("wgmma": attention, MLM loss),
    or every global access of its tensors in 16-byte vectors, none element by element ("vectors": the
    memory-bound LayerNorm and bias-GeLU)."""
    if result.spilled and result.spilled > spill_limit(variant):
        return f"spills registers ({result})"
    half = variant.dtype != torch.float32
    if arch == 90 and half and variant.needs == "wgmma" and (result.mma_sync or not result.wgmma):
        return f"has dots off wgmma ({result})"
    if half and variant.needs == "vectors" and result.scalar16:
        return f"moves half-precision elements one by one ({result})"
    return None


def check(variant: Variant, arch: int = 90) -> tuple[str | None, str]:
    """Compile one variant: (failure reason or None, report)."""
    try:
        result = compile_variant(variant.fn, variant.args, variant.num_warps, variant.num_stages, arch=arch)
    except Exception as e:  # out of shared memory, a compiler error: the variant cannot run
        return f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", ""
    return verdict(variant, result, arch), str(result)


# -- the variants: each kernel record's defaults, and any entry of a launch-config table --------------------------

def groups() -> dict:
    """Group name -> variants: "<record>" (the launchers' defaults, bench/record.py) and "table" (the committed
    sm_90 table's entries)."""
    return dict({r.name: r.variants for r in records()}, table=table_variants)


from .tune import default_launch  # noqa: E402  (needs no compiler: shared with the sweep)


def variant_for(kernel: str, dtype, size: int, config: dict | None = None) -> Variant | None:
    """The compile variant of a table entry (BERT's training flags: dropout, residual, bias on); None for a
    launch site that chooses among implementations rather than configuring one kernel (mlm_loss.strategy)."""
    launch = default_launch(kernel, dtype, size)._replace(**(config or {}))
    return record(kernel).tuning.variant(kernel.split(".")[1], dtype, size, launch)


def table_variants(arch: str = "sm_90"):
    """Every entry of the launch-config table for `arch` that the lookup reads (the committed one, or
    BERTFUSE_CONFIG_DIR's), as a compile variant."""
    from kernels import tuned

    table = tuned.load_table(tuned.config_dir(), arch)
    for kernel, entries in sorted(table.get("kernels", {}).items()):
        for key, entry in sorted(entries.items()):
            dtype, size, _ = key.split("/")
            variant = variant_for(kernel, getattr(torch, dtype), int(size), entry["config"])
            if variant is not None:
                yield variant
