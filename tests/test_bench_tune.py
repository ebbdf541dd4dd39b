"""bench.tune: the sweep in the interpreter at tiny shapes with an injected timer, the verification of the winner,
the table it writes (read back by the launchers), and the pruning by compile check (without a GPU)."""
import json
import os

import pytest
import torch

pytest.importorskip("triton")
from bertfuse.bench import tables, tune, tune_compile, tune_problems, tune_timed  # noqa: E402
from bertfuse.kernels import tuned  # noqa: E402
from bertfuse.kernels.targets import TARGETS  # noqa: E402

CPU = torch.device("cpu")
SM90 = TARGETS["sm_90"]


def fake_timer(times):
    """Runs the timed call once (so it really launches) and returns the next of `times`."""
    it = iter(times)

    def timer(fn):
        fn()
        return next(it)
    return timer


TINY = [tune_problems.Problem("layer_norm.bwd", torch.float32, 40, None, (21, 40)),
        tune_problems.Problem("bias_gelu.fwd", torch.float16, 48, None, (9, 48)),
        tune_problems.Problem("attention.dkdv", torch.float32, 16, 40, (3, 40, 2)),
        tune_problems.Problem("mlm_loss.dweight", torch.float32, 32, None, (10, 32, 200))]


@pytest.mark.slow
@pytest.mark.parametrize("problem", TINY, ids=str)
def test_sweep_picks_the_fastest_verified_config(problem):
    default = tune_problems.default_launch(problem.kernel, problem.dtype, problem.size, None)._asdict()
    fields = list(tune_problems.candidates(problem.kernel)[0])
    other = {k: default[k] for k in fields}
    other["BLOCK_M"] = default["BLOCK_M"] * 2
    configs = [other, {"num_warps": 2}]
    entry = tune_timed.tune_problem(problem, CPU, fake_timer([5.0, 1.0, 3.0]), configs=configs)
    assert entry["config"] == dict({k: default[k] for k in fields}, num_warps=2)
    assert entry["ms"] == 1.0 and entry["default_ms"] == 3.0 and entry["candidates"] == 3


def test_a_winner_whose_output_differs_is_dropped(monkeypatch):
    problem = TINY[0]
    real = tune_timed.run_with

    def corrupt(problem, config, run, what):
        out = real(problem, config, run, what)
        return [o * 1.01 for o in out] if what == "outputs" and config["BLOCK_M"] == 1 else out

    monkeypatch.setattr(tune_timed, "run_with", corrupt)
    entry = tune_timed.tune_problem(problem, CPU, fake_timer([1.0, 2.0, 3.0]),
                              configs=[{"BLOCK_M": 1, "num_warps": 4}, {"BLOCK_M": 2, "num_warps": 4}])
    assert entry["config"] == {"BLOCK_M": 2, "num_warps": 4} and entry["pruned"] == 1


def test_sweep_respects_the_budget_and_the_table_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(tune_problems, "candidates", lambda kernel: [{"num_warps": 2}])
    results = tune_timed.sweep(TINY[:2], CPU, budget=1e9, timer=fake_timer([1.0, 2.0] * 2), prune_fn=None,
                         log=lambda *_: None)
    assert set(results) == {"layer_norm.bwd", "bias_gelu.fwd"}
    assert tune_timed.sweep(TINY, CPU, budget=-1, timer=None, prune_fn=None, log=lambda *_: None) == {}
    path = tables.write_table(str(tmp_path), "sm_90", results, "timed", {"command": "first"})
    table = json.load(open(path))
    assert table["format"] == tuned.FORMAT
    assert table["kernels"]["layer_norm.bwd"]["float32/40/all"]["config"] == {"num_warps": 2}
    # Merging keeps earlier entries, and each kernel names the run that wrote its entries.
    tables.write_table(str(tmp_path), "sm_90", {"attention.fwd": {"bfloat16/64/s512": {"config": {"BLOCK_M": 64}}}},
                       "compile_checked", {"command": "second"})
    tables.write_table(str(tmp_path), "sm_90", {"attention.fwd": {"bfloat16/64/s128": {"config": {"BLOCK_M": 32}}}},
                       "timed", {"command": "third"})
    table = json.load(open(path))
    assert set(table["kernels"]) == {"layer_norm.bwd", "bias_gelu.fwd", "attention.fwd"}
    assert table["runs"] == {"layer_norm.bwd": {"timed": {"command": "first"}},
                             "bias_gelu.fwd": {"timed": {"command": "first"}},
                             "attention.fwd": {"compile_checked": {"command": "second"},
                                               "timed": {"command": "third"}}}
    assert not set(tables.RUN_FIELDS) & set(table)  # no table-wide record of one run
    assert [p.name for p in tmp_path.iterdir()] == ["sm_90.json"]  # no temporary left behind
    # The launcher reads it back, as on an sm_90 GPU.
    monkeypatch.setenv("BERTFUSE_CONFIG_DIR", str(tmp_path))
    tuned.clear_cache()
    try:
        default = tune_problems.default_launch("layer_norm.bwd", torch.float32, 40, SM90)
        picked = tuned.pick("layer_norm.bwd", default, SM90, torch.float32, 40)
        assert picked == default._replace(num_warps=2)
    finally:
        tuned.clear_cache()


def test_problems_cover_bert_shapes_most_used_first():
    todo = tune_problems.problems(tune_problems.families(), [torch.bfloat16, torch.float16])
    assert todo[0].dtype == torch.bfloat16 and todo[-1].dtype == torch.float16
    keys = {(p.kernel, p.key) for p in todo}
    for key in [("attention.fwd", "bfloat16/64/s128"), ("attention.dq", "float16/64/s512"),
                ("layer_norm.bwd", "bfloat16/1024/all"), ("bias_gelu.fwd", "bfloat16/4096/all"),
                ("mlm_loss.dhidden", "bfloat16/768/s8192"), ("mlm_loss.strategy", "bfloat16/1024/s32768"),
                ("mlm_loss.ce", "float16/768/s8192")]:
        assert key in keys
    for p in todo:  # every candidate set only varies what the launcher lets a table tune
        default = tune_problems.default_launch(p.kernel, p.dtype, p.size, SM90)
        assert set(tune_problems.candidates(p.kernel)[0]) <= set(default._fields)


@pytest.mark.compile
def test_pruning_compiles_candidates_for_sm90_without_a_gpu():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    problem = tune_problems.Problem("attention.fwd", torch.bfloat16, 64, 512, (4, 512, 12))
    good = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    too_big = {"BLOCK_M": 256, "BLOCK_N": 256, "num_warps": 4, "num_stages": 3}
    narrow = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    kept, pruned = tune_timed.prune(problem, [good, too_big, narrow], "sm_90", jobs=2, warm=False)
    assert kept == [good]
    assert "the launcher refuses" in pruned[json.dumps(too_big, sort_keys=True)]  # more than a thread can hold
    assert "wgmma" in pruned[json.dumps(narrow, sort_keys=True)]


def test_main_without_a_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert tune.main(["--budget", "1"]) == 2
    assert "no GPU here" in capsys.readouterr().err
    assert tune.main(["--compile-only"]) == 2
    assert "needs --arch" in capsys.readouterr().err


@pytest.mark.slow
def test_the_mlm_strategy_is_tuned_on_forward_and_backward_and_read_back(tmp_path, monkeypatch):
    """mlm_loss.strategy is a choice, not a kernel config: no compile check prunes it, each candidate is timed on
    the whole forward + backward (the chunked strategy computes its gradients in the forward), the winner's
    gradients are checked against the default's, and the launcher's pick reads it from the table."""
    from bertfuse.kernels.mlm_loss import _Strategy

    problem = tune_problems.Problem("mlm_loss.strategy", torch.float32, 16, 20, (20, 16, 50))
    choices = [{"strategy": "chunked"}, {"strategy": "fused"}]
    assert tune_timed.prune(problem, choices, "sm_90", jobs=1, warm=False) == (choices, {})  # nothing to compile
    run = tune_timed.setup(problem, CPU)
    run.timed()
    grads = run.outputs()
    assert len(grads) == 3 and all(g is not None and g.abs().sum() > 0 for g in grads)
    entry = tune_timed.tune_problem(problem, CPU, fake_timer([3.0, 1.0]))
    assert entry["config"] == {"strategy": "fused"} and entry["default_ms"] == 3.0 and entry["candidates"] == 2
    tables.write_table(str(tmp_path), "sm_90", {problem.kernel: {"bfloat16/768/s8192": entry}}, "timed", {})
    monkeypatch.setenv("BERTFUSE_CONFIG_DIR", str(tmp_path))
    tuned.clear_cache()
    try:
        def pick(rows, hidden=768):
            return tuned.pick("mlm_loss.strategy", _Strategy("chunked"), SM90, torch.bfloat16, hidden,
                              seqlen=rows).strategy
        assert pick(4915) == "fused" and pick(19660) == "fused"  # the nearest row bucket
        assert pick(4915, hidden=1024) == "chunked"               # no entry: the default
    finally:
        tuned.clear_cache()


def test_the_chunked_row_kernel_is_timed_with_its_gradient_pass():
    problem = tune_problems.Problem("mlm_loss.ce", torch.float16, 16, 20, (20, 16, 50))
    default = tune_problems.default_launch(problem.kernel, problem.dtype, problem.size, None)
    entry = tune_timed.tune_problem(problem, CPU, fake_timer([2.0, 1.0, 3.0]),
                              configs=[{"BLOCK_V": 64, "num_warps": 4}, {"BLOCK_V": 32, "num_warps": 2}])
    assert entry["config"] == {"BLOCK_V": 32, "num_warps": 2} and entry["candidates"] == 3
    assert default.BLOCK_V not in (32, 64)  # the default, a third candidate, was timed too


def test_untimed_configs_are_the_default_then_smaller_tiles_largest_first_more_warps_first():
    base = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    pool = [dict(base, BLOCK_M=128), dict(base, BLOCK_N=32), dict(base, BLOCK_N=16), base,
            dict(base, BLOCK_N=32, num_stages=3), dict(base, BLOCK_N=32, num_warps=4, num_stages=3)]
    # Larger tiles (BLOCK_M=128), or more of a tile per warp than the default (16 wide on one warp): left out.
    assert tune_compile.ranked(base, pool) == [base, dict(base, BLOCK_N=32, num_stages=3), dict(base, BLOCK_N=32),
                                       dict(base, BLOCK_N=32, num_warps=4, num_stages=3), dict(base, BLOCK_N=16)]
    narrower = dict(base, BLOCK_N=16, num_warps=1)
    assert narrower not in tune_compile.ranked(base, pool + [narrower])


@pytest.mark.compile
def test_compile_only_keeps_clean_defaults_untimed_and_leaves_timed_entries_alone():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    keep = {"bias_gelu.fwd": {"bfloat16/3072/all": {"config": {"num_warps": 4}, "ms": 0.1, "timed": True}}}
    results = tune_compile.compile_only("sm_90", ["bias_gelu"], jobs=2, keep=keep, log=lambda *_: None)
    assert set(results) == {"bias_gelu.fwd", "bias_gelu.bwd"}
    assert sorted(results["bias_gelu.fwd"]) == ["float16/3072/all", "float32/3072/all"]  # the timed one stays
    for kernel, entries in results.items():
        for key, entry in entries.items():
            dtype = getattr(torch, key.split("/")[0])
            default = tune_problems.default_launch(kernel, dtype, 3072, SM90)._asdict()
            assert entry["timed"] is False and entry["config"] == {k: default[k] for k in entry["config"]}
    # sm_75 refuses bfloat16, so it has nothing to configure there.
    assert {p.dtype for p in tune_compile.compile_problems(["bias_gelu"], TARGETS["sm_75"])} == {torch.float16,
                                                                                          torch.float32}


def test_refusal_names_what_a_family_cannot_run_and_nothing_else():
    sm75, bf16, fp16 = TARGETS["sm_75"], torch.bfloat16, torch.float16
    assert "bfloat16" in tune_problems.refusal(tune_problems.Problem("layer_norm.fwd", bf16, 768, None, ()), sm75)
    assert "tensor-core" in tune_problems.refusal(tune_problems.Problem("attention.fwd", fp16, 64, 128, ()), sm75)
    assert tune_problems.refusal(tune_problems.Problem("layer_norm.fwd", fp16, 768, None, ()), sm75) is None
    assert tune_problems.refusal(tune_problems.Problem("attention.fwd", bf16, 64, 128, ()), SM90) is None
    strategy = tune_problems.Problem("mlm_loss.strategy", fp16, 768, 4915, ())
    assert tune_problems.refusal(strategy, sm75) is None  # a choice


@pytest.mark.parametrize("args, why", [(["--jobs", "0"], "--jobs must be at least 1, got 0"),
                                       (["--jobs", "-2"], "--jobs must be at least 1, got -2")])
def test_compile_only_refuses_no_workers_before_compiling(args, why, capsys, monkeypatch):
    monkeypatch.setattr(tune_compile, "compile_only", lambda *a, **k: pytest.fail("compiled"))
    assert tune.main(["--compile-only", "--arch", "sm_90", *args]) == 2
    assert capsys.readouterr().err.strip() == f"bench.tune: {why}"


def test_compile_only_refuses_an_output_it_cannot_write_before_compiling(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tune_compile, "compile_only", lambda *a, **k: pytest.fail("compiled"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert tune.main(["--compile-only", "--arch", "sm_90", "--output", str(blocker / "configs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bench.tune: --output {blocker / 'configs'} is not a folder this process can write")
    assert err.count("\n") == 1
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert tune.main(["--compile-only", "--arch", "sm_90", "--output", str(locked)]) == 2
