"""Compile one kernel variant for a GPU family down to machine code, with no GPU, and judge the compiler's report.

Shared by `tests/compile_gpus.py` (every variant the launchers pick on a family must pass) and `bench/tune.py`
(candidate launch configs are pruned to those that pass before any is timed, or, without a GPU, before the
best clean one is written to a compile-checked table). It needs triton in compile mode: import it in a process
where TRITON_INTERPRET was never set (it removes the variable, which only helps if triton was not imported yet,
and raises if it was).

The families are kernels.targets.TARGETS: NVIDIA from sm_75 to sm_120 (PTX, then ptxas's register report, run
for the architecture the PTX names: "sm_90a", "sm_100a", "sm_120a"), and AMD's gfx90a and gfx942 (AMDGCN, whose
metadata carries the VGPR and SGPR spill counts and the scratch size). Variants are specialised as the JIT
specialises them at BERT shapes: pointers 16-byte aligned, and integer arguments marked "i32:16" (strides,
hidden sizes) divisible by 16. Without those hints the compiler cannot vectorise loads and the register counts
say little about the real kernels.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bertfuse.bench.ops import record, records  # noqa: E402
from bertfuse.bench.record import CompileCall, Variant, record_launches  # noqa: E402
from bertfuse.kernels import launches, tuned  # noqa: E402
from bertfuse.kernels.targets import INTERPRET, Target  # noqa: E402

if INTERPRET:
    raise RuntimeError("bench.compile_check needs triton's compiler: import it in a process started without "
                       "TRITON_INTERPRET=1")

# The tensor-core instruction of each Target.dot, as it appears in the compiled code, and the per-warp one that
# Triton falls back to on Hopper and Blackwell when a dot's tile is too narrow for theirs.
DOT_INSTRUCTIONS = {"mma": "mma.sync", "wgmma": "wgmma.mma_async", "tcgen05": "tcgen05.mma", "mfma": "v_mfma"}


def gpu_target(t: Target) -> GPUTarget:
    return GPUTarget(t.backend, t.arch, t.warp_size)


class Report(NamedTuple):
    """What the compiler says about one compiled kernel; None where a field could not be read."""
    registers: int | None      # per thread (NVIDIA), VGPRs per lane (AMD)
    spilled: int | None        # bytes spilled to local (scratch) memory per thread
    sgpr_spills: int = 0       # AMD: scalar registers spilled into vector-register lanes (no memory traffic)


def _ptxas(arch: int):
    """Path of the ptxas triton uses for `arch`, or None where this triton hides it."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            return get_ptxas(arch).path
        except TypeError:  # older releases take no architecture
            return get_ptxas().path
    except Exception:  # an internal helper: its name or signature may change between releases
        return None


def ptx_report(ptx: str, arch: int) -> Report:
    """ptxas -v on the kernel's PTX, for the architecture its `.target` line names (the "a" variants Triton
    emits for sm_90 and newer, which plain sm_90 would refuse).

    The report is a function of the PTX, the GPU name and the ptxas binary alone, so it is kept in Triton's
    cache (beside the compiled kernels, under the same TRITON_CACHE_DIR) keyed by a hash of all three: a
    second check of the same kernel reads it back instead of running ptxas again."""
    ptxas = _ptxas(arch)
    named = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    if ptxas is None or named is None:
        return Report(None, None)
    cache = _report_cache(ptxas, named.group(1), ptx)
    cached = _read_report(cache)
    if cached is not None:
        return cached
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name={named.group(1)}", src, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)
    text = log.stdout + log.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if log.returncode or not regs or not spills:
        return Report(None, None)
    report = Report(int(regs.group(1)), int(spills.group(1)))
    if cache is not None:
        cache.put(json.dumps(report._asdict()), REPORT_FILE, binary=False)
    return report


REPORT_FILE = "bertfuse-ptxas-report.json"  # rename it if the ptxas command or the Report fields change


def _report_cache(ptxas: str, gpu_name: str, ptx: str):
    """Triton's cache manager for this (ptxas binary, GPU name, PTX), or None where it cannot be made. The
    binary enters the key by path, size and modification time, so a replaced ptxas is a new key."""
    try:
        from triton.runtime.cache import get_cache_manager
        stat = os.stat(ptxas)
        key = hashlib.sha256(f"{ptxas}\0{stat.st_size}\0{stat.st_mtime_ns}\0{gpu_name}\0{ptx}".encode())
        return get_cache_manager(key.hexdigest())
    except Exception:  # an internal API, or an unwritable cache folder: run ptxas every time instead
        return None


def _read_report(cache) -> Report | None:
    """The cached report, or None where there is none or it cannot be read (then ptxas runs again)."""
    path = None if cache is None else cache.get_file(REPORT_FILE)
    if path is None:
        return None
    try:
        with open(path) as f:
            fields = json.load(f)
        report = Report(**fields)
    except (OSError, ValueError, TypeError):
        return None
    return report if all(isinstance(v, int) for v in report) else None


def amdgcn_report(asm: str) -> Report:
    """The kernel metadata in AMDGCN assembly: VGPRs, VGPR spills (4 bytes each per lane) and the scratch
    (private segment) a lane needs; spilled = the larger of the two."""
    def field(name):
        found = re.search(rf"\.{name}:\s*(\d+)", asm)
        return None if found is None else int(found.group(1))

    vgprs, vgpr_spills, sgpr_spills = field("vgpr_count"), field("vgpr_spill_count"), field("sgpr_spill_count")
    scratch = field("private_segment_fixed_size")
    if None in (vgprs, vgpr_spills, scratch):
        return Report(None, None)
    return Report(vgprs, max(4 * vgpr_spills, scratch), sgpr_spills or 0)


class Compiled:
    def __init__(self, shared: int, report: Report, code: str, t: Target):
        self.shared, self.report = shared, report
        self.dots = {kind: code.count(DOT_INSTRUCTIONS[kind]) for kind in dict.fromkeys(("mma", t.dot))
                     if kind in DOT_INSTRUCTIONS}
        self.scalar16 = _scalar16(code, t.backend)
        self.target = t

    def __str__(self):
        regs = "?" if self.report.registers is None else self.report.registers
        spilled = "?" if self.report.spilled is None else self.report.spilled
        sgpr = f", {self.report.sgpr_spills} SGPRs to VGPR lanes" if self.report.sgpr_spills else ""
        dots = " / ".join(f"{n} {DOT_INSTRUCTIONS[k]}" for k, n in self.dots.items())
        memory = "LDS" if self.target.backend == "hip" else "shared memory"
        return (f"{memory} {self.shared} B, {regs} registers, {spilled} B spilled{sgpr}, {dots}, "
                f"{self.scalar16} scalar 16-bit accesses")


def _scalar16(code: str, backend: str) -> int:
    """Global loads and stores of one 16-bit element each: half-precision tensors moved without vectors."""
    if backend == "hip":
        return len(re.findall(r"\b(?:global|buffer|flat)_(?:load|store)_\w*short\w*", code))
    accesses = re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*", code)
    return sum(1 for a in accesses if a.endswith("16") and ".v" not in a)


def compile_variant(fn, args: dict, num_warps: int, num_stages: int, t: Target) -> Compiled:
    """args: every parameter -> a torch dtype (pointer), 'i32' / 'i32:16' (divisible by 16) / 'i64' / 'fp32',
    or the value of a constexpr (None: an absent pointer; an integer 1, which the JIT makes a constant)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = args[p.name]
        if p.is_constexpr or not isinstance(value, (str, torch.dtype)):
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        elif isinstance(value, torch.dtype):
            signature[p.name] = launches.pointer_type(value)
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are aligned
        else:
            signature[p.name], _, divisible = value.partition(":")
            if divisible:
                attrs[(i,)] = [["tt.divisibility", int(divisible)]]
    missing = set(args) - {p.name for p in fn.params}
    assert not missing, missing
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=gpu_target(t), options={"num_warps": num_warps, "num_stages": num_stages})
    shared = compiled.metadata.shared
    if shared > t.shared_bytes:  # would fail at launch with "out of resource: shared memory"
        raise RuntimeError(f"needs {shared} bytes of shared memory; a {t.name} block gets at most {t.shared_bytes}")
    if t.backend == "hip":
        code = compiled.asm["amdgcn"]
        return Compiled(shared, amdgcn_report(code), code, t)
    code = compiled.asm["ptx"]
    return Compiled(shared, ptx_report(code, t.arch), code, t)


def spill_limit(variant: Variant) -> int:
    """Bytes a variant may spill. Half precision, the fast path: none, since spills in the inner loop make a
    kernel slow while it still passes every test. float32 runs its dots on the CUDA cores (vector ALUs), where
    the register allocation shifts a few bytes either way between releases: a handful, never a loop's worth."""
    return 64 if variant.dtype == torch.float32 else 0


def _tail_accesses(variant: Variant, t: Target) -> int:
    """The element-by-element 16-bit accesses a kernel's masked tail block may make: its site's `tail` accesses,
    each of the elements one thread holds of a BLOCK-wide block (none for a kernel without a tail)."""
    if not variant.tail:
        return 0
    return variant.tail * max(1, variant.args["BLOCK"] // (variant.num_warps * t.warp_size))


def verdict(variant: Variant, result: Compiled) -> str | None:
    """Why a compiled variant is not good enough, or None when it is: a register report that cannot be read
    (unknown is not clean), spills past `spill_limit`, or, in half precision, what a variant `needs`
    (bench/record.py): "tensor_cores", every dot on the family's tensor-core instruction (wgmma on sm_90,
    tcgen05 on sm_100, with none left on the slower per-warp mma.sync; mma.sync from sm_75 to sm_89 and on
    sm_120; MFMA on AMD), "warp_dots", every dot on tensor cores with the per-warp mma.sync accepted beside
    the family's own (tiles of 32 rows, narrower than sm_90's warpgroup instruction takes), or "vectors", every
    global access of its tensors in 16-byte vectors, none element by element (the memory-bound LayerNorm and
    bias-GeLU), but for a kernel over tensors of any size those of its masked tail block (`_tail_accesses`).
    SGPR spills on AMD go to vector-register lanes, not to memory: reported, not failed."""
    t = result.target
    if result.report.spilled is None:
        return f"the compiler's register report could not be read for {t.name} ({result})"
    if result.report.spilled > spill_limit(variant):
        return f"spills registers ({result})"
    half = variant.dtype != torch.float32
    if half and variant.needs == "tensor_cores" and t.tensor_core_dots:
        fallback = result.dots.get("mma", 0) if t.dot != "mma" else 0
        if not result.dots[t.dot] or fallback:
            return f"has dots off {DOT_INSTRUCTIONS[t.dot]} ({result})"
    if half and variant.needs == "warp_dots" and t.tensor_core_dots and not sum(result.dots.values()):
        return f"has no tensor-core dots ({result})"
    if half and variant.needs == "vectors" and result.scalar16 > _tail_accesses(variant, t):
        return f"moves half-precision elements one by one ({result})"
    return None


def check(variant: Variant, t: Target) -> tuple[str | None, str]:
    """Compile one variant for family `t`: (failure reason or None, report). A dtype the family cannot run
    (bfloat16 on sm_75), or a half-precision dot kernel where Triton has no tensor-core dots (sm_75), is not
    compiled: the launchers refuse it with the error reported here."""
    if variant.failed:
        return variant.failed, ""
    if variant.refused:
        return None, f"refused: {variant.refused}"
    try:
        result = compile_variant(variant.fn, variant.args, variant.num_warps, variant.num_stages, t)
    except Exception as e:  # out of shared memory, a compiler error: the variant cannot run
        return f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", ""
    return verdict(variant, result), str(result)


# -- the variants: what the launchers launch for each record's calls, and any entry of a launch-config table ------

def _flags(flags: dict) -> str:
    return "".join(f" {k}={v}" for k, v in flags.items())


def recorded(rec, call: CompileCall, t: Target, force: tuple[str, dict] | None = None) -> list[Variant]:
    """The launches that `call` of record `rec` makes on family `t` (bench.record.record_launches; with `force`
    = (site, config), that site's config forced), as compile variants named "<op> <part> <dtype> size=<size>
    <flags>"; where the family refuses the call (bfloat16 on sm_75), one variant carrying the launchers' error."""
    got = record_launches(rec, call, t, force)
    if got.refused:
        return [Variant(f"{rec.name} {call.dtype} size={call.size}{_flags(call.flags)}", None, {}, 0, 0, call.dtype,
                        refused=got.refused)]
    out = []
    for launch in got.launches:
        site = launches.site(launch.site)
        out.append(Variant(f"{site.op} {site.part} {call.dtype} size={call.size}{_flags(call.flags)}", launch.fn,
                           launches.signature(launch), launch.num_warps, launch.num_stages, call.dtype, site.needs,
                           tail=site.tail))
    return out


def launcher_variants(rec, t: Target):
    """The launches of each of the record's compile calls on `t`, with the configs the launchers pick there (the
    family's table, else the default); the same launch from several calls comes more than once (`variant_key`).
    A table entry the launcher refuses is a failed variant, not silently the default."""
    for call in rec.compiled():
        try:
            with tuned.refusing():
                got = recorded(rec, call, t)
        except ValueError as e:
            got = [_failed(f"{rec.name} {call.dtype} size={call.size}{_flags(call.flags)}", e)]
        yield from got


def _failed(name: str, error: ValueError) -> Variant:
    """A variant that compiles nothing and fails: a table entry the launcher refuses (kernels.tuned.pick)."""
    return Variant(name, None, {}, 0, 0, failed=f"the launcher refuses this table entry: {error}")


def variant_key(variant: Variant) -> tuple:
    """What makes two variants the same compile: the kernel, its specialised arguments, the launch options (a
    refused call, which compiles nothing, is its own)."""
    if variant.fn is None:
        return (variant.name,)
    args = tuple(sorted((k, str(v)) for k, v in variant.args.items()))
    return variant.fn, variant.num_warps, variant.num_stages, args


def groups(t: Target) -> dict:
    """Group name -> a function giving its variants for family `t`: "<record>" (what the launchers launch for
    its compile calls) and "table" (every entry of the family's table that the lookup reads)."""
    out = {r.name: (lambda r=r: launcher_variants(r, t)) for r in records()}
    out["table"] = lambda: table_variants(t)
    return out


def variants_for(kernel: str, dtype, size: int, config: dict | None, t: Target) -> list[Variant]:
    """The compile variants of one config of launch site `kernel` ("attention.fwd") at (dtype, size) on `t`: its
    launches in every compile call of the record there (BERT's training flags where none matches), the config
    forced (a call the family refuses: its one refused variant); [] for a launch site that chooses among
    implementations rather than configuring a kernel (mlm_loss.strategy). A config the launcher cannot take
    (kernels.tuned.pick) raises ValueError."""
    rec, site = record(kernel), launches.site(kernel)
    if site.choice:
        return []
    calls = [c for c in rec.compiled() if (c.dtype, c.size) == (dtype, size)] or [CompileCall(dtype, size)]
    out, seen = [], set()
    for call in calls:
        for variant in recorded(rec, call, t, (kernel, config) if config else None):
            if (variant.fn is site.kernel or variant.refused) and variant_key(variant) not in seen:
                seen.add(variant_key(variant))
                out.append(variant)
    return out


def table_variants(t: Target):
    """Every entry of the launch-config table for family `t` that the lookup reads (the committed one, or
    BERTFUSE_CONFIG_DIR's), as compile variants."""
    table = tuned.load_table(tuned.config_dir(), t.name)
    for kernel, entries in sorted(table.get("kernels", {}).items()):
        for key, entry in sorted(entries.items()):
            dtype, size, _ = key.split("/")
            try:
                yield from variants_for(kernel, getattr(torch, dtype), int(size), entry["config"], t)
            except ValueError as e:
                yield _failed(f"table {kernel} {key}", e)
