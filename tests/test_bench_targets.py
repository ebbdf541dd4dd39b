"""bench.targets: absolute targets are set for an H200 and scaled to another GPU by its measured peaks."""
import json

import pytest

pytest.importorskip("triton")
from bertfuse.bench import targets  # noqa: E402


def attention_rows(tflops: float) -> list:
    return [dict(kernel="attention", impl="ours", dtype="bfloat16", status="ok", shape="s512", seq_len=512,
                 padding=0.0, head_dim=64, fwd_TFLOPs=tflops)]


def verdict(results: dict, name="attention fwd, d64 s512 bf16"):
    return {v.name: v for v in targets.evaluate(results)}[name]


def test_the_h200_is_judged_on_the_bound_as_written():
    meta = {"device": "NVIDIA H200", "peaks": {"matmul_TFLOPs": 700.0}}
    assert verdict({"kernels": attention_rows(360), "meta": meta}).met is True
    assert verdict({"kernels": attention_rows(340), "meta": meta}).met is False


def test_another_gpu_is_judged_on_the_bound_scaled_by_its_measured_matmul(tmp_path, monkeypatch):
    meta = {"device": "NVIDIA A100-SXM4-80GB", "peaks": {"matmul_TFLOPs": 280.0}}
    not_yet = verdict({"kernels": attention_rows(150), "meta": meta})
    if not targets.reference_peaks():  # no H200 run committed: not judged, and it says why
        assert not_yet.met is None and "not committed yet" in not_yet.value
    run = tmp_path / "nvidia-h200" / "e2e"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"meta": {"peaks": {"matmul_TFLOPs": 700.0}}}))
    monkeypatch.setattr(targets, "RESULTS", str(tmp_path))
    assert targets.scaled_bound(350, "matmul_TFLOPs", meta, {"matmul_TFLOPs": 700.0})[0] == pytest.approx(140)
    assert targets.reference_peaks() == {"matmul_TFLOPs": 700.0}
    met = verdict({"kernels": attention_rows(150), "meta": meta})
    assert met.met is True and "goal here >= 140 TFLOP/s" in met.value and "x0.40" in met.value
    assert verdict({"kernels": attention_rows(130), "meta": meta}).met is False
    assert targets.scaled_bound(2.0, None, meta) == (2.0, "")  # relative targets are never scaled
