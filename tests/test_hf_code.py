"""bert/hf/code.py: fuse fuses only transformers code recorded as checked. A class or function changed at run time
(what next month's release would do) runs its changed code, with a warning naming the class and the installed
release; the opt-in fuses it anyway; the digest ignores what does not compute (docstrings, annotations, layout);
a transformers older than the floor stops with one error; setup.py's floor and the committed release table agree."""
import importlib.util
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers.models.bert import modeling_bert  # noqa: E402

from bertfuse.bench import hf_versions  # noqa: E402
from bertfuse.bench.hf_parity import batch, build  # noqa: E402
from bertfuse.bert.hf import code, fuse, fuse_report, unfuse  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# BERT's self-attention class as its models hold it (transformers 4: BertSdpaSelfAttention, under sdpa).
ATTENTION = type(build("bert", "Model").encoder.layer[0].attention.self)
CHECKED = code.recorded().get(code.qualified(ATTENTION), {})
checked_bert = pytest.mark.skipif(code.digest(ATTENTION) not in CHECKED,
                                  reason=f"BERT's code in transformers {transformers.__version__} is not a checked "
                                         "variant (test_the_installed_release_is_checked_where_the_table_says_so)")


def test_the_installed_release_is_checked_where_the_table_says_so():
    rows = json.loads((hf_versions.RESULTS / "results.json").read_text())
    row = rows.get(transformers.__version__)
    if row is None:
        pytest.skip(f"transformers {transformers.__version__} is not in bench/results/hf_versions")
    fused = row["families"]["bert"].get("cell") == "fused"
    assert (code.digest(ATTENTION) in CHECKED) == fused


def _halved(original):
    def forward(self, *args, **kwargs):  # a release (or a patch) that changes the attention's math
        out = original(self, *args, **kwargs)
        return (out[0] * 0.5, *out[1:])
    return forward


def _answers(model):
    ids, mask, _ = batch("bert")
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


@checked_bert
def test_a_class_changed_at_run_time_runs_its_changed_code_with_a_warning(monkeypatch):
    original = _answers(build("bert"))
    monkeypatch.setattr(ATTENTION, "forward", _halved(ATTENTION.forward))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fuse(build("bert"))
    kept = dict(fuse_report(fused)[0].kept)
    name = ATTENTION.__name__
    assert name in kept["attention"] and transformers.__version__ in kept["attention"]
    assert "not been checked" in kept["attention"]
    assert any(name in str(w.message) and transformers.__version__ in str(w.message) for w in caught)
    # The patched code's answer (the LayerNorms still run their kernel), not the fused forward's.
    patched = _answers(build("bert"))
    torch.testing.assert_close(_answers(fused), patched, rtol=1e-5, atol=1e-5)
    assert (patched - original).abs().max() > 1e-3  # the patch does change the answer


@checked_bert
def test_a_module_function_changed_at_run_time_counts_too(monkeypatch):
    """BERT's layer calls apply_chunking_to_forward, a function its modeling module imports: a patch of that
    function there changes the digest of every class whose code calls it."""
    before = code.digest(modeling_bert.BertLayer)
    original = modeling_bert.apply_chunking_to_forward
    monkeypatch.setattr(modeling_bert, "apply_chunking_to_forward", lambda *a, **k: original(*a, **k))
    assert code.digest(modeling_bert.BertLayer) != before
    fused = fuse(build("bert"))
    assert "attention" in dict(fuse_report(fused)[0].kept)


@checked_bert
def test_unchecked_code_fuses_only_when_asked(monkeypatch):
    monkeypatch.setattr(ATTENTION, "forward", _halved(ATTENTION.forward))
    fused = fuse(build("bert"), unchecked_code=True)
    assert "attention" not in dict(fuse_report(fused)[0].kept)
    unfuse(fused)
    assert "attention" in dict(fuse_report(fuse(fused))[0].kept)  # the default checks again


@checked_bert
def test_checked_code_is_fused():
    fused = fuse(build("bert"))
    assert "attention" not in dict(fuse_report(fused)[0].kept)


def test_the_digest_ignores_docstrings_annotations_and_layout(tmp_path):
    plain = "def f(x, y):\n    return x * y + 1\n"
    dressed = 'def f(x: int, y: "T") -> int:\n    """Doc."""\n    # why\n    return (x *\n            y) + 1\n'
    changed = "def f(x, y):\n    return x * y - 1\n"
    digests = []
    for i, src in enumerate((plain, dressed, changed)):
        path = tmp_path / f"variant{i}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("bertfuse_test_variant", path)  # one name
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        digests.append(code.digest(module.f))
    assert digests[0] == digests[1] != digests[2]


def test_an_older_transformers_stops_with_one_error(monkeypatch):
    model = build("bert")
    monkeypatch.setattr(code, "transformers_version", lambda: "4.56.2")
    with pytest.raises(RuntimeError, match=r"transformers 4\.56\.2 is installed; bertfuse supports transformers "
                                           + re.escape(code.OLDEST)):
        fuse(model)
    assert not hasattr(model, "_bertfuse_originals")  # nothing changed


def test_setup_floor_is_the_oldest_release_in_the_table():
    floor = re.search(r'TRANSFORMERS = "transformers>=([0-9.]+)"', (ROOT / "setup.py").read_text())[1]
    assert floor == code.OLDEST
    rows = json.loads((hf_versions.RESULTS / "results.json").read_text())
    assert min(rows, key=hf_versions._release_key) == code.OLDEST
    # No FAILING cell (the compatibility tier's result is the sweep's own exit code: this test is part of it).
    assert not [b for r in rows.values() for b in hf_versions.failing({"families": r["families"]})]


def test_every_model_type_is_fused_or_refused_as_the_table_says_and_refused_gives_the_unfused_answer():
    """On the installed transformers: what fuse does with each model type's attention is what the committed
    table says for this release (where it has it), and a model type refused there still answers as unfused."""
    from bertfuse.bench.hf_fuzz import FAMILIES

    rows = json.loads((hf_versions.RESULTS / "results.json").read_text())
    row = rows.get(transformers.__version__, {}).get("families", {})
    for family in FAMILIES:
        if hf_versions._head(family) is None:  # not in this release
            assert row.get(family, {}).get("cell", "absent") == "absent"
            continue
        got = hf_versions._probe(family)
        if family in row:
            assert (got == "fused") == (row[family]["cell"] == "fused"), (family, got, row[family]["cell"])
        if got == "fused":
            continue
        head = hf_versions._head(family)
        ref = build(family, head)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fused = fuse(build(family, head))
        ids, mask, _ = batch(family)
        with torch.no_grad():
            a, b = ref(input_ids=ids, attention_mask=mask)[0], fused(input_ids=ids, attention_mask=mask)[0]
        keep = mask.bool()
        torch.testing.assert_close(b[keep], a[keep], rtol=1e-5, atol=1e-5)


def test_an_unchecked_release_is_told_where_its_code_was_checked(monkeypatch):
    """The reason names the oldest newer release on which the class's code was checked (upgrade to it), or says
    that no newer one was."""
    name = code.qualified(ATTENTION)
    monkeypatch.setattr(code, "recorded", lambda: {name: {"0" * 16: ["3.0.0", "99.1.0", "99.0.2"]}})
    why = code.code_problem(ATTENTION)
    assert "fused on transformers 99.0.2" in why and "pip install 'transformers>=99.0.2'" in why
    monkeypatch.setattr(code, "recorded", lambda: {name: {"0" * 16: ["3.0.0"]}})
    assert "a release bertfuse has not checked" in code.code_problem(ATTENTION)
