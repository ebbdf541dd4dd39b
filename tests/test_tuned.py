"""kernels.tuned: the per-GPU launch-config table, its lookup and its fallback to the launchers' defaults."""
import json
import sys

import pytest
import torch

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels import tuned  # noqa: E402
from bertfuse.kernels.layer_norm import _default_config as ln_default  # noqa: E402
from bertfuse.kernels.targets import TARGETS  # noqa: E402


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

    from bertfuse.bench.tables import table_problems, write_table
    from bertfuse.bench.tune_problems import candidates

    good = write_table(str(tmp_path), "sm_90", {"layer_norm.fwd": {"bfloat16/768/all": {
        "config": candidates("layer_norm.fwd")[0], "ms": 0.1}}}, "timed", {"gpu": "test"})
    assert table_problems(good) == []
    bad = tmp_path / "sm_80.json"
    bad.write_text(json.dumps({"format": tuned.FORMAT, "kernels": {"layer_norm.fwd": {
        "bfloat16/768/all": {"config": {"BLOCK_N": 64}}, "768": {"config": {}}}}}))
    assert len(table_problems(str(bad))) == 2
    for path in glob.glob(os.path.join(os.path.dirname(tuned.__file__), "configs", "*.json")):
        assert table_problems(path) == [], path



def _launcher_config(kernel: str, dtype: torch.dtype, size: int, target):
    """What the launcher of `kernel` picks for one launch of (dtype, size) on `target` (its declared site)."""
    from bertfuse.kernels import launches

    return launches.site(kernel).config(dtype, size, target)


def test_every_committed_entry_is_what_its_launcher_uses_on_its_family(recwarn):
    """The launchers' refusals (powers of two, threads, shared memory, registers) refuse no entry a family's
    committed table holds: each launch takes its entry, with no warning."""
    import glob
    import os

    tuned.clear_cache()
    for path in sorted(glob.glob(os.path.join(os.path.dirname(tuned.__file__), "configs", "*.json"))):
        target = TARGETS[os.path.basename(path)[:-5]]
        for kernel, entries in json.load(open(path, encoding="utf-8"))["kernels"].items():
            for key, entry in entries.items():
                dtype, size, _ = key.split("/")
                picked = _launcher_config(kernel, getattr(torch, dtype), int(size), target)._asdict()
                assert {k: picked[k] for k in entry["config"]} == entry["config"], (path, kernel, key)
    assert not [w for w in recwarn if "ignoring" in str(w.message)]


@pytest.mark.parametrize("text, why", [
    ("[1, 2]", "top level is a JSON array"),
    ('{"format": 1, "kernels": {"layer_norm.fwd": [1]}}', "layer_norm.fwd in launch-config table"),
    ('{"format": 1, "kernels": {"layer_norm.fwd": {"bfloat16/768/all": 5}}}', "without a \"config\" object"),
    ('{"format": 1, "kernels": {"layer_norm.fwd": {"bfloat16/768/s100": {"config": {"BLOCK_M": 2}}}}}',
     "bucket 's100'"),
    ('{"format": 1, "kernels": {"layer_norm.fwd": {"bfloat16/768/s0": {"config": {"BLOCK_M": 2}}}}}', "bucket 's0'"),
    ('{"format": 1, "kernels": {"layer_norm.fwd": {"bfloat16/x/all": {"config": {"BLOCK_M": 2}}}}}',
     "not a key"),
])
def test_a_damaged_table_is_refused_part_by_part_naming_the_file_and_the_key(table_dir, text, why):
    (table_dir / "sm_90.json").write_text(text)
    default = ln_default(768)
    with pytest.warns(UserWarning, match=why) as caught:
        picked = tuned.pick("layer_norm.fwd", default, SM90, torch.bfloat16, 768, seqlen=100,
                            tunable=("BLOCK_M", "num_warps"))
    assert picked == default
    assert any(str(table_dir / "sm_90.json") in str(w.message) for w in caught)


@pytest.mark.parametrize("config, why", [
    ({"num_warps": 6}, "num_warps=6 is not a power of two"),
    ({"num_warps": 64}, "2048 threads on sm_90"),
    ({"BLOCK_M": 0}, "not a positive integer"),
    ({"BLOCK_M": True}, "not a positive integer"),
    ({"BLOCK_M": 1 << 21}, "over Triton's"),
    ({"BLOCK_M": 256, "num_warps": 4}, "values a thread, over sm_90's 255 registers"),
])
def test_entries_the_family_cannot_run_are_refused_by_name(table_dir, config, why):
    write(table_dir, {"layer_norm.fwd": {"bfloat16/768/all": {"config": config}}})
    default = ln_default(768)
    with pytest.warns(UserWarning, match=why) as caught:
        picked = sys.modules["bertfuse.kernels.layer_norm"]._config("fwd", torch.bfloat16, 768, SM90)
    assert picked == default
    assert "sm_90.json, bfloat16/768/all" in str(caught[0].message)


def test_attention_tiles_over_the_shared_memory_are_refused(table_dir):
    write(table_dir, {"attention.fwd": {"bfloat16/128/all": {"config": {"BLOCK_N": 512, "num_stages": 4}}}})
    with pytest.warns(UserWarning, match="bytes of shared memory, over sm_90's"):
        picked = kernels.attention._config("fwd", 128, torch.bfloat16, SM90, None)
    assert picked == kernels.attention._default_config("fwd", 128, torch.bfloat16, SM90)
