"""bert.model.config: Hugging Face's field names both ways, the paper's presets, and configs it cannot run refused."""
import dataclasses
import json

import pytest

from bertfuse import bert
from bertfuse.bert.common.files import read_json_object


def test_config_json_round_trips_through_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = bert.BertConfig.tiny(vocab_size=1234, id2label={0: "NEG", 1: "POS", 2: "MIX"}, layer_norm_eps=1e-7)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    hf = transformers.BertConfig.from_pretrained(tmp_path)
    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "num_labels"):
        assert getattr(hf, f) == getattr(cfg, f), f
    assert hf.id2label == cfg.id2label
    hf.save_pretrained(tmp_path / "hf")
    back = bert.BertConfig.from_json_file(tmp_path / "hf")
    assert dataclasses.replace(back, extra={}) == dataclasses.replace(cfg, extra={})


def test_config_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        bert.BertConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ValueError, match="hidden_act"):
        bert.BertConfig(hidden_act="swish")
    with pytest.raises(ValueError, match="position_embedding_type"):
        bert.BertConfig.from_dict({"position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="backend"):
        bert.BertConfig(backend="cuda")



def test_presets_are_the_papers_shapes():
    base, large = bert.BertConfig.base(), bert.BertConfig.large()
    assert (base.num_hidden_layers, base.hidden_size, base.num_attention_heads, base.head_dim) == (12, 768, 12, 64)
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.intermediate_size) == \
        (24, 1024, 16, 4096)
    assert bert.BertConfig.preset("tiny", vocab_size=50).vocab_size == 50
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        bert.BertConfig.preset("huge")


def test_replace_checks_fields_and_drops_labels_that_no_longer_fit():
    cfg = bert.BertConfig.tiny(id2label={"0": "NEG", "1": "POS"})
    assert cfg.id2label == {0: "NEG", 1: "POS"} and cfg.num_labels == 2 and cfg.label2id == {"NEG": 0, "POS": 1}
    assert cfg.replace(num_labels=3).id2label is None and cfg.replace(num_labels=2).id2label == cfg.id2label
    with pytest.raises(TypeError, match="unknown BertConfig field"):
        cfg.replace(hidden=3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        cfg.replace(num_attention_heads=3)
    assert cfg.replace(hidden_act="gelu_new").gelu_approximate == "tanh"


def test_unknown_keys_round_trip_and_bookkeeping_is_dropped(tmp_path):
    d = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 128,
         "vocab_size": 99, "model_type": "bert", "transformers_version": "9.9", "architectures": ["BertModel"],
         "gradient_checkpointing": False, "my_field": [1, 2], "backend": "triton"}
    cfg = bert.BertConfig.from_dict(d)
    assert cfg.extra == {"gradient_checkpointing": False, "my_field": [1, 2]} and cfg.backend == "auto"
    out = json.loads(cfg.to_json_string(architectures=["BertForMaskedLM"]))
    assert out["my_field"] == [1, 2] and "backend" not in out and out["architectures"] == ["BertForMaskedLM"]
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    assert bert.BertConfig.from_json_file(tmp_path, backend="torch") == cfg.replace(backend="torch")
    with pytest.raises(ValueError, match="describes a 'roberta' model"):
        bert.BertConfig.from_dict({"model_type": "roberta"})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        bert.BertConfig.from_json_file(tmp_path / "nowhere")


@pytest.mark.parametrize("text,message", [("", "not valid JSON"), ("[1, 2]", "expected a JSON object, got list"),
                                          ("{oops", "not valid JSON")])
def test_read_json_object_names_the_file(tmp_path, text, message):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        read_json_object(path)
    assert str(path) in str(e.value)
