"""One import namespace, `bertfuse`: the repository's folders import as bertfuse.kernels, bertfuse.bert and
bertfuse.bench, and never answer a bare `import kernels`, `import bert` or `import bench` (names other
distributions own: Hugging Face's hub kernels, which transformers requires, bert-tensorflow, frappe-bench), from
any directory, the repository root included, however Python starts."""
import importlib.metadata
import os
import pickle
import subprocess
import sys
import sysconfig
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = ("kernels", "bert", "bench")

# Prints, for each bare name, where `import name` led: a file outside this repository, "none" for an empty
# module with no file, "missing" where the import fails, or "OURS" for one of the repository's folders.
PROBE = textwrap.dedent(f"""
    import importlib, os
    for name in {BARE!r}:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            print(name, "missing")
            continue
        where = getattr(module, "__file__", None)
        ours = where and os.path.realpath(where).startswith(os.path.join({str(ROOT)!r}, name) + os.sep)
        print(name, "OURS" if ours else (where or "none"))
""")


def _python(args, cwd, env_path=None, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if env_path:
        env["PYTHONPATH"] = os.pathsep.join(map(str, env_path))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          **kw)


def _answers(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.split(" ")[0] in BARE)


def _foreign(tmp_path, names=BARE) -> Path:
    """A folder holding other distributions' packages of these names (bench with a cli.py, as frappe's)."""
    site = tmp_path / "site"
    for name in names:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f'"""Another distribution\'s {name}."""\n')
    if "bench" in names:
        (site / "bench" / "cli.py").write_text("WHO = 'frappe'\n")
    return site


def _hub_kernels() -> str:
    """Where Hugging Face's `kernels` is installed ("missing" where it is not: transformers before 5.25)."""
    try:
        return str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def test_inside_this_pytest_run_the_bare_names_are_not_ours():
    """pytest, started in the repository root with its conftest.py and pytest.ini, has the root on sys.path."""
    assert str(ROOT) in [os.path.realpath(p or os.curdir) for p in sys.path]
    import importlib

    for name in BARE:
        module = importlib.import_module(name)
        assert not getattr(module, "__file__", None) or not module.__file__.startswith(str(ROOT / name)), name
    from bertfuse import kernels

    assert kernels.__name__ == "bertfuse.kernels" and hasattr(kernels, "varlen_attention")


@pytest.mark.parametrize("how", ["-c", "-m", "pytest"])
def test_from_the_repository_root_a_bare_import_finds_what_is_installed_or_nothing(tmp_path, how):
    """From the root (the current directory first on sys.path), each way Python starts: another distribution's
    package where one is installed (here: a folder of them on PYTHONPATH, after the root), else nothing of ours."""
    site = _foreign(tmp_path)
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "test_probe.py").write_text(f"def test_probe():\n    exec({PROBE!r})\n")
    args = {"-c": ["-c", PROBE], "-m": ["-m", "probe"],
            "pytest": ["-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider",
                       str(tmp_path / "test_probe.py")]}[how]
    found = _answers(_python(args, ROOT, [tmp_path, site]))
    assert found == {name: str(site / name / "__init__.py") for name in BARE}
    alone = _answers(_python(args, ROOT, [tmp_path]))
    assert set(alone) == set(BARE) and "OURS" not in alone.values()


def test_a_bare_name_installed_nowhere_is_an_empty_module_that_transformers_counts_as_absent(tmp_path):
    """transformers counts it as it counts an empty namespace package: absent on 4.57 (no distribution's version)
    and from 5.12 (no version, no file); 5.0's check asks only whether Python finds a spec, and counts both."""
    (tmp_path / "bertfuse_empty_namespace").mkdir()
    program = textwrap.dedent(f"""
        import sys
        import bench
        print(getattr(bench, "__file__", None), bench.__path__)
        try:
            import bench.cli
        except ModuleNotFoundError as e:
            print("missing", e.name)
        from transformers.utils import import_utils
        check = getattr(import_utils, "_is_package_available", None)  # as is_kernels_available asks it
        sys.path.append({str(tmp_path)!r})
        print("available", check("bench", return_version=True)[0] if check else False,
              check("bertfuse_empty_namespace", return_version=True)[0] if check else False)
        from bertfuse.bench import cli
        print(cli.__name__)
    """)
    out = _python(["-c", program], ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")[:4]
    assert lines[:2] == ["None []", "missing bench.cli"] and lines[3] == "bertfuse.bench.cli"
    import transformers
    from packaging.version import Version
    counted = "True" if Version("5.0") <= Version(transformers.__version__) < Version("5.12") else "False"
    assert lines[2] == f"available {counted} {counted}"


def test_from_another_directory_bertfuse_fuses_and_the_bare_names_are_the_installed_ones(tmp_path):
    program = PROBE + textwrap.dedent("""
        import torch, transformers
        from bertfuse import fuse, fuse_report
        config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32)
        model = transformers.BertModel(config).eval()
        ids = torch.randint(0, 50, (2, 5))
        before = model(ids).last_hidden_state
        fuse(model)
        assert "Fused" in type(model.encoder.layer[0].attention.self).__name__, fuse_report(model)
        torch.testing.assert_close(model(ids).last_hidden_state, before, rtol=1e-5, atol=1e-5)
        print("fused")
    """)
    site = _foreign(tmp_path, ("bert", "bench"))  # a stand-in `kernels` first on the path would break transformers
    out = _python(["-c", program], tmp_path, [site])
    assert _answers(out) == {"kernels": _hub_kernels(), "bert": str(site / "bert" / "__init__.py"),
                             "bench": str(site / "bench" / "__init__.py")}
    assert out.stdout.rstrip().endswith("fused")


def test_a_source_checkout_runs_uninstalled_from_its_root(tmp_path):
    """What bench/gpu_check.sh does on a bare machine: PYTHONPATH=. in the checkout, nothing installed."""
    program = "import bertfuse.bench.cli as cli, bertfuse.kernels.tuned as t; print(cli.__file__, t.__file__)"
    # This interpreter's site-packages (a virtual environment's, and the system's it sees), added without their
    # .pth files: no editable install's finder.
    site_packages = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    assert sysconfig.get_paths()["purelib"] in site_packages
    out = _python(["-S", "-c", f"import sys; sys.path += {site_packages!r}; " + program], ROOT, [ROOT])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(ROOT / "bench" / "cli.py"), str(ROOT / "kernels" / "tuned.py")]


@pytest.mark.slow
def test_the_console_scripts_run_from_the_repository_root():
    out = subprocess.run(["bert-bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: bert-bench" in out.stdout


class _OldNames(pickle._Pickler):
    """Pickles as bertfuse did before its parts moved under `bertfuse`: bertfuse.bert.hf named bert.hf."""

    def save_global(self, obj, name=None):
        module = getattr(obj, "__module__", "")
        if not module.startswith("bertfuse."):
            return super().save_global(obj, name)
        self.save(module.removeprefix("bertfuse."))
        self.save(name or obj.__qualname__)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def test_a_fused_model_pickled_under_the_old_names_loads_with_the_legacy_unpickler(tmp_path):
    import types

    import torch
    import transformers

    from bertfuse import fuse, legacy_pickle

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    model = transformers.BertModel(config).eval()
    fuse(model)
    path = tmp_path / "old.pt"
    torch.save(model, path, pickle_module=types.SimpleNamespace(Pickler=_OldNames, __name__="pickle"))
    with pytest.raises(ModuleNotFoundError, match="No module named"):  # kernels.*, bert.hf
        torch.load(path, weights_only=False)
    loaded = torch.load(path, weights_only=False, pickle_module=legacy_pickle)
    assert type(loaded.encoder.layer[0].attention.self) is type(model.encoder.layer[0].attention.self)
    ids = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


class _FlatHf(pickle._Pickler):
    """Pickles a fused model with every class and function of the drop-in's modules under its flat name,
    bertfuse.bert.hf.<name> (`seen`: the modules they are in)."""
    dispatch = {**pickle._Pickler.dispatch, types.FunctionType: lambda self, obj: self.save_global(obj)}
    seen: set = set()

    def save_global(self, obj, name=None):
        module = getattr(obj, "__module__", "")
        if not module.startswith("bertfuse.bert.hf."):
            return super().save_global(obj, name)
        _FlatHf.seen.add(module)
        self.save("bertfuse.bert.hf")
        self.save(name or obj.__qualname__)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def test_a_fused_model_pickled_with_the_drop_in_as_one_module_loads(tmp_path):
    """Names of the drop-in's modules (forwards, records, hooks, outputs without logits) resolve as
    bertfuse.bert.hf.<name> too."""
    import torch
    import transformers

    from bertfuse import fuse

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    model = fuse(transformers.BertForMaskedLM(config).eval(), mlm_logits=False)
    path = tmp_path / "flat.pt"
    torch.save(model, path, pickle_module=types.SimpleNamespace(Pickler=_FlatHf, __name__="pickle"))
    # the flat names stood in for these modules' names: the fused class's maker, forwards, records, head
    assert {"bertfuse.bert.hf.known", "bertfuse.bert.hf.bert", "bertfuse.bert.hf.records",
            "bertfuse.bert.hf.heads"} <= _FlatHf.seen
    loaded = torch.load(path, weights_only=False)
    assert type(loaded.bert.encoder.layer[0].attention.self) is type(model.bert.encoder.layer[0].attention.self)
    ids, labels = torch.randint(0, 50, (2, 5)), torch.full((2, 5), -100)
    labels[0, 1] = 7
    torch.testing.assert_close(loaded(ids, labels=labels).loss, model(ids, labels=labels).loss)
