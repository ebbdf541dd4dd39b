"""Run transformers' own model tests on plain and on fused models: `python -m bertfuse.bench.hf_suite` (bench/hf_suite.sh).

The common tests (`ModelTesterMixin`, `ConfigTester`) come from the source distribution of the installed
transformers version (downloaded once with pip into --cache). That distribution lacks three modules the common
tests import (the generation and export mixins and the shared config kwargs): small stand-ins are written in
their place, so generation and export tests are not run here (tests/test_hf_contract.py covers decoder caches and
torch.export of fused models). Our testers (bench/hf_testers/families.py) give each family its small config and
inputs; the plugin (bench/hf_testers/plugin.py) fuses each model right after it is built.

Each (family, heads) runs unfused, fused on the PyTorch path, and fused in the Triton interpreter; the report
lists every test that passes unfused and fails or skips fused ("regressions"), per run, in --out/summary.md and
--out/summary.json (each run's pytest log and junit XML in --out/logs/). Exit status 1 when there is any
regression, 2 when the suite cannot be set up or no test passed unfused in some group, so nothing was compared
there (one line says why). Results made family by family (`--families F --out DIR/F`) make one table with
`--collect --out DIR`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("unfused", "torch", "interpret")
STAND_INS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    \"\"\"Stand-in: not in the sdist.\"\"\"\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    \"\"\"Stand-in: not in the sdist.\"\"\"\n",
    "utils/test_configuration_utils.py": "config_common_kwargs = {\"output_hidden_states\": True, "
                                         "\"return_dict\": False, \"tie_word_embeddings\": False}\n",
}


def sdist(version: str, cache: Path) -> Path:
    """The transformers source distribution of `version`, downloaded once."""
    target = cache / f"transformers-{version}.tar.gz"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                        "--no-build-isolation", "-d", str(cache), f"transformers=={version}"], check=True)
    return target


def layout(archive: Path, work: Path) -> None:
    """work/hf_tests: the distribution's top-level test modules and the stand-ins; work/test_fused_families.py."""
    tests = work / "hf_tests"
    shutil.rmtree(work, ignore_errors=True)
    tests.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                (tests / parts[2]).write_bytes(tar.extractfile(member).read())
    (tests / "__init__.py").touch()
    for path, text in STAND_INS.items():
        (tests / path).parent.mkdir(exist_ok=True)
        (tests / path).parent.joinpath("__init__.py").touch()
        (tests / path).write_text(text)
    shutil.copy(ROOT / "bench" / "hf_testers" / "families.py", work / "test_fused_families.py")


def run(work: Path, out: Path, family: str, heads: int, mode: str, extra: list[str]) -> dict[str, str]:
    """{test id: "passed" | "failed" | "skipped"} of one pytest run."""
    xml = out / "logs" / f"{family}-{heads}h-{mode}.xml"
    env = dict(os.environ, BERTFUSE_FAMILY=family, BERTFUSE_HEADS=str(heads),
               BERTFUSE_MODE="unfused" if mode == "unfused" else "fused",
               PYTHONPATH=os.pathsep.join([str(work), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", "test_fused_families.py", "-q", "-p", "no:cacheprovider",
           "-p", "bertfuse.bench.hf_testers.plugin", "--rootdir", str(work), "-c", os.devnull, f"--junitxml={xml}", *extra]
    with open(xml.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    return outcomes(xml)


def outcomes(xml: Path) -> dict[str, str]:
    """{test: outcome} from a run's junit XML; {} where pytest wrote none (it stopped before collecting)."""
    found = {}
    if not xml.exists():
        return found
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        state = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        found[case.get("name")] = state
    return found


def compare(plain: dict[str, str], fused: dict[str, str]) -> list[str]:
    """Tests that pass unfused and fail, skip or vanish fused."""
    return sorted(t for t, s in plain.items() if s == "passed" and fused.get(t) != "passed")


def counts(results: dict[str, str]) -> str:
    return ", ".join(f"{sum(s == k for s in results.values())} {k}" for k in ("passed", "failed", "skipped"))


def run_group(work: Path, out: Path, fam: str, heads: int, modes: list[str], extra: list[str]) -> list[dict]:
    """One (family, heads): unfused first (the baseline), then each fused mode against it."""
    plain = run(work, out, fam, heads, "unfused", extra)
    found = []
    for mode in modes:
        res = plain if mode == "unfused" else run(work, out, fam, heads, mode, extra)
        found.append({"family": fam, "heads": heads, "mode": mode, "outcomes": res, "regressions": compare(plain, res)})
    return found


def empty_baselines(runs: list[dict]) -> list[str]:
    """The (family, heads) groups in which no test passed unfused: nothing was compared there, so no regression
    count means anything (the testers failed to import, or a -k expression matched nothing)."""
    return [f"{r['family']} ({r['heads']} heads)" for r in runs
            if r["mode"] == "unfused" and "passed" not in r["outcomes"].values()]


def _row(r: dict) -> str:
    bad = r["regressions"]
    return f"| {r['family']} | {r['heads']} | {r['mode']} | {counts(r['outcomes'])} | {len(bad)}: {', '.join(bad)} |"


def write_table(folder: Path, title: str, runs: list[dict]) -> str:
    """The runs' table under `title`, written to folder/summary.md and returned."""
    table = "\n".join([title, "", "| family | heads | mode | outcomes | regressions |", "|---|---|---|---|---|",
                        *map(_row, runs)])
    (folder / "summary.md").write_text(table + "\n")
    return table


def collect(folder: Path) -> tuple[str, int]:
    """One table of every run recorded under folder/<family>/summary.json (each family's own run of this
    command), written to folder/summary.md: (the table, the number of regressions in it)."""
    found = [json.loads(path.read_text()) for path in sorted(folder.glob("*/summary.json"))]
    if not found:
        raise ValueError(f"no <family>/summary.json under {folder}")
    versions = ", ".join(sorted({f["transformers"] for f in found}))
    runs = [r for f in found for r in f["runs"]]
    families = {r["family"] for r in runs}
    bad = sum(len(r["regressions"]) for r in runs)
    title = f"transformers {versions}: {len(families)} families, {len(runs)} runs, {bad} tests passing unfused that " \
            "fail or skip fused"
    return write_table(folder, title, runs), bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/hf_suite"))
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "bertfuse")
    ap.add_argument("--families", default="bert,roberta,distilbert")
    ap.add_argument("--heads", default="4,2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--jobs", type=int, default=1, help="(family, heads) groups run at once, one thread each")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset of the tests)")
    ap.add_argument("--collect", action="store_true",
                    help="run nothing: tabulate --out/<family>/summary.json (one run per family) in --out/summary.md")
    args = ap.parse_args(argv)
    if args.collect:
        try:
            table, bad = collect(args.out)
        except ValueError as e:
            print(f"hf_suite: {e}", file=sys.stderr)
            return 2
        print(table)
        return 1 if bad else 0
    modes = args.modes.split(",")
    if "unfused" not in modes or set(modes) - set(MODES):
        ap.error(f"--modes: a comma list of {', '.join(MODES)}, including unfused (the baseline)")
    try:
        import transformers

        from bertfuse.bert.hf import family
        for name in args.families.split(","):
            family(name)
        archive = sdist(transformers.__version__, args.cache)
    except (ImportError, ValueError, subprocess.CalledProcessError) as e:
        print(f"hf_suite: {e}", file=sys.stderr)
        return 2
    args.out = args.out.resolve()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    work = args.cache / f"hf_suite-{transformers.__version__}"
    layout(archive, work)
    if args.jobs > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # one thread per test process when several run at once
    extra = ["-k", args.k] if args.k else []
    groups = [(fam, int(h)) for fam in args.families.split(",") for h in args.heads.split(",")]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = [r for rs in pool.map(lambda g: run_group(work, args.out, *g, modes, extra), groups) for r in rs]
    print(write_table(args.out, f"transformers {transformers.__version__}: tests passing unfused that fail or skip "
                                "fused", runs))
    (args.out / "summary.json").write_text(json.dumps({"transformers": transformers.__version__, "runs": runs},
                                                      indent=1))
    if empty := empty_baselines(runs):
        print(f"hf_suite: no test passed unfused in {', '.join(empty)}, so nothing was compared; see "
              f"{args.out / 'logs'}", file=sys.stderr)
        return 2
    return 1 if any(r["regressions"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
