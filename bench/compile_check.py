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
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels  # noqa: E402,F401
from kernels._common import INTERPRET, dot_precision  # noqa: E402

# The modules (kernels' functions of the same names shadow layer_norm and bias_gelu as package attributes).
ln, bg = sys.modules["kernels.layer_norm"], sys.modules["kernels.bias_gelu"]
att, mlm = sys.modules["kernels.attention"], sys.modules["kernels.mlm_loss"]

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


def needs_wgmma(name: str) -> bool:
    """Half-precision attention and MLM-loss kernels: every dot on wgmma, none on the slower mma.sync."""
    return name.startswith(("attention", "mlm_loss")) and "float32" not in name and "preprocess" not in name


def needs_vectors(name: str) -> bool:
    """Half-precision LayerNorm and bias-GeLU, bound by memory: every global access of their tensors in vectors
    of 16 bytes, none element by element."""
    return name.startswith(("layer_norm", "bias_gelu")) and "float32" not in name


def spill_limit(name: str) -> int:
    """Bytes a variant may spill. Half precision, the fast path: none, since spills in the inner loop make a
    kernel slow while it still passes every test. float32 runs its dots on the CUDA cores, where ptxas's
    allocation shifts a few bytes either way between releases: a handful, never a loop's worth."""
    return 64 if "float32" in name else 0


def verdict(name: str, result: Compiled, arch: int = 90) -> str | None:
    """Why a compiled variant is not good enough, or None when it is."""
    if result.spilled and result.spilled > spill_limit(name):
        return f"spills registers ({result})"
    if arch == 90 and needs_wgmma(name) and (result.mma_sync or not result.wgmma):
        return f"has dots off wgmma ({result})"
    if needs_vectors(name) and result.scalar16:
        return f"moves half-precision elements one by one ({result})"
    return None


def check(variant, arch: int = 90) -> tuple[str | None, str]:
    """Compile one (name, fn, args, num_warps[, num_stages]) variant: (failure reason or None, report)."""
    name, fn, args, *launch = variant
    try:
        result = compile_variant(fn, args, *launch, arch=arch)
    except Exception as e:  # out of shared memory, a compiler error: the variant cannot run
        return f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", ""
    return verdict(name, result, arch), str(result)


# -- the argument signatures of each kernel, for a given launch config --------------------------------------------

def layer_norm_variant(kernel: str, dtype, n: int, launch, residual=True, dropout=True, affine=True):
    common = dict(X=dtype, R=dtype if residual else None, W=torch.float32 if affine else None,
                  HAS_RESIDUAL=residual, HAS_DROPOUT=dropout, HAS_WEIGHT=affine, BLOCK_M=launch.BLOCK_M,
                  BLOCK_N=launch.BLOCK_N, M="i32", N="i32:16", p="fp32", Seed=torch.int64 if dropout else None,
                  stride_x_m="i32:16",
                  stride_r_m="i32:16")
    name = f"layer_norm {kernel} {dtype} N={n} res={residual} drop={dropout} affine={affine}"
    if kernel == "fwd":
        return (name, ln._layer_norm_fwd_kernel,
                dict(common, B=torch.float32 if affine else None, Y=dtype, Mean=torch.float32,
                     Rstd=torch.float32, stride_y_m="i32:16", eps="fp32", HAS_BIAS=affine), launch.num_warps)
    return (name, ln._layer_norm_bwd_kernel,
            dict(common, DY=dtype, DX=dtype, DR=dtype if residual else None, DW_partial=torch.float32,
                 DB_partial=torch.float32, Mean=torch.float32, Rstd=torch.float32, stride_dy_m="i32:16",
                 stride_dx_m="i32:16", stride_dr_m="i32:16", rows_per_program="i32"), launch.num_warps)


def bias_gelu_variant(kernel: str, dtype, launch, tanh=False):
    common = dict(X=dtype, B=torch.float32, M="i32", N="i32:16", stride_x_m="i32:16", APPROX_TANH=tanh,
                  BLOCK_M=launch.BLOCK_M, BLOCK_N=launch.BLOCK_N)
    name = f"bias_gelu {kernel} {dtype} tanh={tanh}"
    if kernel == "fwd":
        return name, bg._bias_gelu_fwd_kernel, dict(common, Y=dtype, stride_y_m="i32:16"), launch.num_warps
    return (name, bg._bias_gelu_bwd_kernel,
            dict(common, DY=dtype, DX=dtype, DB_partial=torch.float32, stride_dy_m="i32:16", stride_dx_m="i32:16",
                 rows_per_program="i32"), launch.num_warps)


_ATTENTION_TENSORS = {"fwd": ("q", "k", "v", "o"), "dkdv": ("q", "k", "v", "do", "dk", "dv"),
                      "dq": ("q", "k", "v", "do", "dq")}


def attention_variant(kernel: str, dtype, dim: int, launch, dropout=True):
    tensors = _ATTENTION_TENSORS[kernel]
    args = dict(Q=dtype, K=dtype, V=dtype, CuSeqlens=torch.int32, total_tokens="i32", max_seqlen="i32",
                qk_scale="fp32", p_drop="fp32", Seed=torch.int64 if dropout else None, HAS_DROPOUT=dropout, DOT_PRECISION=dot_precision(dtype),
                BLOCK_D=dim, BLOCK_M=launch.BLOCK_M, BLOCK_N=launch.BLOCK_N, LSE=torch.float32,
                **{f"stride_{t}_{d}": "i32:16" for t in tensors for d in ("t", "h")})
    if kernel == "fwd":
        args.update(O=dtype)
        fn = att._attention_fwd_kernel
    else:
        args.update(DO=dtype, Delta=torch.float32, softmax_scale="fp32", **{t.upper(): dtype for t in tensors[4:]})
        fn = att._attention_bwd_dkdv_kernel if kernel == "dkdv" else att._attention_bwd_dq_kernel
    name = f"attention {'fwd' if kernel == 'fwd' else 'bwd ' + kernel} {dtype} d={dim} dropout={dropout}"
    return name, fn, args, launch.num_warps, launch.num_stages


def attention_preprocess_variant(dtype):
    return (f"attention bwd preprocess {dtype}", att._attention_bwd_preprocess_kernel,
            dict(O=dtype, DO=dtype, Delta=torch.float32, stride_o_t="i32:16", stride_o_h="i32:16",
                 stride_do_t="i32:16", stride_do_h="i32:16", total_tokens="i32", BLOCK_M=64, BLOCK_D=64), 4, 3)


def mlm_variant(kernel: str, dtype, h: int, tiles, bias=True):
    args = dict(Hid=dtype, W=dtype, B=torch.float32 if bias else None, Labels=torch.int64, stride_h_n="i32:16",
                stride_w_v="i32:16", N="i32", V="i32", H="i32:16", HAS_BIAS=bias, DOT_PRECISION=dot_precision(dtype),
                BLOCK_M=tiles.BLOCK_M, BLOCK_V=tiles.BLOCK_V, BLOCK_H=tiles.BLOCK_H, Lse=torch.float32)
    name = f"mlm_loss {'fwd' if kernel == 'fwd' else 'bwd ' + kernel} {dtype} H={h} bias={bias}"
    if kernel == "fwd":
        return (name, mlm._mlm_loss_fwd_kernel,
                dict(args, Target=torch.float32, Best=torch.float32, BestIdx=torch.int64, vocab_per_split="i32:16"),
                tiles.num_warps, tiles.num_stages)
    args.update(G=torch.float32, BLOCK_HO=tiles.BLOCK_HO)
    if kernel == "dhidden":
        return (name, mlm._mlm_loss_bwd_dhidden_kernel, dict(args, DHid=dtype, stride_dh_n="i32:16"),
                tiles.num_warps, tiles.num_stages)
    return (name, mlm._mlm_loss_bwd_dweight_kernel, dict(args, DW=dtype, DB=torch.float32, stride_dw_v="i32:16"),
            tiles.num_warps, tiles.num_stages)


# -- the variants the launchers pick by default -------------------------------------------------------------------

def layer_norm_variants():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (768, 8192):
            x = torch.empty((1, n), dtype=dtype, device="meta")
            for flags in ((True, True, True), (False, False, False)):
                for kernel in ("fwd", "bwd"):
                    yield layer_norm_variant(kernel, dtype, n, ln._config(kernel, x, n), *flags)


def bias_gelu_variants():
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty((1, 3072), dtype=dtype, device="meta")
        for tanh in (False, True):
            for kernel in ("fwd", "bwd"):
                yield bias_gelu_variant(kernel, dtype, bg._config(kernel, x, 3072), tanh)


def attention_variants():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim in att.HEAD_DIMS if dtype == torch.bfloat16 else (64,) if dtype == torch.float16 else (16, 64, 128):
            for dropout in (False, True):
                for kernel in ("fwd", "dkdv", "dq"):
                    yield attention_variant(kernel, dtype, dim, att._default_config(kernel, dim, dtype), dropout)
        yield attention_preprocess_variant(dtype)


def mlm_variants():
    for dtype in (torch.bfloat16, torch.float32):
        for h in (768, 1024):
            for bias in (True, False):
                for kernel in ("fwd", "dhidden", "dweight"):
                    yield mlm_variant(kernel, dtype, h, mlm._tiles(kernel, h, dtype), bias)


GROUPS = (layer_norm_variants, bias_gelu_variants, attention_variants, mlm_variants)


# -- any (kernel, dtype, size, config) of the launch-config tables ------------------------------------------------

from .tune import default_launch  # noqa: E402  (needs no compiler: shared with the sweep)


def variant_for(kernel: str, dtype, size: int, config: dict | None = None):
    """The compile variant of a table entry (BERT's training flags: dropout, residual, bias on)."""
    family, part = kernel.split(".")
    launch = default_launch(kernel, dtype, size)._replace(**(config or {}))
    if family == "attention":
        return attention_variant(part, dtype, size, launch)
    if family == "layer_norm":
        return layer_norm_variant(part, dtype, size, launch)
    if family == "bias_gelu":
        return bias_gelu_variant(part, dtype, launch)
    return mlm_variant(part, dtype, size, launch)


def table_variants(arch: str = "sm_90"):
    """Every entry of the committed launch-config table for `arch`, as a compile variant."""
    from kernels import tuned

    table = tuned.load_table(os.path.join(os.path.dirname(tuned.__file__), "configs"), arch)
    for kernel, entries in sorted(table.get("kernels", {}).items()):
        for key, entry in sorted(entries.items()):
            dtype, size, _ = key.split("/")
            yield variant_for(kernel, getattr(torch, dtype), int(size), entry["config"])


GROUPS = (*GROUPS, table_variants)
