"""Every kernel variant the launchers use compiles for an sm_90 GPU (H100/H200), down to a cubin, without a GPU.

The interpreter accepts things the compiler rejects (a plain float global read inside a kernel, say); this
catches them on CPU-only machines. The compile runs in subprocesses without TRITON_INTERPRET."""
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


def test_all_kernels_compile_for_sm90():
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    script = os.path.join(os.path.dirname(__file__), "compile_sm90.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, script, "--shard", f"{i}/2"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]  # two at once: one per core
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
        assert "0 failed" in out


def test_a_launch_config_table_compiles_entry_by_entry(tmp_path):
    """The compile check's "table" group compiles each entry of the table the lookup reads."""
    from bench.tune import candidates, write_table

    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    write_table(str(tmp_path), "sm_90", {"bias_gelu.fwd": {"bfloat16/3072/all": {
        "config": candidates("bias_gelu.fwd")[0], "ms": 0.1}}}, {"gpu": "test"})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "compile_sm90.py"), "table"],
                         env=dict(env, BERTFUSE_CONFIG_DIR=str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok   bias_gelu fwd") == 1 and "0 failed" in out.stdout
