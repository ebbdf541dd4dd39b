"""kernels.targets: which GPU family a device is, what it refuses, and that each family's committed launch-config
table is what the launchers read on a (fake) device of that family."""
import glob
import json
import os
from types import SimpleNamespace

import pytest
import torch

kernels = pytest.importorskip("bertfuse.kernels")
from bertfuse.kernels import targets, tuned  # noqa: E402
from bertfuse.kernels.targets import TARGETS  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(tuned.__file__), "configs")


def cuda_props(major, minor, name="GPU", **kw):
    return SimpleNamespace(major=major, minor=minor, name=name, **kw)


def test_devices_map_to_their_family():
    assert targets.from_properties(cuda_props(8, 0, "NVIDIA A100"), hip=False) is TARGETS["sm_80"]
    assert targets.from_properties(cuda_props(7, 5, "Tesla T4"), hip=False) is TARGETS["sm_75"]
    rocm = SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X", major=9, minor=4)
    assert targets.from_properties(rocm, hip=True) is TARGETS["gfx942"]  # not "sm_94" from the capability
    # A family outside the list: built from what the device reports, with no table.
    orin = targets.from_properties(cuda_props(8, 7, "Orin", shared_memory_per_block_optin=166912), hip=False)
    assert (orin.name, orin.shared_bytes, orin.bf16, orin.dot) == ("sm_87", 166912, True, "mma")
    navi = targets.from_properties(SimpleNamespace(gcnArchName="gfx1100", name="RX 7900", warp_size=32), hip=True)
    assert (navi.name, navi.backend, navi.warp_size) == ("gfx1100", "hip", 32)
    with pytest.raises(RuntimeError, match="sm_70.*sm_75"):
        targets.from_properties(cuda_props(7, 0, "Tesla V100"), hip=False)


def test_every_family_is_described_consistently():
    for name, t in TARGETS.items():
        assert t.name == name and t.backend in ("cuda", "hip") and t.shared_bytes >= 64 * 1024
        assert t.warp_size == (64 if t.backend == "hip" else 32)
        assert t.bf16 == (name != "sm_75") and t.tensor_core_dots == (name != "sm_75")


def test_cpu_and_interpreter_have_no_target():
    assert targets.of(torch.device("cpu")) is None


def fake_gpu(monkeypatch, name: str) -> torch.device:
    """A CUDA device of family `name` as the launchers see it (no GPU is touched)."""
    monkeypatch.setattr(targets, "INTERPRET", False)
    monkeypatch.setattr(targets, "_device_target", lambda index: TARGETS[name])
    return torch.device("cuda", 0)


def test_bf16_and_half_precision_dots_are_refused_clearly_on_sm75(monkeypatch):
    device = fake_gpu(monkeypatch, "sm_75")
    with pytest.raises(TypeError, match=r"layer_norm: bfloat16 needs .*sm_75.*float16"):
        kernels._common.check_device("layer_norm", x=SimpleNamespace(device=device, dtype=torch.bfloat16))
    kernels._common.check_device("layer_norm", x=SimpleNamespace(device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="no tensor-core dots on sm_75"):
        targets.check("varlen_attention", torch.float16, device, dots=True)
    targets.check("varlen_attention", torch.float32, device, dots=True)  # exact float32 dots: CUDA cores everywhere
    device = fake_gpu(monkeypatch, "sm_80")
    kernels._common.check_device("layer_norm", x=SimpleNamespace(device=device, dtype=torch.bfloat16))
    targets.check("varlen_attention", torch.bfloat16, device, dots=True)


def test_kernels_refusal_answers_per_op_device_dtype_and_shape(monkeypatch):
    """kernels.refusal: the one public question "can this op run here, and if not why"."""
    assert "need a CUDA device" in kernels.refusal("layer_norm", torch.device("meta"))
    assert kernels.refusal("attention", head_dim=128) is None
    assert "attention: head_dim 129 is not supported" in kernels.refusal("attention", head_dim=129)
    with pytest.raises(KeyError, match="no op 'nope'"):
        kernels.refusal("nope")
    with pytest.raises(TypeError, match="no shape limits"):
        kernels.refusal("layer_norm", head_dim=64)
    device = fake_gpu(monkeypatch, "sm_75")
    monkeypatch.setattr(kernels._common, "INTERPRET", False)
    assert "bfloat16 needs" in kernels.refusal("layer_norm", device, torch.bfloat16)
    assert "no tensor-core dots" in kernels.refusal("attention", device, torch.float16, head_dim=64)
    assert kernels.refusal("layer_norm", device, torch.float16) is None  # no dots: runs on sm_75
    assert kernels.refusal("attention", device, torch.float32, head_dim=64) is None


def committed_tables():
    return sorted(glob.glob(os.path.join(CONFIGS, "*.json")))


def test_a_compile_checked_table_is_committed_for_every_family():
    assert sorted(os.path.basename(p)[:-5] for p in committed_tables()) == sorted(TARGETS)
    for path in committed_tables():
        table = json.load(open(path))
        assert table["kernels"], path
        assert all("timed" in e for entries in table["kernels"].values() for e in entries.values()), path
        for kernel, entries in table["kernels"].items():  # the run that wrote each kernel's entries, by kind
            kinds = {"timed" if e["timed"] else "compile_checked" for e in entries.values()}
            runs = table["runs"][kernel]
            assert kinds <= set(runs) and all(runs[k]["command"].startswith("python -m bertfuse.bench.tune") for k in kinds)
            assert "compile_checked" not in kinds or "--compile-only" in runs["compile_checked"]["command"]


def test_the_launchers_read_each_tables_choice_on_a_device_of_that_family(monkeypatch):
    """Each entry of each committed table, looked up through the launcher's own config function for a fake
    device of the table's family, comes back as the table's config (and a table is never read for another)."""
    from bertfuse.kernels import launches

    monkeypatch.delenv("BERTFUSE_CONFIG_DIR", raising=False)
    tuned.clear_cache()
    checked = 0
    for path in committed_tables():
        name = os.path.basename(path)[:-5]
        device = fake_gpu(monkeypatch, name)
        for kernel, entries in json.load(open(path))["kernels"].items():
            site = launches.site(kernel)
            for key, entry in entries.items():
                dtype, size, bucket = key.split("/")
                if bucket != "all":
                    continue
                dtype, size = getattr(torch, dtype), int(size)
                got = site.config(dtype, size, targets.of(device))
                default = site.default(dtype, size, targets.of(device))
                assert got == default._replace(**entry["config"]), (name, kernel, key)
                checked += 1
    assert checked > 0
    tuned.clear_cache()


@pytest.mark.parametrize("arch, warp, dot, bf16", [
    ("gfx1100", 32, "wmma", True), ("gfx1201:xnack-", 32, "wmma", True), ("gfx1030", 32, "fma", False),
    ("gfx950:sramecc+", 64, "mfma", True), ("gfx908", 64, "mfma", True), ("gfx906", 64, "fma", False)])
def test_amd_gpus_outside_the_list_are_their_own_family(arch, warp, dot, bf16):
    """An RDNA GPU (wave32, WMMA from gfx11 on, no MFMA) is not taken for a CDNA one, even where its torch
    reports a wavefront of 64; a GCN part without matrix cores has no tensor-core dots (the model then runs
    attention and the MLM loss in PyTorch, as on sm_75)."""
    props = SimpleNamespace(gcnArchName=arch, name="AMD GPU", warp_size=64)
    t = targets.from_properties(props, hip=True)
    assert (t.name, t.warp_size, t.dot, t.bf16, t.tensor_core_dots) == (arch.split(":")[0], warp, dot, bf16,
                                                                         dot != "fma")
    assert t.name not in TARGETS and t.registers == 512


@pytest.mark.parametrize("props", [SimpleNamespace(name="AMD Radeon"), SimpleNamespace(name="AMD", gcnArchName=""),
                                   SimpleNamespace(name="AMD", gcnArchName=None)])
def test_a_rocm_gpu_without_an_arch_name_is_a_clear_error_and_the_modules_fall_back(props, monkeypatch):
    with pytest.raises(RuntimeError, match="no gcnArchName for the ROCm GPU"):
        targets.from_properties(props, hip=True)
    # What a drop-in module does with it: its PyTorch path, one warning naming the reason.
    monkeypatch.setattr(targets, "_device_target", lambda index: targets.from_properties(props, hip=True))
    monkeypatch.setattr(targets, "INTERPRET", False)
    kernels._common._warned.clear()
    x = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.float32)
    with pytest.warns(UserWarning, match="no gcnArchName"):
        assert kernels._common.backend_for(x) == "torch"
