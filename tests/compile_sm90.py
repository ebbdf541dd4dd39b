"""Compile every kernel variant the launchers use for an sm_90 GPU (H100/H200), down to a cubin, on a machine
without a GPU, and read ptxas's register report. Run as a script (not under TRITON_INTERPRET):
`python tests/compile_sm90.py [group ...]`; it prints one line per variant (shared memory, registers per thread,
bytes spilled to local memory) and exits non-zero if any variant fails to compile, needs more shared memory
than a block gets, spills registers (see spill_limit), runs a half-precision dot off Hopper's wgmma
(see needs_wgmma), or moves half-precision elements of a memory-bound kernel one at a time (see
needs_vectors). tests/test_compile_sm90.py runs it.

The variants are specialised as the JIT specialises them at BERT shapes: pointers 16-byte aligned, and the
integer arguments marked "i32:16" (strides, hidden sizes) divisible by 16. Without those hints the compiler
cannot vectorise loads and the register counts say little about the real kernels."""
from __future__ import annotations

import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels  # noqa: E402,F401
from kernels._common import dot_precision  # noqa: E402
from kernels.attention import HEAD_DIMS  # noqa: E402

ln = sys.modules["kernels.layer_norm"]
bg = sys.modules["kernels.bias_gelu"]
att = sys.modules["kernels.attention"]
mlm = sys.modules["kernels.mlm_loss"]
TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
         torch.int64: "*i64", torch.int8: "*i8"}
TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232448  # bytes of shared memory one block may use on an H100/H200


def _ptxas():
    """Path of the ptxas triton uses for sm_90, or None where this triton hides it."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except Exception:  # an internal helper: its name or signature may change between releases
        return None


def register_report(ptx: str):
    """(registers per thread, bytes of spill stores) from ptxas -v on the kernel's PTX; (None, None) if unknown."""
    ptxas = _ptxas()
    if ptxas is None:
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "kernel.cubin")],
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


def compile_variant(fn, args: dict, num_warps: int, num_stages: int = 3) -> Compiled:
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
                              target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    shared = compiled.metadata.shared
    if shared > MAX_SHARED:  # would fail at launch with "out of resource: shared memory"
        raise RuntimeError(f"needs {shared} bytes of shared memory; an sm_90 block gets at most {MAX_SHARED}")
    return Compiled(shared, *register_report(compiled.asm["ptx"]), compiled.asm["ptx"])


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


def layer_norm_variants():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (768, 8192):
            block_m, block_n, warps = ln._block_sizes(n)
            for residual, dropout, affine in ((True, True, True), (False, False, False)):
                common = dict(X=dtype, R=dtype if residual else None, W=torch.float32 if affine else None,
                              HAS_RESIDUAL=residual, HAS_DROPOUT=dropout, HAS_WEIGHT=affine, BLOCK_M=block_m,
                              BLOCK_N=block_n, M="i32", N="i32:16", p="fp32", seed="i32", stride_x_m="i32:16",
                              stride_r_m="i32:16")
                yield (f"layer_norm fwd {dtype} N={n} res={residual} drop={dropout} affine={affine}",
                       ln._layer_norm_fwd_kernel,
                       dict(common, B=torch.float32 if affine else None, Y=dtype, Mean=torch.float32,
                            Rstd=torch.float32, stride_y_m="i32:16", eps="fp32", HAS_BIAS=affine), warps)
                yield (f"layer_norm bwd {dtype} N={n} res={residual} drop={dropout} affine={affine}",
                       ln._layer_norm_bwd_kernel,
                       dict(common, DY=dtype, DX=dtype, DR=dtype if residual else None, DW_partial=torch.float32,
                            DB_partial=torch.float32, Mean=torch.float32, Rstd=torch.float32, stride_dy_m="i32:16",
                            stride_dx_m="i32:16", stride_dr_m="i32:16", rows_per_program="i32"), warps)


def bias_gelu_variants():
    block_m, block_n = bg._block_sizes(3072)
    for dtype in (torch.bfloat16, torch.float32):
        for tanh in (False, True):
            common = dict(X=dtype, B=torch.float32, M="i32", N="i32:16", stride_x_m="i32:16", APPROX_TANH=tanh,
                          BLOCK_M=block_m, BLOCK_N=block_n)
            yield (f"bias_gelu fwd {dtype} tanh={tanh}", bg._bias_gelu_fwd_kernel,
                   dict(common, Y=dtype, stride_y_m="i32:16"), 8)
            yield (f"bias_gelu bwd {dtype} tanh={tanh}", bg._bias_gelu_bwd_kernel,
                   dict(common, DY=dtype, DX=dtype, DB_partial=torch.float32, stride_dy_m="i32:16",
                        stride_dx_m="i32:16", rows_per_program="i32"), 8)


def attention_variants():
    strides = {f"stride_{t}_{d}": "i32:16" for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv") for d in ("t", "h")}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim in HEAD_DIMS if dtype == torch.bfloat16 else (64,) if dtype == torch.float16 else (16, 64, 128):
            for dropout in (False, True):
                prec = dot_precision(dtype)
                bm, bn, warps, stages = att._config("fwd", dim, dtype)
                base = dict(Q=dtype, K=dtype, V=dtype, CuSeqlens=torch.int32, total_tokens="i32",
                            max_seqlen="i32", qk_scale="fp32", p_drop="fp32", seed="i32", HAS_DROPOUT=dropout,
                            DOT_PRECISION=prec, BLOCK_D=dim)
                name = f"{dtype} d={dim} dropout={dropout}"
                fwd = att._attention_fwd_kernel
                yield (f"attention fwd {name}", fwd,
                       dict(base, O=dtype, LSE=torch.float32, BLOCK_M=bm, BLOCK_N=bn,
                            **{k: v for k, v in strides.items() if k.split("_")[1] in ("q", "k", "v", "o")}),
                       warps, stages)
                bwd = dict(base, DO=dtype, LSE=torch.float32, Delta=torch.float32, softmax_scale="fp32")
                for kernel, fn, outputs in (("dkdv", att._attention_bwd_dkdv_kernel, ("dk", "dv")),
                                            ("dq", att._attention_bwd_dq_kernel, ("dq",))):
                    bm, bn, warps, stages = att._config(kernel, dim, dtype)
                    tensors = dict(bwd, BLOCK_M=bm, BLOCK_N=bn, **{t.upper(): dtype for t in outputs},
                                   **{k: v for k, v in strides.items()
                                      if k.split("_")[1] in ("q", "k", "v", "do", *outputs)})
                    yield f"attention bwd {kernel} {name}", fn, tensors, warps, stages
        yield (f"attention bwd preprocess {dtype}", att._attention_bwd_preprocess_kernel,
               dict(O=dtype, DO=dtype, Delta=torch.float32, stride_o_t="i32:16", stride_o_h="i32:16",
                    stride_do_t="i32:16", stride_do_h="i32:16", total_tokens="i32", BLOCK_M=64, BLOCK_D=64), 4, 3)


def mlm_variants():
    for dtype in (torch.bfloat16, torch.float32):
        for h in (768, 1024):
            for bias in (True, False):
                common = dict(Hid=dtype, W=dtype, B=torch.float32 if bias else None, Labels=torch.int64,
                              stride_h_n="i32:16", stride_w_v="i32:16", N="i32", V="i32", H="i32:16",
                              HAS_BIAS=bias, DOT_PRECISION=dot_precision(dtype))
                name = f"{dtype} H={h} bias={bias}"

                def tiles(kernel, with_ho=True):
                    t = mlm._tiles(kernel, h, dtype)
                    blocks = dict(BLOCK_M=t.BLOCK_M, BLOCK_V=t.BLOCK_V, BLOCK_H=t.BLOCK_H)
                    return (dict(blocks, BLOCK_HO=t.BLOCK_HO) if with_ho else blocks), t.num_warps, t.num_stages

                blocks, *launch = tiles("fwd", with_ho=False)
                yield (f"mlm_loss fwd {name}", mlm._mlm_loss_fwd_kernel,
                       dict(common, **blocks, Lse=torch.float32, Target=torch.float32, Best=torch.float32,
                            BestIdx=torch.int64, vocab_per_split="i32:16"), *launch)
                blocks, *launch = tiles("dhidden")
                yield (f"mlm_loss bwd dhidden {name}", mlm._mlm_loss_bwd_dhidden_kernel,
                       dict(common, **blocks, Lse=torch.float32, G=torch.float32, DHid=dtype,
                            stride_dh_n="i32:16"), *launch)
                blocks, *launch = tiles("dweight")
                yield (f"mlm_loss bwd dweight {name}", mlm._mlm_loss_bwd_dweight_kernel,
                       dict(common, **blocks, Lse=torch.float32, G=torch.float32, DW=dtype, DB=torch.float32,
                            stride_dw_v="i32:16"), *launch)


def main() -> int:
    failures = 0
    groups = (layer_norm_variants, bias_gelu_variants, attention_variants, mlm_variants)
    selected = sys.argv[1:] or [g.__name__ for g in groups]
    for group in groups:
        if group.__name__ not in selected:
            continue
        for name, fn, args, *launch in group():
            try:
                result = compile_variant(fn, args, *launch)
                if result.spilled and result.spilled > spill_limit(name):
                    raise RuntimeError(f"spills registers ({result})")
                if needs_wgmma(name) and (result.mma_sync or not result.wgmma):
                    raise RuntimeError(f"has dots off wgmma ({result})")
                if needs_vectors(name) and result.scalar16:
                    raise RuntimeError(f"moves half-precision elements one by one ({result})")
                print(f"ok   {name} ({result})", flush=True)
            except Exception:
                failures += 1
                print(f"FAIL {name}\n{traceback.format_exc(limit=4)}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
