"""Every kernel variant the launchers use compiles clean for the GPU families most users have (A100, H100/H200,
MI300), down to machine code, without a GPU; the full matrix is `python tests/compile_gpus.py --arch all`.

The interpreter accepts things the compiler rejects (a plain float global read inside a kernel, say); this
catches them on CPU-only machines. The compile runs in subprocesses without TRITON_INTERPRET."""
import json
import os
import subprocess
import sys

import pytest

from interpreter_site.sitecustomize import without_interpreter

triton = pytest.importorskip("triton")


pytestmark = pytest.mark.compile  # the compile-check tier (RUN_SLOW=1)

SCRIPT = os.path.join(os.path.dirname(__file__), "compile_gpus.py")


def need_backend(name: str):
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if name not in backends:
        pytest.skip(f"this triton build has no {name} backend")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "gfx942"])
def test_every_kernel_compiles_clean_for(arch):
    need_backend("amd" if arch.startswith("gfx") else "nvidia")
    out = subprocess.run([sys.executable, SCRIPT, "--arch", arch], env=without_interpreter(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "0 failed" in out.stdout
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert len(lines) > 150 and all(f" {arch} " in line for line in lines)  # every group, this family only


def test_sm75_refuses_bfloat16_and_half_precision_dots_instead_of_compiling_them():
    need_backend("nvidia")
    out = subprocess.run([sys.executable, SCRIPT, "--arch", "sm_75", "--shard", "0/40", "attention", "bias_gelu"],
                         env=without_interpreter(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    refused = [line for line in out.stdout.splitlines() if "refused:" in line]
    assert any("bfloat16 needs" in line for line in refused) and all(line.startswith("ok ") for line in refused)


def test_a_launch_config_table_compiles_entry_by_entry(tmp_path):
    """The compile check's "table" group compiles each entry of the table the lookup reads."""
    from bertfuse.bench.tables import write_table
    from bertfuse.bench.tune_problems import candidates

    need_backend("nvidia")
    write_table(str(tmp_path), "sm_90", {"bias_gelu.fwd": {"bfloat16/3072/all": {
        "config": candidates("bias_gelu.fwd")[0], "ms": 0.1}}}, "timed", {"gpu": "test"})
    out = subprocess.run([sys.executable, SCRIPT, "--arch", "sm_90", "table"],
                         env=without_interpreter(BERTFUSE_CONFIG_DIR=str(tmp_path)), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Once per flag combination the launcher may use (tanh or not), with the table's config.
    assert out.stdout.count("ok   sm_90 bias_gelu fwd torch.bfloat16") == 2 and "0 failed" in out.stdout


def test_a_table_entry_the_launcher_refuses_is_reported_as_a_failure(tmp_path):
    """A tuned table whose attention tile needs more shared memory than the family has: the launcher would warn
    and run its default, so the check reports the entry as a failure (rc 1) rather than compile the default."""
    need_backend("nvidia")
    entry = {"config": {"BLOCK_M": 256, "BLOCK_N": 256, "num_stages": 4, "num_warps": 8}}
    (tmp_path / "sm_80.json").write_text(json.dumps({"arch": "sm_80", "format": 1, "kernels": {
        "attention.fwd": {"bfloat16/64/all": entry}}}))
    env = without_interpreter(BERTFUSE_CONFIG_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, SCRIPT, "--arch", "sm_80", "table"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAIL ")]
    assert len(failed) == 1 and "refuses" in failed[0] and "shared memory" in failed[0], out.stdout
    assert "1 failed" in out.stdout and "Traceback" not in out.stderr
    # The launchers' own group: the calls reading that entry are failures too, not the default compiled instead.
    code = ("from bertfuse.bench import compile_check as c; from bertfuse.kernels.targets import named; "
            "t = named('sm_80'); print([v.name for v in c.launcher_variants(c.record('attention'), t) if v.failed])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "attention torch.bfloat16 size=64" in out.stdout and "size=128" not in out.stdout, out.stdout


def test_a_ptxas_report_is_kept_in_the_triton_cache_and_a_damaged_one_is_made_again(tmp_path):
    """ptxas's register report is read back from Triton's cache on a second check of the same kernel (ptxas
    does not run again) and equals the fresh one; an entry that cannot be read is made again."""
    need_backend("nvidia")
    code = f"""
import glob, json
from bertfuse.bench import compile_check as c
from bertfuse.kernels.targets import named
t = named("sm_90")
variant = next(v for v in c.launcher_variants(c.record("bias_gelu"), t) if not v.failed)
fresh = c.check(variant, t)
def refuse(*args, **kwargs):
    raise AssertionError("ptxas ran again")
run, c.subprocess.run = c.subprocess.run, refuse
cached = c.check(variant, t)
entries = glob.glob({str(tmp_path)!r} + "/*/" + c.REPORT_FILE)
for path in entries:
    open(path, "w").write('{{"registers": 1')
c.subprocess.run = run
remade = c.check(variant, t)
print(json.dumps({{"reports": [fresh, cached, remade], "entries": len(entries)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], env=without_interpreter(TRITON_CACHE_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    fresh, cached, remade = result["reports"]
    assert result["entries"] == 1 and fresh == cached == remade, result
    assert fresh[0] is None and " registers, 0 B spilled" in fresh[1] and "? registers" not in fresh[1], fresh
