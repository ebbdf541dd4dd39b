"""Import names shared with other distributions (`kernels`, `bert`, `bench`): a foreign package is named, clearly."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, shadow: str, code: str) -> subprocess.CompletedProcess:
    """Run `code` with a foreign package called `shadow` first on sys.path and our source tree after it."""
    (tmp_path / shadow).mkdir(parents=True)
    (tmp_path / shadow / "__init__.py").write_text('"""Another distribution\'s package."""\n')
    program = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_foreign_kernels_package_is_named_at_first_use(tmp_path):
    out = _run(tmp_path, "kernels", """
        import torch, bert
        from bert.model import ops
        ops.layer_norm(torch.ones(2, 4), None, None, 1e-5, backend="torch")  # the PyTorch path needs no kernels
        try:
            ops.kernels_package()
        except ImportError as e:
            print("ERROR", e)
    """)
    assert out.returncode == 0, out.stderr
    assert "ERROR `import kernels` found" in out.stdout and "not bertfuse's `kernels` package" in out.stdout
    assert str(tmp_path) in out.stdout and "virtual environments" in out.stdout


@pytest.mark.slow
def test_a_foreign_bert_package_is_named_by_bench_and_no_concern_of_the_kernels(tmp_path):
    out = _run(tmp_path / "bench", "bert", "import bench")
    assert out.returncode != 0
    assert "ImportError: `import bert` found" in out.stderr and "not bertfuse's `bert`" in out.stderr
    out = _run(tmp_path / "kernels", "bert", "import kernels, bert; print(kernels.__bertfuse__, bert.__doc__)")
    assert out.returncode == 0, out.stderr  # the kernels import nothing of bert
    assert out.stdout.split()[:2] == ["True", "Another"]


def test_our_packages_pass_the_check():
    import bench
    import bert
    import kernels

    assert bert.ours("kernels", kernels) is kernels and bert.ours("bench", bench) is bench
