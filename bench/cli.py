"""`bert-bench` / `python -m bertfuse.bench`: this project against baseline PyTorch, end to end and kernel by kernel.

With no arguments it runs a quick benchmark on a built-in default: synthetic batches whose lengths follow
tokenised Wikipedia paragraphs (bench.lengths), BERT-base on a GPU or BERT-mini on a CPU.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import sys
from typing import NamedTuple

import numpy as np
import torch

from bertfuse.bert.common.files import atomic_write
from bertfuse.bert.common.commands import add_debug_flag, add_flags, check_flags, flag

from . import e2e, encode, precompile, qa
from . import kernel_suite
from .lengths import sample_lengths
from .peaks import measure_peaks
from .report import STEP_COLUMNS, add_speedups, by_measure, e2e_table, markdown, plot, write_csv


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1] for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        name = f"cpu {name}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# The command's options, declared once (bert.common.commands.flag): the parser and the number checks come from them.
OPTIONS = (
    flag("--suite", choices=["all", "e2e", "kernels", "encode", "qa", "data", "pretrain"], default="all",
         help="what to run (default: all = e2e and kernels; the kernel suite needs a GPU, except the "
              "MLM-loss table; encode: forward-only inference of Hugging Face models, eager, compiled "
              "and fused; qa: a question-answering fine-tuning step on SQuAD-shaped padded batches, "
              "transformers unfused and fused; data: the pre-training input pipeline, stage by stage, on the CPU; "
              "pretrain: nothing measured, only --pretrain-runs read into the report)"),
    flag("--pretrain-runs", nargs="+", metavar="RUN",
         help="bert-pretrain output directories whose summary.json (steps, sequences, tokens, training seconds, "
              "time to --target-mlm-accuracy) and held-out accuracy against tokens join the report: pretrain.csv, "
              "pretrain.png"),
    flag("--corpus", help="--suite data: the corpus (any bert-pretrain --data source; default: a "
                          "synthetic ~10 MB corpus generated in the output directory)"),
    flag("--scale", type=int, nargs="+", default=[1], metavar="N",
         help="--suite data: the corpus replicated N times, documents shuffled; several scales run one "
              "after another (default 1)"),
    flag("--num-proc", type=int, check="positive", default=None,
         help="--suite data: processes that tokenise and plan (default: the CPUs available)"),
    flag("--families", nargs="+", choices=["bert", "roberta"],
         help="end-to-end model families: roberta adds RobertaForMaskedLM, eager, compiled and fused, at "
              "the first shape (default: bert; bert roberta with --full on a GPU)"),
    flag("--encode-models", nargs="+", choices=list(encode.SHAPES),
         help="model shapes of the encode suite (default: bert-base minilm roberta-base on a GPU, minilm "
              "on a CPU)"),
    flag("--config", nargs="+", choices=["tiny", "mini", "base", "large"],
         help="model sizes for the end-to-end suite (default: base [quick] or base large [full] on a GPU, "
              "mini on a CPU)"),
    flag("--seq-len", type=int, nargs="+", help="sequence lengths (default: 128 [quick] or 128 512 on a "
                                                "GPU, 128 on a CPU)"),
    flag("--batch", type=int, check="positive",
         help="sequences per step (default: 256 at seq 128 and 64 at seq 512 on a GPU, halved for large; 32 on a CPU)"),
    flag("--padding", default="wiki",
         help="'wiki' (lengths of tokenised Wikipedia paragraphs, the default) or a padding fraction in "
              "[0, 0.5]"),
    flag("--padding-sweep", action="store_true",
         help="also run ours and transformers eager at padding 0, 0.25 and 0.5 (always on in --full)"),
    flag("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on a GPU, float32 on a CPU"),
    flag("--variants", nargs="+", choices=list(e2e.VARIANTS), help="end-to-end implementations to run"),
    flag("--quick", dest="full", action="store_false", default=False, group="mode",
         help="few shapes and steps (default)"),
    flag("--full", dest="full", action="store_true", default=False, group="mode", help="all shapes, more steps"),
    flag("--steps", type=int, check="positive",
         help="timed steps per end-to-end run (default: 10 quick on a GPU, 5 on a CPU, 30 full)"),
    flag("--repeats", type=int, check="positive", default=1,
         help="runs of each end-to-end variant, each in a fresh process (default 1): with more, a row is the run "
              "of median throughput and its spread is over the runs, not over one run's steps"),
    flag("--output-dir", help="where to write JSON, CSV and plots (default: "
                              "./bert-bench-results/<device>/, outside the source tree)"),
    flag("--device", help="cuda or cpu (default: cuda when available)"),
    flag("--precompile", action=argparse.BooleanOptionalAction, default=None,
         help="compile this project's kernels for the run in parallel worker processes before timing "
              "(default: on with a GPU)"),
    flag("--dry-run", action="store_true",
         help="print the plan (each suite's rows; the transformers release and whether its padding-free rows "
              "can run) and stop, measuring nothing; with --device cuda it plans a GPU's run on any machine"),
    flag("--packing-corpus", metavar="PATH",
         help="also measure the padding share of this corpus's pre-training instances padded and packed, "
              "at 128 and 512 (e.g. WikiText-2's train.txt; bert-base-uncased vocabulary)"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bert-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, OPTIONS)
    add_debug_flag(p)
    return p.parse_args(argv)


def default_variants(cuda: bool, full: bool = False) -> list[str]:
    """On a CPU the quick run leaves out torch.compile (minutes of compilation for a number --full still gives).
    On a GPU the order is the order of importance: a run cut at a time limit (the GPU check's) has the headline
    comparisons first, ours against transformers padded, padding-free with flex and flash attention, compiled."""
    if cuda:
        names = ["ours-triton", "hf-eager", "hf-compile", "ours-mlm", "ours-mlm-packed", "hf-mlm-eager", "hf-flat",
                 "hf-flat-flex", "hf-flat-fa", "hf-flat-compile", "hf-flat-flex-compile", "hf-mlm-compile",
                 "ours-packed", "ours-packed-graphs", "ours-packed-compile", "ours-torch"]
    else:
        names = ["hf-eager", "hf-compile", "ours-torch", "ours-packed", "ours-packed-compile", "hf-mlm-eager",
                 "hf-mlm-compile", "hf-flat", "hf-flat-compile", "ours-mlm", "ours-mlm-packed"]
        names = [n for n in names if full or n not in e2e.COMPILED]
    try:
        import bertfuse.bert.hf  # noqa: F401  (the drop-in fused layers)

        if cuda:
            names.append("hf-fused")
    except ImportError:
        pass
    return names


def e2e_specs(args, cuda: bool):
    configs = args.config or (["base", "large"] if cuda and args.full else ["base"] if cuda else ["mini"])
    seq_lens = args.seq_len or ([128, 512] if cuda and args.full else [128])
    for config in configs:
        for seq_len in seq_lens:
            batch = args.batch or ((256 if seq_len <= 128 else 64) // (2 if config == "large" else 1) if cuda else 32)
            yield {"family": "bert", "config": config, "seq_len": seq_len, "batch": batch,
                   "padding": args.padding,
                   "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "device": "cuda" if cuda else "cpu",
                   "warmup": 3 if cuda or args.full else 2,
                   "steps": args.steps or (30 if args.full else 10 if cuda else 5), "repeats": args.repeats}


class Plan(NamedTuple):
    variants: list
    specs: list
    kernels: bool
    e2e: bool
    encode: list       # encode-suite specs (empty unless --suite encode)
    data: bool = False  # the input-pipeline suite
    qa: tuple = ()     # qa-suite specs (empty unless --suite qa)
    pretrain: tuple = ()  # bert-pretrain run directories read into the report


def make_plan(args, cuda: bool) -> Plan:
    variants = args.variants or default_variants(cuda, args.full)
    variants = [v for v in variants if cuda or v not in ("ours-triton", "hf-fused", "ours-packed-graphs")]
    specs = list(e2e_specs(args, cuda))
    if args.padding_sweep or args.full:
        specs += [dict(s, padding=str(p)) for s in specs[:1] for p in (0.0, 0.25, 0.5)]
    if "roberta" in (args.families or (["roberta"] if cuda and args.full else [])):
        specs += [dict(s, family="roberta") for s in specs[:1]]  # the fused RoBERTa against its own baselines
    encode_specs = list(encode.specs(cuda, args.full, args.seq_len[0] if args.seq_len else None,
                                     [args.batch] if args.batch else None, args.encode_models)) \
        if args.suite == "encode" else []
    qa_specs = tuple(qa.specs(cuda, args.full, args.batch, None)) if args.suite == "qa" else ()
    return Plan(variants, specs, args.suite in ("all", "kernels"), args.suite in ("all", "e2e"), encode_specs,
                args.suite == "data", qa_specs, tuple(args.pretrain_runs or ()))


def describe(plan: Plan, cuda: bool, full: bool) -> str:
    """What the run will do and roughly how long it takes (the estimate is a rule of thumb, not a measurement)."""
    runs = sum(s["repeats"] for s in plan.specs for v in plan.variants if _runs(v, s, plan)) if plan.e2e else 0
    lines = []
    if plan.e2e:
        shapes = sorted({f"{s['config']} s{s['seq_len']} b{s['batch']}" for s in plan.specs})
        lines.append(f"end to end: {', '.join(plan.variants)} on {', '.join(shapes)}, {plan.specs[0]['steps']} timed "
                     f"steps each, {runs} runs in fresh processes")
    if plan.kernels:
        lines.append(_kernel_plan(cuda))
    if plan.encode:
        shapes = sorted({f"{s['model']} b{s['batch']}" for s in plan.encode})
        lines.append(f"encode: {', '.join(plan.encode[0]['variants'])} on {', '.join(shapes)}")
        runs += sum(len(s["variants"]) for s in plan.encode)
    if plan.qa:
        shapes = sorted({f"{s['model']} s{s['seq_len']} b{s['batch']}" for s in plan.qa})
        lines.append(f"qa: {', '.join(plan.qa[0]['variants'])} on {', '.join(shapes)}")
        runs += sum(len(s["variants"]) for s in plan.qa)
    if plan.data:
        lines.append("data: tokenise, instances, packing, collation and time to the first batch, each stage in a "
                     "fresh process (minutes per 100 MB of text tokenised)")
    if plan.pretrain:
        lines.append(f"pretrain: the summaries of {len(plan.pretrain)} bert-pretrain run(s) read, nothing measured")
    if not (runs or plan.kernels):  # the data suite or the runs alone: nothing timed here
        return "Plan: " + "; ".join(lines) + ".\n"
    per_run = (60 if full else 25) if cuda else (40 if full else 20)
    minutes = (runs * per_run + (120 if plan.kernels else 0)) / 60
    more = "" if full else "; --full adds more shapes, torch.compile variants on a CPU, the padding sweep and steps"
    return "Plan: " + "; ".join(lines) + f". Roughly {minutes:.0f}-{2 * minutes:.0f} min here{more}.\n"


def padding_free_plan(plan: Plan, device) -> str:
    """The transformers padding-free rows of the plan, the release they will run on and whether it keeps flattened
    sequences apart (checked on this machine's CPU with SDPA: the masks come from the same code on every device);
    which flash attention hf-flat-fa would take."""
    flat = [v for v in plan.variants if v in e2e.FLAT] if plan.e2e else []
    if not flat:
        return ""
    from .baselines import attention_of, flattening_refusal, LeftOut

    def attention(v):
        if "-fa" in v and device.type == "cuda" and not torch.cuda.is_available():  # planned here for a GPU
            return "the newest flash attention the GPU machine has installed, else left out"
        try:
            return attention_of(v, device)
        except LeftOut as e:
            return f"left out: {e}"

    try:
        release = importlib.metadata.version("transformers")
        why = flattening_refusal("sdpa", torch.device("cpu"))
    except Exception as e:  # no transformers, or one that does not run
        return f"Padding-free rows ({', '.join(flat)}): transformers does not run here ({type(e).__name__}: {e}).\n"
    rows = ", ".join(f"{v} ({attention(v)})" for v in flat)
    verdict = "it keeps flattened sequences apart" if why is None else f"they will be left out: {why}"
    return f"Padding-free rows on transformers {release}: {rows}; {verdict}.{_flash_line(device)}\n"


def _flash_line(device) -> str:
    """Which flash attention hf-flat-fa takes and which are missing, on a GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    from .baselines import installed_flash

    found, missing = installed_flash()
    return f" Flash attention: {found or 'none'} installed; not installed: {', '.join(missing) or 'none'}."


def _kernel_plan(cuda: bool) -> str:
    try:
        from bertfuse.bench.ops import records
    except ImportError as e:
        return f"kernels: none ({e})"
    if cuda:
        return f"kernels: {', '.join(r.name for r in records())}, each against its peers"
    memory = [r.name for r in records() if r.bench_shapes.cpu is not None]
    return (f"kernels: the memory and float64-error table of {', '.join(memory)} (ours and the Triton peers in "
            "Triton's interpreter, which times nothing: kernel times need a GPU)")


def _runs(variant: str, spec: dict, plan: Plan) -> bool:
    """Padding-sweep specs run only the variants whose curve the plot shows; RoBERTa only the transformers ones."""
    if spec["family"] == "roberta":
        return variant in ("hf-eager", "hf-compile", "hf-fused")
    return spec["padding"] == plan.specs[0]["padding"] or variant in ("hf-eager", "ours-torch", "ours-triton")


def run_e2e(plan: Plan, peaks: dict, cuda: bool, results: dict, save) -> None:
    if not cuda:
        print("CPU mode: this measures the algorithmic savings (unpadded encoder, MLM head on labelled tokens "
              "only), not Triton, which needs a GPU.\n")
    for spec in plan.specs:
        for variant in (v for v in plan.variants if _runs(v, spec, plan)):
            row = e2e.repeated_run(variant, spec)
            tail = f"{row['tokens_per_s']:,.0f} tok/s" if row.get("status") == "ok" else row["status"]
            family = "" if spec["family"] == "bert" else f"{spec['family']} "
            print(f"  {variant:20s} {family}{spec['config']} s{spec['seq_len']} b{spec['batch']} "
                  f"pad={spec['padding']}: {tail}", flush=True)
            if row.get("status") == "ok":
                row["MFU"] = row["TFLOPs"] / peaks["matmul_TFLOPs"]
            results["e2e"].append(row)
            save()
    print("\n## End-to-end pre-training step (forward + backward + AdamW)\n")
    print(e2e_table(results["e2e"], results["meta"]))
    print("\nMFU: model FLOPs on real tokens (MLM head on labelled tokens) over the measured matmul peak; "
          "peak_mem_MB on a CPU is the process's peak RSS growth.\n")


def run_encode(plan: Plan, results: dict, save) -> None:
    for spec in plan.encode:
        for variant in spec["variants"]:
            row = e2e.in_fresh_process(encode.run_variant, variant, spec)
            tail = f"{row['sentences_per_s']:,.1f} sentences/s" if row.get("status") == "ok" else row["status"]
            print(f"  {variant:10s} {spec['model']} b{spec['batch']}: {tail}", flush=True)
            results["encode"].append(row)
            save()
    add_speedups(results["encode"], keys=("model", "batch", "seq_len", "dtype"), metric="sentences_per_s")
    print("\n## Encoding (forward only, no gradients)\n")
    print(markdown(results["encode"], ["variant", "model", "batch", "seq_len", "dtype", "latency_ms",
                                       "sentences_per_s", "tokens_per_s", "speedup_vs_hf-eager",
                                       "speedup_vs_hf-compile", "status"]))


def run_qa(plan: Plan, results: dict, save) -> None:
    for spec in plan.qa:
        for variant in spec["variants"]:
            row = e2e.in_fresh_process(qa.run_variant, variant, spec)
            tail = f"{row['tokens_per_s']:,.0f} real tokens/s" if row.get("tokens_per_s") else row["status"]
            print(f"  {variant:14s} {spec['model']} s{spec['seq_len']} b{spec['batch']}: {tail}", flush=True)
            results["qa"].append(row)
            save()
    add_speedups(results["qa"], keys=("model", "batch", "seq_len", "dtype"), metric="tokens_per_s")
    print("\n## Question answering, one fine-tuning step (forward + backward + AdamW) on SQuAD-shaped padded "
          "batches\n")
    print(markdown(results["qa"], ["variant", "model", "batch", "seq_len", "dtype", "padding", "step_ms",
                                   "tokens_per_s", "speedup_vs_hf-eager", "status"]))


def run_kernels(args, peaks: dict, device, results: dict, save) -> None:
    try:
        from bertfuse.bench.ops import records
    except ImportError as e:  # no triton on this platform
        print(f"The kernel suite needs the kernels package, which does not import here: {e}\n")
        return
    rows = results["kernels"]

    def keep(row):  # saved as each row is measured: a run cut short keeps every finished row
        rows.append(row)
        save()

    gpu_only = []
    for record in records():
        if device.type != "cuda" and record.bench_shapes.cpu is None:
            gpu_only.append(record.name)
            continue
        kernel_suite.rows(record, peaks, not args.full, device, on_row=keep)
    print("## Kernels\n")
    if device.type != "cuda":
        rest = f", and so do the rows of {', '.join(gpu_only)}, which have no CPU table" if gpu_only else ""
        print("On a CPU the Triton kernels run in Triton's interpreter, whose speed says nothing of theirs: this "
              f"table gives each implementation's extra memory and its error to float64, and no times. Kernel times "
              f"need a GPU{rest}.\n")
        print(markdown(rows, ["kernel", "shape", "impl", "peak_extra_MB", "rel_err_fp64", "status"]))
        return
    ops, steps = by_measure(rows)
    print(markdown(ops, ["kernel", "shape", "impl", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_bwd_GBps",
                         "copy_share", "fwd_TFLOPs", "bwd_TFLOPs", "peak_extra_MB", "rel_err_fp64", "status"]))
    if steps:
        print("\n## Optimizer steps\n\nOne step over the model's parameters; bandwidth from the bytes the step must "
              "move; peak_extra_MB: the first step's, the optimizer's state included.\n")
        print(markdown(steps, STEP_COLUMNS))


def run_data(args, results: dict, save) -> None:
    from bertfuse.bert.common.workers import available_cpus

    from . import data

    num_proc = args.num_proc or available_cpus()
    scales = ", ".join(f"x{n}" for n in args.scale)
    print(f"## Input pipeline: {args.corpus or 'a synthetic corpus'} {scales}, {num_proc} processes\n")
    for scale in args.scale:
        results["data"] += data.measure(args.corpus, scale, num_proc, args.output_dir, e2e.in_fresh_process)
        save()
    print("\n" + data.table(results["data"]) + "\n\n" + data.workers_needed(results["data"]))


def read_pretrain_runs(plan: Plan, results: dict, out_dir: str, save) -> set:
    """--pretrain-runs: each run's summary as a row of the report, and its accuracy against tokens as a plot."""
    if not plan.pretrain:
        return set()
    from . import pretrain_runs

    print("\n## Pre-training runs\n")
    results["pretrain"] = pretrain_runs.read_runs(plan.pretrain)
    print(pretrain_runs.table(results["pretrain"]))
    save()
    return {"pretrain.png"} if pretrain_runs.plot(results["pretrain"], os.path.join(out_dir, "pretrain.png")) \
        else set()


def run_metadata(device, argv) -> dict:
    cuda = device.type == "cuda"
    command = "bert-bench " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"device": torch.cuda.get_device_name(device) if cuda else device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command.strip(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for package in ("transformers", "triton"):
        try:
            meta[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return meta


def main(argv=None) -> int:
    from bertfuse.bert.common.commands import run

    args = parse_args(argv)
    return run("bert-bench", lambda: bench(args, argv), args.debug)


MAX_SEQ_LEN = 512  # the position embeddings of every model the suites build


def check_args(args) -> torch.device:
    """Every option checked before any work, each error one line naming the flag; returns the device."""
    if args.packing_corpus and not os.path.exists(args.packing_corpus):
        raise FileNotFoundError(f"--packing-corpus {args.packing_corpus}: no such file or directory")
    if args.padding != "wiki":
        try:
            sample_lengths(1, 8, args.padding, np.random.default_rng(0))
        except ValueError:
            raise ValueError(f"--padding {args.padding}: use 'wiki' or a padding fraction in [0, 0.5]") from None
    check_flags(args, OPTIONS)
    if min(args.scale) < 1:
        raise ValueError(f"--scale must be positive, got {min(args.scale)}")
    data_only = [flag for flag, given in (("--corpus", args.corpus), ("--scale", args.scale != [1]),
                                          ("--num-proc", args.num_proc)) if given]
    if data_only and args.suite != "data":
        raise ValueError(f"{data_only[0]} applies to --suite data, not --suite {args.suite}")
    if args.corpus and not args.corpus.startswith("hf:") and not os.path.exists(args.corpus):
        raise FileNotFoundError(f"--corpus {args.corpus}: no such file or directory")
    for n in args.seq_len or []:
        if not 8 <= n <= MAX_SEQ_LEN:
            raise ValueError(f"--seq-len {n}: must be in [8, {MAX_SEQ_LEN}] (the models have {MAX_SEQ_LEN} positions)")
    if args.families and args.suite not in ("all", "e2e"):
        raise ValueError(f"--families applies to the end-to-end suite, not --suite {args.suite}")
    if args.encode_models and args.suite != "encode":
        raise ValueError(f"--encode-models applies to --suite encode, not --suite {args.suite}")
    if args.suite == "pretrain" and not args.pretrain_runs:
        raise ValueError("--suite pretrain reads bert-pretrain runs: give --pretrain-runs RUN...")
    for run in args.pretrain_runs or ():
        if not os.path.isfile(os.path.join(run, "summary.json")):
            raise FileNotFoundError(f"--pretrain-runs {run}: no summary.json (a bert-pretrain run writes it when it "
                                    "ends)")
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"--device {name}: use cuda (or cuda:N) or cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise ValueError(f"--device {name}: no CUDA device is available here (torch {torch.__version__})")
    return device


OUTPUTS = ("results.json", "e2e.csv", "kernels.csv", "encode.csv", "qa.csv", "packing.csv", "data.csv",
           "pretrain.csv", "speedup.png", "padding.png", "pretrain.png")
TABLES = ("e2e", "kernels", "encode", "qa", "packing", "data", "pretrain")


def remove_stale(out_dir: str, written: set) -> None:
    """Outputs of an earlier run in the same directory that this run did not write: removed, so that the folder
    holds one run's files, all consistent with its results.json."""
    for name in OUTPUTS:
        path = os.path.join(out_dir, name)
        if name not in written and os.path.exists(path):
            os.remove(path)


def bench(args, argv) -> int:
    device = check_args(args)
    cuda = device.type == "cuda"
    if args.dry_run:
        print(describe(make_plan(args, cuda), cuda, args.full) + padding_free_plan(make_plan(args, cuda), device))
        return 0
    out_dir = args.output_dir = args.output_dir or os.path.join("bert-bench-results", device_name(device))
    os.makedirs(out_dir, exist_ok=True)
    meta = run_metadata(device, argv)
    plan = make_plan(args, cuda)
    print(f"# bert-bench on {meta['device']} ({meta['date']})\n")
    meta["padding_free"] = padding_free_plan(plan, device).strip()
    print(describe(plan, cuda, args.full) + (meta["padding_free"] + "\n" if meta["padding_free"] else ""))
    results, written = {"meta": meta, **{name: [] for name in TABLES}}, set()

    def save():
        """Written after every row, so a run cut short (a time limit, Ctrl-C) still leaves what it measured."""
        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(results, f, indent=2, default=str)

        atomic_write(os.path.join(out_dir, "results.json"), write)
        written.add("results.json")
        for name in TABLES:
            if write_csv(os.path.join(out_dir, f"{name}.csv"), results[name]):
                written.add(f"{name}.csv")

    try:
        peaks = {}
        if not plan.data and args.suite != "pretrain":  # neither rate is a fraction of a device peak
            meta["peaks"] = peaks = measure_peaks(device)
            print(f"Measured peaks: copy {peaks['copy_GBps']:.0f} GB/s, {peaks['matmul_dtype']} matmul "
                  f"{peaks['matmul_TFLOPs']:.2f} TFLOP/s\n")
        run_suites(args, plan, peaks, device, results, save)
        written |= read_pretrain_runs(plan, results, out_dir, save)
    except KeyboardInterrupt:
        save()
        written |= set(plot(results["e2e"], out_dir, meta))
        remove_stale(out_dir, written)
        done = sum(len(results[k]) for k in TABLES)
        print(f"\nInterrupted: wrote {', '.join(sorted(written))} to {os.path.abspath(out_dir)} with the {done} "
              "row(s) that finished", file=sys.stderr)
        return 130
    written |= set(plot(results["e2e"], out_dir, meta))
    remove_stale(out_dir, written)
    print(f"\nWrote {', '.join(sorted(written))} to {os.path.abspath(out_dir)}")
    return 0


def run_suites(args, plan: Plan, peaks: dict, device, results: dict, save) -> None:
    cuda = device.type == "cuda"
    if args.precompile if args.precompile is not None else cuda:
        from bertfuse.bench.ops import records

        suites = [r.name for r in records()] if cuda else []
        precompile.run(precompile.jobs(suites if plan.kernels else [], plan.variants if cuda and plan.e2e else [],
                                       list({(s["config"], s["seq_len"]): s for s in plan.specs}.values()),
                                       not args.full, str(device)))
    if plan.e2e:
        run_e2e(plan, peaks, cuda, results, save)
    if plan.kernels:
        run_kernels(args, peaks, device, results, save)
    if plan.encode:
        run_encode(plan, results, save)
    if plan.qa:
        run_qa(plan, results, save)
    if args.suite == "data":
        run_data(args, results, save)
    if args.packing_corpus:
        from . import packing

        print(f"\n## Padding share, padded and packed: {args.packing_corpus}\n")
        results["packing"] = packing.measure(args.packing_corpus)
        print(packing.table(results["packing"]))
    save()
