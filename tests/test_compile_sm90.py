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
