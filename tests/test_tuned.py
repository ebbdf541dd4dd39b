"""kernels.tuned: the per-GPU launch-config table, its lookup and its fallback to the launchers' defaults."""
import json

import pytest
import torch

kernels = pytest.importorskip("kernels")
from kernels import tuned  # noqa: E402
from kernels.layer_norm import _default_config as ln_default  # noqa: E402
from kernels.targets import TARGETS  # noqa: E402


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """A table folder the lookup reads, for an sm_90 GPU."""
    monkeypatch.setenv("BERTFUSE_CONFIG_DIR", str(tmp_path))
    tuned.clear_cache()
    yield tmp_path
    tuned.clear_cache()


def write(folder, kernels_entries, fmt=tuned.FORMAT):
    (folder / "sm_90.json").write_text(json.dumps({"format": fmt, "arch": "sm_90", "kernels": kernels_entries}))


SM90 = TARGETS["sm_90"]


def test_buckets_and_keys():
    assert [tuned.bucket(n) for n in (None, 1, 128, 129, 512, 513)] == ["all", "s128", "s128", "s256", "s512",
                                                                          "s1024"]
    assert tuned.entry_key(torch.bfloat16, 64, "s512") == "bfloat16/64/s512"


def test_table_entry_replaces_the_tunable_fields(table_dir):
    default = ln_default(768)
    write(table_dir, {"layer_norm.fwd": {"bfloat16/768/all": {"config": {"BLOCK_M": 2, "num_warps": 16}}}})
    picked = tuned.pick("layer_norm.fwd", default, SM90, torch.bfloat16, 768, tunable=("BLOCK_M", "num_warps"))
    assert picked == default._replace(BLOCK_M=2, num_warps=16)
    # Another size, dtype, kernel, GPU family, or a CPU tensor (no target): the default.
    assert tuned.pick("layer_norm.fwd", default, SM90, torch.bfloat16, 1024) == default
    assert tuned.pick("layer_norm.fwd", default, SM90, torch.float16, 768) == default
    assert tuned.pick("layer_norm.bwd", default, SM90, torch.bfloat16, 768) == default
    assert tuned.pick("layer_norm.fwd", default, TARGETS["sm_80"], torch.bfloat16, 768) == default
    assert tuned.pick("layer_norm.fwd", default, None, torch.bfloat16, 768) == default


def test_nearest_sequence_bucket(table_dir):
    entries = {"bfloat16/64/s128": {"config": {"BLOCK_M": 64}}, "bfloat16/64/s512": {"config": {"BLOCK_M": 128}}}
    write(table_dir, {"attention.fwd": entries})
    default = kernels.attention._default_config("fwd", 64, torch.bfloat16, SM90)._replace(BLOCK_M=16)
    pick = lambda n: tuned.pick("attention.fwd", default, SM90, torch.bfloat16, 64, n).BLOCK_M  # noqa: E731
    assert [pick(n) for n in (40, 128, 200, 300, 512, 4096)] == [64, 64, 64, 128, 128, 128]
    assert pick(None) == 16  # no length given and no "all" entry: the default


def test_an_all_entry_serves_every_length_and_timed_buckets_win(table_dir):
    """A compile-checked table's "all" entries apply at any sequence length; a GPU-timed bucket for the same
    dtype and size wins wherever it exists."""
    write(table_dir, {"attention.fwd": {"bfloat16/64/all": {"config": {"BLOCK_M": 32}, "timed": False}}})
    default = kernels.attention._default_config("fwd", 64, torch.bfloat16, SM90)
    pick = lambda n: tuned.pick("attention.fwd", default, SM90, torch.bfloat16, 64, n).BLOCK_M  # noqa: E731
    assert [pick(n) for n in (None, 40, 512)] == [32, 32, 32]
    write(table_dir, {"attention.fwd": {"bfloat16/64/all": {"config": {"BLOCK_M": 32}, "timed": False},
                                        "bfloat16/64/s512": {"config": {"BLOCK_M": 64}, "timed": True}}})
    tuned.clear_cache()
    assert [pick(n) for n in (None, 40, 512)] == [32, 64, 64]


def test_bad_entries_and_tables_fall_back_with_a_warning(table_dir):
    default = ln_default(768)
    write(table_dir, {"layer_norm.fwd": {"bfloat16/768/all": {"config": {"BLOCK_M": 3}},
                                         "float16/768/all": {"config": {"BLOCK_N": 64}}}})
    with pytest.warns(UserWarning, match="ignoring the launch config"):
        assert tuned.pick("layer_norm.fwd", default, SM90, torch.bfloat16, 768, tunable=("BLOCK_M",)) == default
    with pytest.warns(UserWarning, match="ignoring the launch config"):  # BLOCK_N is fixed by the row width
        assert tuned.pick("layer_norm.fwd", default, SM90, torch.float16, 768, tunable=("BLOCK_M",)) == default
    write(table_dir, {}, fmt=99)
    tuned.clear_cache()
    with pytest.warns(UserWarning, match="ignoring launch-config table"):
        assert tuned.pick("layer_norm.fwd", default, SM90, torch.bfloat16, 768) == default
    (table_dir / "sm_90.json").write_text("{not json")
    tuned.clear_cache()
    with pytest.warns(UserWarning, match="ignoring launch-config table"):
        assert tuned.pick("layer_norm.fwd", default, SM90, torch.bfloat16, 768) == default


def test_forced_config_reaches_the_launcher_and_gives_the_same_result(device):
    x = torch.randn(37, 48, device=device)
    w, b = torch.randn(48, device=device), torch.randn(48, device=device)
    expected = kernels.layer_norm(x, w, b)
    calls = []
    original = tuned.pick

    def spy(kernel, default, *args, **kw):
        picked = original(kernel, default, *args, **kw)
        calls.append((kernel, picked))
        return picked

    with tuned.forced("layer_norm.fwd", {"BLOCK_M": 1, "num_warps": 1}):
        tuned.pick = spy
        try:
            y = kernels.layer_norm(x, w, b)
        finally:
            tuned.pick = original
    assert calls and calls[0][0] == "layer_norm.fwd" and calls[0][1].BLOCK_M == 1
    torch.testing.assert_close(y, expected)
    assert "layer_norm.fwd" not in tuned._forced


def test_tables_are_checked_entry_by_entry_and_the_committed_ones_pass(tmp_path):
    """The tuner's own table passes the check, a table setting a field its launcher may not tune fails it, and
    every committed table (one per GPU measured) passes."""
    import glob
    import os

    from bench.tune import candidates, table_problems, write_table

    good = write_table(str(tmp_path), "sm_90", {"layer_norm.fwd": {"bfloat16/768/all": {
        "config": candidates("layer_norm.fwd")[0], "ms": 0.1}}}, {"gpu": "test"})
    assert table_problems(good) == []
    bad = tmp_path / "sm_80.json"
    bad.write_text(json.dumps({"format": tuned.FORMAT, "kernels": {"layer_norm.fwd": {
        "bfloat16/768/all": {"config": {"BLOCK_N": 64}}, "768": {"config": {}}}}}))
    assert len(table_problems(str(bad))) == 2
    for path in glob.glob(os.path.join(os.path.dirname(tuned.__file__), "configs", "*.json")):
        assert table_problems(path) == [], path

