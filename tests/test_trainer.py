"""bert.train's guarantees on a tiny classification job: non-finite steps never update or get saved, one job
per output directory, a failed checkpoint write says so and leaves the earlier ones, log windows restart at
checkpoints, and the warm-up follows transformers."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from bertfuse import bert
from bertfuse.bert.common.errors import ExpectedError
from bertfuse.bert.data.pipeline import StepList
from bertfuse.bert.model.checkpoint import read_state_dict
from bertfuse.bert.train.health import NonFiniteError
from bertfuse.bert.train.loop import Job, Trainer, amp_precision, warmup_steps
from bertfuse.bert.train.optim import warmup_decay_schedule
from bertfuse.bert.train.rundir import OutputDirBusy, latest_checkpoint, output_dir_lock
from bertfuse.bert.train.settings import Settings

POISON = float("nan")


class Poisonable(bert.BertForSequenceClassification):
    """The classifier, whose loss a batch can multiply by NaN (a diverging step, on demand)."""

    def forward(self, poison=None, **batch):
        out = super().forward(**batch)
        out.loss = out.loss * poison
        return out


class Steps(StepList):
    """A job's epoch as the trainer reads it: item i is global step i's micro-batches."""

    def __init__(self, steps):
        self.steps = steps

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]


class TinyJob(Job):
    """Global step i: one micro-batch of 4 random sequences; the steps in `poisoned` (1-based) give a NaN loss."""
    name = "tiny"

    def __init__(self, poisoned=(), seed=0):
        torch.manual_seed(seed)
        cfg = bert.BertConfig.tiny(vocab_size=50, max_position_embeddings=32, num_labels=2, backend="torch",
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.model, self.poisoned = Poisonable(cfg), set(poisoned)

    def epoch_steps(self, epoch, steps_before, d, accum):
        steps = []
        for i in range(100):
            g = torch.Generator().manual_seed(i)
            bad = steps_before + i + 1 in self.poisoned
            steps.append([{"input_ids": torch.randint(1, 50, (4, 8), generator=g),
                           "attention_mask": torch.ones(4, 8, dtype=torch.long),
                           "labels": torch.randint(0, 2, (4,), generator=g),
                           "poison": torch.tensor(POISON if bad else 1.0)}])
        return Steps(steps)

    def counts(self, batch):
        return {"task": 4.0}

    def loss_terms(self, out, batch):
        return {"task": out.loss * 4}


def settings(out, **kw):
    os.makedirs(out, exist_ok=True)
    base = dict(output_dir=str(out), steps=6, lr=1e-3, log_every=1, progress=False)
    return Settings(**{**base, **kw})


def fit(job, s):
    trainer = Trainer(job, s, torch.device("cpu"), bert.train.distributed.Dist())
    return trainer, trainer.fit()


def rows(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_saves_nothing_after_it(tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(TinyJob(poisoned={3}), settings(out, save_every=2, log_every=4), torch.device("cpu"),
                      bert.train.distributed.Dist())
    with pytest.raises(NonFiniteError, match=r"step 3: the loss \(nan\).*not finite.*step-00000002"):
        trainer.fit()
    assert latest_checkpoint(str(out)).endswith("step-00000002")  # the window was read before step 4's checkpoint
    assert not (out / "model.safetensors").exists()
    assert all(torch.isfinite(t).all() for t in read_state_dict(latest_checkpoint(str(out))).values())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # step 3 changed no weight
    log = rows(out)
    assert [r["step"] for r in log] == [2, 4] and log[1]["nonfinite_steps"] == 1 and log[1]["steps"] == 2


def test_a_non_finite_first_step_does_not_advise_a_lower_learning_rate(tmp_path):
    """Step 1 (warm-up's learning rate 0, no weight changed yet): the forward pass itself is not finite, so the
    advice is the precision (fp16's range) or the data and starting weights, never --lr."""
    trainer = Trainer(TinyJob(poisoned={1}), settings(tmp_path, warmup=0.5), torch.device("cpu"),
                      bert.train.distributed.Dist())
    with pytest.raises(NonFiniteError, match="step 1: .*a lower --lr cannot help: check the data") as e:
        trainer.fit()
    assert "Lower --lr" not in str(e.value)
    trainer.scaler = torch.amp.GradScaler("cpu")  # as under --precision fp16
    assert "overflows float16" in trainer._nonfinite_advice() and "--precision bf16" in trainer._nonfinite_advice()
    trainer.applied_steps = 3  # once a step has changed the weights, the learning rate may be the cause
    assert trainer._nonfinite_advice().startswith("Lower --lr")


def test_a_skipped_step_changes_nothing_and_the_run_goes_on(tmp_path):
    """--max-nonfinite-steps 1: step 3's update is skipped (weights, Adam moments, step count), steps 1-2 and 4-5
    train as usual: the same weights as a run whose step 3 brings no batch at all."""
    trainer, last = fit(TinyJob(poisoned={3}), settings(tmp_path / "a", steps=5, max_nonfinite_steps=1))
    assert last["step"] == 5 and [r["nonfinite_steps"] for r in rows(tmp_path / "a")] == [0, 0, 1, 0, 0]
    assert all(torch.isfinite(t).all() for t in read_state_dict(str(tmp_path / "a")).values())

    ref = Trainer(TinyJob(), settings(tmp_path / "b", steps=5), torch.device("cpu"), bert.train.distributed.Dist())
    steps = ref.job.epoch_steps(0, 0, ref.d, 1)
    window = bert.train.health.Window()
    for i in range(5):
        if i == 2:  # what a skipped step still does: the learning-rate schedule moves on
            ref.scheduler.step()
            continue
        ref._step(steps[i], window)
    for (name, a), b in zip(trainer.model.named_parameters(), ref.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_more_non_finite_steps_in_a_row_than_allowed_stop_the_run(tmp_path):
    with pytest.raises(NonFiniteError, match=r"step 5: .*\(2 in a row\)"):
        fit(TinyJob(poisoned={2, 4, 5}), settings(tmp_path, steps=8, max_nonfinite_steps=1, log_every=3))


def test_weights_that_are_not_finite_are_never_written(tmp_path):
    job = TinyJob()
    trainer = Trainer(job, settings(tmp_path, steps=1), torch.device("cpu"), bert.train.distributed.Dist())
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="not finite.*nothing saved"):
        trainer.save_checkpoint()
    assert latest_checkpoint(str(tmp_path)) is None


def test_a_failed_checkpoint_write_is_one_error_and_leaves_the_earlier_checkpoints(tmp_path, monkeypatch):
    trainer, _ = fit(TinyJob(), settings(tmp_path, steps=2, save_every=2))
    before = latest_checkpoint(str(tmp_path))
    trainer.state["step"] = 4

    def full_disk(obj, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"step 4: the checkpoint could not be written to .*checkpoints "
                                      r"\(\[enforce fail.*MiB free. Earlier checkpoints are intact") as e:
        trainer.save_checkpoint()
    assert "\n" not in str(e.value)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["step-00000002"] and latest_checkpoint(str(tmp_path)) == before
    assert (root / "step-00000002" / "training_state.pt").stat().st_size > 1000


def test_log_windows_restart_at_checkpoints_so_a_resume_logs_the_same_rows(tmp_path):
    fit(TinyJob(), settings(tmp_path / "full", steps=10, log_every=5, save_every=4))
    full = rows(tmp_path / "full")
    assert [(r["step"], r["steps"]) for r in full] == [(4, 4), (5, 1), (8, 3), (10, 2)]
    fit(TinyJob(), settings(tmp_path / "cut", steps=10, log_every=5, save_every=4))
    ckpt = tmp_path / "cut" / "checkpoints" / "step-00000004"
    fit(TinyJob(), settings(tmp_path / "cut", steps=10, log_every=5, save_every=4, resume=str(ckpt)))
    resumed = rows(tmp_path / "cut")
    assert [r["step"] for r in resumed] == [4, 5, 8, 10]
    for a, b in zip(full, resumed):
        assert a["task_loss"] == pytest.approx(b["task_loss"], rel=1e-6) and a["steps"] == b["steps"]


def test_warm_up_follows_transformers():
    transformers = pytest.importorskip("transformers")
    assert warmup_steps(0.01, 50) == 1 and warmup_steps(0.1, 25) == 3 and warmup_steps(4, 10) == 4
    for warmup, total in ((0, 10), (3, 10), (1, 2)):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        ref = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
        ours = warmup_decay_schedule(warmup, total)
        for step in range(total + 1):
            assert ours(step) == pytest.approx(ref.lr_lambdas[0](step), abs=1e-12), (warmup, total, step)


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_polynomial_decay_follows_the_formula_and_transformers(power):
    """((total - step) / (total - warmup)) ** power after the warm-up (NVIDIA's recipe: 0.5), as transformers'
    polynomial schedule with lr_end 0; power 1 is the linear schedule, exactly."""
    transformers = pytest.importorskip("transformers")
    warmup, total = 28, 100
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=6e-3)
    ref = transformers.get_polynomial_decay_schedule_with_warmup(opt, warmup, total, lr_end=0.0, power=power)
    ours = warmup_decay_schedule(warmup, total, power)
    linear = warmup_decay_schedule(warmup, total)
    for step in range(total + 1):
        expected = step / warmup if step < warmup else ((total - step) / (total - warmup)) ** power
        assert ours(step) == pytest.approx(expected, abs=1e-15)
        assert ours(step) == pytest.approx(ref.lr_lambdas[0](step), abs=1e-12), step
        if power == 1.0:
            assert ours(step) == linear(step)
    assert ours(warmup) == 1.0 and ours(total) == 0.0


LOCK_HOLDER = """
import sys, time
from bertfuse.bert.train.rundir import output_dir_lock
with output_dir_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_job_in_the_same_output_dir_is_refused_and_a_dead_holder_leaves_no_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirBusy, match=rf"in use by another job \(pid {holder.pid} on "):
            with output_dir_lock(str(tmp_path)):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with output_dir_lock(str(tmp_path)):  # the kernel dropped the dead process's lock
        with open(tmp_path / ".lock") as f:
            assert f"pid {os.getpid()}" in f.read()


def test_both_commands_take_the_trainer_options_from_one_group():
    """bert-pretrain and bert-finetune take the trainer's options as declared (Settings), each with its own
    defaults, and build Settings from them the same way."""
    from bertfuse.bert import finetune, pretrain

    parsers = {"pretrain": pretrain.build_parser(), "finetune": finetune.build_parser()}
    helps = {name: p.format_help().split("\ntraining:\n")[1].split("\n\n")[0] for name, p in parsers.items()}
    flags = {name: re.findall(r"^  (--[a-z-]+)", text, re.M) for name, text in helps.items()}
    assert flags["pretrain"] == flags["finetune"] == [f.names[0] for f in Settings.as_flags()]
    pre = parsers["pretrain"].parse_args(["--data", "x.txt", "--lr", "2e-4", "--no-progress"])
    fine = parsers["finetune"].parse_args(["classify", "--model", "m", "--resume"])
    assert (pre.lr, pre.save_every, fine.lr, fine.save_every, fine.resume) == (2e-4, 500, 3e-5, 0, "latest")
    s = Settings.from_arguments(pre, 7, {"a": 1}, adam_eps=1e-6)
    assert (s.steps, s.lr, s.progress, s.adam_eps, s.output_dir) == (7, 2e-4, False, 1e-6, "runs/pretrain")
    assert s.run_settings == {"lr": 2e-4, "warmup": 0.01, "lr_decay_power": 1.0, "optimizer": "adamw",
                              "weight_decay": 0.01, "grad_accum": 1, "max_grad_norm": 1.0, "precision": "auto", "seed": 0, "a": 1}
    for flag, value, message in (("lr", 0.0, "--lr must be positive"), ("warmup", -1.0, "--warmup must be 0 or more"),
                                 ("keep_checkpoints", 0, "--keep-checkpoints must be positive")):
        bad = parsers["finetune"].parse_args(["classify", "--model", "m"])
        setattr(bad, flag, value)
        with pytest.raises(ValueError, match=message):
            Settings.check_arguments(bad)


def test_a_trainer_option_is_one_declaration():
    """A field declared with option() is a flag of the group, checked, and compared on --resume: nothing else."""
    import argparse
    import dataclasses

    from bertfuse.bert.train.settings import option

    @dataclasses.dataclass
    class More(Settings):
        label_smoothing: float = option(0.0, "smoothing (default %(default)s)", check="non_negative", resumed=True)

    parser = argparse.ArgumentParser()
    More.add_arguments(parser, lr=5e-5)
    args = parser.parse_args(["--label-smoothing", "0.1"])
    assert (args.label_smoothing, args.lr) == (0.1, 5e-5)
    assert More.from_arguments(args, 3, {}).run_settings["label_smoothing"] == 0.1
    args.label_smoothing = -1.0
    with pytest.raises(ValueError, match="--label-smoothing must be 0 or more"):
        More.check_arguments(args)
    with pytest.raises(TypeError, match="not trainer options"):
        More.add_arguments(argparse.ArgumentParser(), steps=3)


# ---- signals and faults: each test bounded by its own timeout -------------------------------------------------
import threading  # noqa: E402

from bertfuse.bert.train.rundir import truncate_log  # noqa: E402


class SlowSteps(Steps):
    """TinyJob's steps, where step `slow` (1-based) takes a minute to arrive (a shard being planned) and step
    `fatal`, in a DataLoader worker, kills that worker (the OOM killer)."""

    def __init__(self, steps, slow=None, fatal=None, started=None):
        super().__init__(steps.steps)
        self.slow, self.fatal, self.started = slow, fatal, started

    def __getitem__(self, i):
        if i + 1 == self.fatal and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if i + 1 == self.slow:
            self.started.set()
            for _ in range(600):  # a shard being planned, which a signal interrupts
                time.sleep(0.1)
        return self.steps[i]


class SlowJob(TinyJob):
    def __init__(self, slow=None, fatal=None, slow_eval=False):
        super().__init__()
        self.slow, self.fatal, self.slow_eval, self.started = slow, fatal, slow_eval, threading.Event()

    def epoch_steps(self, epoch, steps_before, d, accum):
        return SlowSteps(super().epoch_steps(epoch, steps_before, d, accum), self.slow, self.fatal, self.started)

    def evaluate(self, model):
        if self.slow_eval:
            self.started.set()
            for _ in range(600):
                time.sleep(0.1)
        return {"eval_x": 1.0}


def _signal_when(event: threading.Event, sig=signal.SIGTERM):
    def send():
        event.wait(30)
        time.sleep(0.2)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigterm_while_waiting_for_a_batch_stops_at_once_with_a_checkpoint(tmp_path):
    job = SlowJob(slow=4)
    _signal_when(job.started)
    t0 = time.monotonic()
    trainer, last = fit(job, settings(tmp_path, steps=50, log_every=10))
    assert time.monotonic() - t0 < 30 and last["stopped"] and last["step"] == 3
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000003")
    assert [r["step"] for r in rows(tmp_path)] == [3] and not (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigterm_while_evaluating_abandons_it_and_checkpoints(tmp_path):
    job = SlowJob(slow_eval=True)
    _signal_when(job.started)
    trainer, last = fit(job, settings(tmp_path, steps=50, eval_every=2))
    assert last["stopped"] and last["step"] == 2 and "eval_x" not in last
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000002") and trainer.model.training


KILLED_WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
from bertfuse.bert.common import commands
from test_trainer import SlowJob, fit, settings
sys.exit(commands.run("train", lambda: fit(SlowJob(fatal=3), settings(sys.argv[2], steps=10, num_workers=1)) and 0))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_dataloader_worker_is_one_clear_line(tmp_path):
    """In a process of its own: torch reports a dead worker from its SIGCHLD handler, wherever the process is,
    and that must not reach the test runner."""
    tests = os.path.dirname(os.path.abspath(__file__))
    for attempt in range(1):
        done = subprocess.run([sys.executable, "-c", KILLED_WORKER, tests, str(tmp_path / f"run{attempt}")],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        line, = [x for x in done.stderr.splitlines() if x.startswith("train: ")]
        assert re.fullmatch(r"train: error: after step \d+: DataLoader worker \(pid.*\d+\).* (killed|exited).*"
                            r"--resume continues from the last checkpoint", line), line


def test_a_run_whose_every_step_was_skipped_saves_no_model_and_logs_no_nan(tmp_path):
    with pytest.raises(NonFiniteError, match="no step of this run had a finite loss.*nothing was saved"):
        fit(TinyJob(poisoned=set(range(1, 10))), settings(tmp_path, steps=4, max_nonfinite_steps=10))
    assert not (tmp_path / "model.safetensors").exists()

    def no_nan(text):
        raise AssertionError(f"{text} in log.jsonl, which is then not JSON")

    with open(tmp_path / "log.jsonl") as f:
        logged = [json.loads(line, parse_constant=no_nan) for line in f]
    assert [r["nonfinite_steps"] for r in logged] == [1, 1, 1, 1] and logged[0]["task_loss"] is None


def test_a_torn_last_log_row_is_dropped_on_resume_and_a_damaged_earlier_one_named(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # killed while writing row 3
    truncate_log(str(log), 2)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    log.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"log.jsonl:2: not a JSON log row"):
        truncate_log(str(log), 2)


def fake_cuda(monkeypatch, major, minor, name, hip=None):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(major=major, minor=minor, name=name))
    monkeypatch.setattr(torch.version, "hip", hip)
    return torch.device("cuda", 0)


def test_auto_precision_is_bf16_where_the_gpu_has_it_and_fp16_where_not(monkeypatch):
    assert amp_precision("auto", torch.device("cpu")) == "fp32"
    assert amp_precision("bf16", torch.device("cpu")) == "bf16"  # CPU autocast has bfloat16
    assert amp_precision("auto", fake_cuda(monkeypatch, 8, 0, "NVIDIA A100")) == "bf16"
    assert amp_precision("auto", fake_cuda(monkeypatch, 9, 4, "AMD Instinct MI300X", hip="6.2")) == "bf16"
    t4 = fake_cuda(monkeypatch, 7, 5, "Tesla T4")
    assert amp_precision("auto", t4) == "fp16" and amp_precision("fp16", t4) == "fp16"
    assert amp_precision("fp32", t4) == "fp32"
    with pytest.raises(ExpectedError, match=r"--precision bf16: the Tesla T4 \(sm_75\) has no bfloat16.*fp16"):
        amp_precision("bf16", t4)


# ---- --optimizer lamb ---------------------------------------------------------------------------------------
def test_lamb_trains_resumes_exactly_and_saves_its_state(tmp_path):
    """Four steps straight, and a resume from the step-2 checkpoint of the same run: the same log rows and bits;
    the checkpoint holds LAMB's float32 moments and step counts, and a resume under AdamW is refused."""
    lamb = dict(optimizer="lamb", steps=4, save_every=2, lr=5e-3, warmup=2, run_settings={"optimizer": "lamb"})
    trainer, _ = fit(TinyJob(), settings(tmp_path / "full", **lamb))
    assert type(trainer.optimizer).__name__ == "Lamb"
    full = rows(tmp_path / "full")
    assert all(r["grad_norm"] > 0 and r["nonfinite_steps"] == 0 for r in full)
    saved = torch.load(tmp_path / "full" / "checkpoints" / "step-00000002" / "training_state.pt", weights_only=True)
    state = next(iter(saved["optimizer"]["state"].values()))
    assert state["step"].item() == 2 and state["exp_avg"].dtype == torch.float32
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["optimizer"] == "lamb"

    fit(TinyJob(), settings(tmp_path / "cut", **lamb))
    ckpt = str(tmp_path / "cut" / "checkpoints" / "step-00000002")  # resumed from: steps 3 and 4 again
    with pytest.raises(ValueError, match="--optimizer was 'lamb', now 'adamw'"):
        Trainer(TinyJob(), settings(tmp_path / "cut", **dict(lamb, optimizer="adamw", run_settings={
                "optimizer": "adamw"}), resume=ckpt), torch.device("cpu"), bert.train.distributed.Dist())
    resumed, _ = fit(TinyJob(), settings(tmp_path / "cut", **lamb, resume=ckpt))
    assert [(r["task_loss"], r["lr"], r["grad_norm"]) for r in rows(tmp_path / "cut")] == \
        [(r["task_loss"], r["lr"], r["grad_norm"]) for r in full]
    for (name, a), b in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_lamb_pre_normalises_instead_of_clipping_and_skips_a_non_finite_step_on_the_device(tmp_path):
    """--max-grad-norm under LAMB is its pre-normalisation: the log shows the gradients' norm before it, and one
    step equals a Lamb step of the unclipped gradients; a poisoned step changes nothing and the run goes on."""
    trainer, _ = fit(TinyJob(), settings(tmp_path / "one", optimizer="lamb", steps=1, max_grad_norm=0.01))
    logged = rows(tmp_path / "one")[0]["grad_norm"]
    twin = TinyJob()
    batch = twin.epoch_steps(0, 0, None, 1)[0][0]
    (twin.loss_terms(twin.model(**batch), batch)["task"] / 4).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in twin.model.parameters()]))
    assert logged == pytest.approx(norm.item(), rel=1e-5) and logged > 0.01
    from bertfuse.kernels import Lamb

    groups = bert.train.optim.param_groups(twin.model, 0.01)
    opt = Lamb(groups, lr=torch.tensor(0.0), max_grad_norm=0.01)  # step 1 of a schedule without warm-up: lr 1e-3
    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = 1e-3
    opt.step()
    for (name, a), b in zip(trainer.model.named_parameters(), twin.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    skipped, last = fit(TinyJob(poisoned={3}), settings(tmp_path / "skip", optimizer="lamb", steps=4,
                                                        max_nonfinite_steps=1))
    assert [r["nonfinite_steps"] for r in rows(tmp_path / "skip")] == [0, 0, 1, 0]
    assert all(s["step"].item() == 3 for s in skipped.optimizer.state.values())  # step 3 counted for none


@pytest.mark.slow
def test_lamb_runs_in_the_captured_static_step(tmp_path, monkeypatch):
    """The trainer's step as a CUDA graph would run it (GraphedStep, with the CPU stand-in of a capture):
    learning rates on the device, LAMB's step inside, nothing read back; the same weights as without."""
    from bertfuse.bert.train import loop
    from test_static import _cpu_record

    eager, _ = fit(TinyJob(), settings(tmp_path / "eager", optimizer="lamb", steps=4, warmup=2))
    monkeypatch.setattr(loop.Trainer, "_graphs_possible", lambda self: True)
    monkeypatch.setattr(TinyJob, "static_shapes", True, raising=False)
    trainer = Trainer(TinyJob(), settings(tmp_path / "graphed", optimizer="lamb", steps=4, warmup=2,
                                          cuda_graphs=True), torch.device("cpu"), bert.train.distributed.Dist())
    assert isinstance(trainer.optimizer.param_groups[0]["lr"], torch.Tensor)
    trainer.graphed.record = _cpu_record
    trainer.fit()
    assert trainer.graphed.replay is not None
    assert [r["task_loss"] for r in rows(tmp_path / "graphed")] == [r["task_loss"] for r in rows(tmp_path / "eager")]
    for (name, a), b in zip(eager.model.named_parameters(), trainer.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.compile
def test_lamb_beside_a_compiled_model(tmp_path):
    """--compile with --optimizer lamb: the compiled forward and backward (aot_eager), LAMB's kernels after them;
    the same training as eager."""
    eager, _ = fit(TinyJob(), settings(tmp_path / "eager", optimizer="lamb", steps=3))
    compiled, _ = fit(TinyJob(), settings(tmp_path / "compiled", optimizer="lamb", steps=3, compile="aot_eager"))
    for (name, a), b in zip(eager.model.named_parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
