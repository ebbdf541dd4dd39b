"""End-to-end pre-training step (forward, backward, AdamW) for several implementations on the same batches.

Each variant runs in a fresh process, so compile caches, allocator state and peak-memory counters of one never
leak into the next. FLOPs are counted on real tokens only (padding is not work), the MLM head on labelled
positions only, so MFU is comparable across variants that skip different amounts of work.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import resource
import time
import traceback

VARIANTS = {
    "hf-eager": "transformers BertForPreTraining, eager (SDPA attention)",
    "hf-compile": "the same under torch.compile",
    "ours-torch": "this project, backend='torch' (unpadded, masked-only MLM)",
    "ours-triton": "this project, backend='triton' (fused kernels)",
    "hf-fused": "transformers model with bert.hf.fuse(model, mlm_logits=False)",
    "ours-packed": "this project on packed batches of the padded batch's token budget (triton on a GPU)",
    "ours-packed-compile": "the same under torch.compile (one shape: compiled once)",
    "ours-packed-graphs": "the same, each step (forward, backward, AdamW) replayed from a CUDA graph (GPU)",
    # masked-LM-only pre-training: what transformers trains padding-free (NSP needs one pooled [CLS] a sequence)
    "hf-mlm-eager": "transformers BertForMaskedLM on the padded batch, SDPA attention",
    "hf-mlm-compile": "the same under torch.compile",
    "hf-flat": "transformers BertForMaskedLM padding-free: the same sequences through DataCollatorWithFlattening, "
               "SDPA attention",
    "hf-flat-compile": "the same under torch.compile",
    "hf-flat-flex": "transformers padding-free with flex attention (its block mask skips the work between sequences)",
    "hf-flat-flex-compile": "the same under torch.compile",
    "hf-flat-fa": "transformers padding-free with the newest flash attention installed (2, 3 or 4; GPU)",
    "ours-mlm": "this project's BertForMaskedLM on the padded batch (triton on a GPU)",
    "ours-mlm-packed": "this project's BertForMaskedLM on packed batches of the padded batch's token budget",
}
PACKED = ("ours-packed", "ours-packed-compile", "ours-packed-graphs", "ours-mlm-packed")
MLM_ONLY = ("hf-mlm-eager", "hf-mlm-compile", "hf-flat", "hf-flat-compile", "hf-flat-flex", "hf-flat-flex-compile",
            "hf-flat-fa", "ours-mlm", "ours-mlm-packed")
FLAT = tuple(v for v in MLM_ONLY if v.startswith("hf-flat"))
COMPILED = tuple(v for v in VARIANTS if v.endswith("-compile"))
# transformers run unfused: the baselines a speedup is measured against (hf-fused is this project's layers)
BASELINES = tuple(v for v in VARIANTS if v.startswith("hf-") and v != "hf-fused")


def objective(variant: str) -> str:
    return "mlm" if variant in MLM_ONLY else "mlm+nsp"


def step_flops(cfg, lengths, labelled: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) on real tokens."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    tokens = sum(lengths)
    dense = 2 * (4 * h * h + 2 * h * i) * layers * tokens
    attention = 4 * h * layers * sum(n * n for n in lengths)
    mlm_head = 2 * (h * h + h * cfg.vocab_size) * labelled
    return 3 * (dense + attention + mlm_head)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a
    spawned child (in_fresh_process) reports its parent's peak whenever that was higher than its own."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _hf_model(variant: str, cfg, device, family: str):
    """The transformers model of an hf-* variant, with the attention that variant runs (bench.baselines)."""
    import transformers

    from .baselines import attention_of, flattening_refusal, LeftOut

    if family == "roberta":  # RoBERTa's pre-training: MLM only, its own vocabulary and position offset
        hf_cfg = transformers.RobertaConfig(**dict(cfg.to_dict(), vocab_size=50265, max_position_embeddings=514,
                                                   type_vocab_size=1, pad_token_id=1))
        cls = transformers.RobertaForMaskedLM
    else:
        hf_cfg = transformers.BertConfig(**cfg.to_dict())
        cls = transformers.BertForMaskedLM if variant in MLM_ONLY else transformers.BertForPreTraining
    hf_cfg._attn_implementation = attention_of(variant, device)
    if hf_cfg._attn_implementation == "flex_attention":  # transformers' flex raises on attention dropout in training
        hf_cfg.attention_probs_dropout_prob = 0.0
    if variant in FLAT and (why := flattening_refusal(hf_cfg._attn_implementation, device)):
        raise LeftOut(why)
    model = cls(hf_cfg).to(device)
    if variant == "hf-fused":
        from bertfuse.bert.hf import fuse

        fuse(model, mlm_logits=False)  # the step reads only the loss: the masked-only loss path
    return model


def _build(variant: str, cfg, device, family: str = "bert", compile_backend: str = "inductor"):
    import torch

    from bertfuse import bert

    if variant.startswith("hf"):
        model = _hf_model(variant, cfg, device, family)
    else:
        triton = variant == "ours-triton" or (variant in PACKED + ("ours-mlm",) and device.type == "cuda")
        cls = bert.BertForMaskedLM if variant in MLM_ONLY else bert.BertForPreTraining
        model = cls(cfg.replace(backend="triton" if triton else "torch")).to(device)
    return torch.compile(model, backend=compile_backend) if variant in COMPILED else model


def _runs_on(model) -> str:
    """A row's `runs`: the attention a transformers model runs (and when without attention dropout, that it does:
    less work than the others), or our backend."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    if attention is None:
        return config.backend
    no_dropout = attention == "flex_attention" and not config.attention_probs_dropout_prob
    return attention + (" (no attention dropout: flex takes none)" if no_dropout else "")


def _batches(variant: str, spec: dict, vocab: int, flash: bool) -> list:
    """The variant's four batches: padded (make_batch; MLM-only: mlm_only), packed to the same slots, or the
    padded batch's own sequences flattened (the same real tokens, one row)."""
    from .batches import make_batch, make_flat_batch, make_packed_batch, mlm_only

    args = spec["batch"], spec["seq_len"], vocab, spec["padding"]
    if variant in PACKED:
        return [make_packed_batch(*args, seed=s) for s in range(4)]
    if variant in FLAT:
        return [make_flat_batch(make_batch(*args, seed=s), flash_kwargs=flash) for s in range(4)]
    return [(mlm_only if variant in MLM_ONLY else (lambda b: b))(make_batch(*args, seed=s)) for s in range(4)]


def _stepper(variant: str, model, device, amp, family: str):
    """The timed step: forward, backward, AdamW (fused on a GPU); for ours-packed-graphs, all of it captured
    as one CUDA graph on the first call (bert.train.static.GraphedStep, capturable AdamW) and replayed after."""
    from bertfuse.bert.train.optim import adamw

    from .batches import model_kwargs

    mlm = variant in MLM_ONLY
    graphs = variant == "ours-packed-graphs"
    if graphs and device.type != "cuda":
        raise RuntimeError("CUDA graphs need a GPU")
    opt = adamw(model.parameters(), 1e-4, device, capturable=graphs)

    def step(batches, _denominators=None):
        with amp:
            out = model(**batches[0])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [{"loss": out.loss.detach()}]

    if graphs:
        from bertfuse.bert.train.static import GraphedStep

        graphed = GraphedStep(step, model, opt)
        return lambda b: graphed([model_kwargs(b, family, mlm)], {})
    return lambda b: step([model_kwargs(b, family, mlm)])


def pytorch_path_on_cpu(device: str) -> None:
    """In a fresh benchmark process on a CPU: no Triton interpreter, so fused models run their PyTorch path (a
    benchmark of the interpreter would say nothing). Where triton is already imported there is nothing to undo."""
    import os
    import sys

    if device == "cpu" and "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)


def run_variant(variant: str, spec: dict) -> dict:
    """Runs in a child process; returns one result row. On a CPU, fused transformers models run their PyTorch
    path even where TRITON_INTERPRET is set (a benchmark of the interpreter would say nothing)."""
    pytorch_path_on_cpu(spec["device"])
    import torch

    from bertfuse import bert

    from .baselines import LeftOut

    spec = {"family": "bert", **spec}
    row = {"variant": variant, "objective": "mlm" if spec["family"] == "roberta" else objective(variant),
           **{k: spec[k] for k in ("family", "config", "seq_len", "batch", "padding", "dtype")}}
    try:
        device = torch.device(spec["device"])
        torch.manual_seed(0)
        cfg = bert.BertConfig.preset(spec["config"], hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        base_mem = rss_mb() if device.type == "cpu" else 0.0
        model = _build(variant, cfg, device, spec["family"], spec.get("compile_backend", "inductor")).train()
        row["runs"] = _runs_on(model)
        batches = [b.to(device) for b in _batches(variant, spec, cfg.vocab_size, row["runs"].startswith("flash"))]
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if spec["dtype"] == "bfloat16" else torch.autocast(
            device.type, enabled=False)
        step = _stepper(variant, model, device, amp, spec["family"])
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for i in range(spec["warmup"]):
            step(batches[i % len(batches)])
        sync()
        if not spec["steps"]:  # a warm-up only (bench.precompile): kernels compiled, nothing timed
            return dict(row, status="warm")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row.update(_timed(step, batches, spec["steps"], cfg, sync))
        row["peak_mem_MB"] = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
                              else peak_rss_mb() - base_mem)
    except LeftOut as e:
        row["status"] = f"left out: {e}"
    except Exception as e:  # a variant that cannot run is reported, not fatal to the others
        row.update(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        row["traceback"] = traceback.format_exc(limit=3)
    return row


def _timed(step, batches, steps: int, cfg, sync) -> dict:
    """`steps` timed steps over the batches in turn: throughput over the whole run (real tokens, sequences,
    FLOPs), the median step time, and the spread of real tokens/s from step to step (min, median, max)."""
    times, tokens, seqs, slots, flops, rates = [], 0, 0, 0, 0.0, []
    for i in range(steps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        step(b)
        sync()
        times.append(time.perf_counter() - t0)
        lengths = b.lengths
        tokens, seqs, slots = tokens + sum(lengths), seqs + len(lengths), slots + b.slots
        flops += step_flops(cfg, lengths, b.labelled)
        rates.append(sum(lengths) / times[-1])
    total, rates = sum(times), sorted(rates)
    return dict(status="ok", steps=steps, step_ms=1e3 * sorted(times)[len(times) // 2], tokens_per_s=tokens / total,
                tokens_per_s_min=rates[0], tokens_per_s_median=rates[len(rates) // 2], tokens_per_s_max=rates[-1],
                seqs_per_s=seqs / total, TFLOPs=flops / total / 1e12, padding_share=1 - tokens / slots,
                tokens_per_step=tokens / steps)


def repeated_run(variant: str, spec: dict) -> dict:
    """`variant` run spec["repeats"] times, each in a fresh process, as one row (median_run). A run that does not
    end ok ends the repeats: running again would repeat the failure or the reason it was left out."""
    rows = []
    for _ in range(spec["repeats"]):
        rows.append(in_fresh_process(run_variant, variant, spec))
        if rows[-1].get("status") != "ok":
            break
    return median_run(rows)


def median_run(rows: list[dict]) -> dict:
    """One row for a variant run several times, each in a fresh process: a failed run's row if any failed (what
    went wrong is the news), else the run of median throughput, its spread (tokens_per_s_min/median/max) then over
    the runs instead of over that run's steps. One run: its row as it is."""
    if len(rows) == 1:
        return rows[0]
    failed = next((r for r in rows if r.get("status") != "ok"), None)
    if failed:
        return dict(failed, runs_done=len(rows))
    ranked = sorted(rows, key=lambda r: r["tokens_per_s"])
    median = ranked[len(ranked) // 2]
    return dict(median, repeats=len(rows), tokens_per_s_min=ranked[0]["tokens_per_s"],
                tokens_per_s_median=median["tokens_per_s"], tokens_per_s_max=ranked[-1]["tokens_per_s"])


@contextlib.contextmanager
def environment(changes: dict):
    """os.environ with `changes` (a value of None removes the variable) inside the block, restored after: what
    processes spawned inside it inherit."""
    def put(values):
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in changes}
    put(changes)
    try:
        yield
    finally:
        put(saved)


def in_fresh_process(fn, *args, env: dict | None = None):
    """fn(*args) in a freshly spawned Python process (no allocator, compile-cache or peak-memory state shared),
    with `env` added to its environment. Ctrl-C stops the child at once (rather than waiting for it to finish) and
    reaches the caller, which keeps what finished before."""
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx)
    try:
        with environment(env or {}):  # the child is spawned inside submit and inherits it then
            future = pool.submit(fn, *args)
        return future.result()
    except KeyboardInterrupt:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
