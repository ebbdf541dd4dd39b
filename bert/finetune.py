"""Fine-tuning: `bert-finetune {classify,ner,qa}` / `python -m bert.finetune`.

classify: GLUE-style TSV (sentence or sentence-pair columns plus label), [CLS] pooled -> dropout -> linear;
          accuracy and macro F1.
ner:      CoNLL-2003 files, labels on the first sub-token of each word; entity-level P/R/F1 (seqeval); the
          predictions are written back per word.
qa:       SQuAD v1.1 JSON, question as segment A and passage as segment B in overlapping windows; start and end
          vectors dotted with every token; n-best decoding over windows; exact match and F1.
--train/--eval take local files or a Hugging Face dataset name (glue/sst2, conll2003, squad). --model is a
save_pretrained directory (ours or any HF BERT); a pre-training checkpoint gets a new head, and the log says which
keys were new and which were dropped.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random

import torch

from . import cli
from .cli import add_debug_flag, check_numbers, check_source
from .config import read_json_object
from .metrics import accuracy_and_macro_f1, ner_scores, squad_scores
from .model import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from .optim import linear_schedule, param_groups
from .tasks import (classification_features, decode_answers, ner_features, qa_windows, read_classification,
                    read_conll, read_squad)
from .tokenizer import load_tokenizer, save_tokenizer

logger = logging.getLogger("bert")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert-finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=["classify", "ner", "qa"], help="the task")
    p.add_argument("--model", required=True, help="a save_pretrained directory (ours or a Hugging Face BERT)")
    p.add_argument("--tokenizer", help="tokenizer directory or vocab.txt (default: the --model directory)")
    p.add_argument("--train", help="training data: a file or a Hugging Face dataset name")
    p.add_argument("--eval", help="evaluation data: a file or a Hugging Face dataset name")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the training data (default 2)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (default 3e-5)")
    p.add_argument("--warmup", type=float, default=0.1, help="warm-up share of the steps (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size (default 32)")
    p.add_argument("--eval-batch-size", type=int, default=64, help="evaluation batch size (default 64)")
    p.add_argument("--max-seq-len", type=int, default=128, help="tokens per input, specials included "
                                                                "(default 128; 384 is usual for qa)")
    p.add_argument("--doc-stride", type=int, default=128, help="qa: tokens shared by adjacent windows (default 128)")
    p.add_argument("--max-answer-len", type=int, default=30, help="qa: longest answer in tokens (default 30)")
    p.add_argument("--n-best", type=int, default=20, help="qa: start/end candidates per window (default 20)")
    p.add_argument("--max-train-examples", type=int, help="use only the first N training examples")
    p.add_argument("--max-eval-examples", type=int, help="evaluate only the first N examples")
    p.add_argument("--output-dir", default="runs/finetune", help="fine-tuned model, metrics and predictions")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto", help="hot-op implementation")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(p)
    return p


def validate_args(args) -> None:
    """Everything that can be checked before loading a model or reading data."""
    check_numbers(args, positive=("epochs", "max_steps", "lr", "batch_size", "eval_batch_size", "max_seq_len",
                                  "doc_stride", "max_answer_len", "n_best", "max_train_examples",
                                  "max_eval_examples"),
                  non_negative=("weight_decay",), fractions=("warmup",))
    if not args.train and not args.eval:
        raise ValueError("give --train and/or --eval data")
    if args.task == "qa" and args.doc_stride >= args.max_seq_len:
        raise ValueError(f"--doc-stride {args.doc_stride} must be smaller than --max-seq-len {args.max_seq_len}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"--model {args.model}: no config.json there (expected a save_pretrained directory)")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no such file or directory")
    check_source("--train", args.train)
    check_source("--eval", args.eval)


def pad_batch(features: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    width = -(-max(len(f["input_ids"]) for f in features) // 8) * 8
    out = {"input_ids": torch.full((len(features), width), pad_id, dtype=torch.long),
           "token_type_ids": torch.zeros((len(features), width), dtype=torch.long),
           "attention_mask": torch.zeros((len(features), width), dtype=torch.long)}
    for r, f in enumerate(features):
        n = len(f["input_ids"])
        out["input_ids"][r, :n] = torch.as_tensor(f["input_ids"])
        out["token_type_ids"][r, :n] = torch.as_tensor(f["token_type_ids"])
        out["attention_mask"][r, :n] = 1
    if "labels" in features[0]:
        if isinstance(features[0]["labels"], list):
            out["labels"] = torch.full((len(features), width), -100, dtype=torch.long)
            for r, f in enumerate(features):
                out["labels"][r, :len(f["labels"])] = torch.as_tensor(f["labels"])
        else:
            out["labels"] = torch.tensor([f["labels"] for f in features])
    for key in ("start_positions", "end_positions"):
        if key in features[0]:
            out[key] = torch.tensor([f[key] for f in features])
    return out


class Task:
    """What differs between the tasks: reading, features, the model class and evaluation."""

    def __init__(self, name: str, args, tokenizer):
        self.name, self.args, self.tok = name, args, tokenizer
        self.model_cls = {"classify": BertForSequenceClassification, "ner": BertForTokenClassification,
                          "qa": BertForQuestionAnswering}[name]
        self.reader = {"classify": read_classification, "ner": read_conll, "qa": read_squad}[name]

    def read(self, source, split, limit):
        data = self.reader(source, split)
        if not data:
            raise ValueError(f"{source}: no {'training' if split == 'train' else 'evaluation'} examples")
        return data[:limit] if limit else data

    def labels_from(self, train_data, model_config: dict) -> dict[int, str] | None:
        if self.name == "qa":
            return None
        found = {e.label for e in train_data} if self.name == "classify" else {t for s in train_data for t in s.tags}
        known = {int(k): v for k, v in (model_config.get("id2label") or {}).items()}
        if known and found <= set(known.values()) and not set(known.values()) <= {f"LABEL_{i}" for i in known}:
            return known
        if self.name == "classify":
            ordered = sorted(found, key=lambda x: (not x.lstrip("-").isdigit(), int(x) if x.lstrip("-").isdigit()
                                                   else 0, x))
        else:  # O first, then entity types with B- before I-
            ordered = sorted(found, key=lambda t: (t != "O", t[2:], t[:2]))
        return dict(enumerate(ordered))

    def features(self, data, label2id, train: bool):
        a = self.args
        if self.name == "classify":
            return classification_features(data, self.tok, label2id, a.max_seq_len)
        if self.name == "ner":
            return ner_features(data, self.tok, label2id, a.max_seq_len)
        windows = qa_windows(data, self.tok, a.max_seq_len, a.doc_stride)
        feats = [{"input_ids": w.input_ids, "token_type_ids": w.token_type_ids} for w in windows]
        if train:
            for f, w in zip(feats, windows):
                f.update(start_positions=w.start_position, end_positions=w.end_position)
        return feats, windows

    @torch.no_grad()
    def evaluate(self, model, data, feats, device, id2label, windows=None):
        """(metrics, per-example predictions), in batches under no_grad."""
        model.eval()
        outs = []
        for i in range(0, len(feats), self.args.eval_batch_size):
            batch = pad_batch(feats[i:i + self.args.eval_batch_size])
            batch.pop("labels", None)
            out = model(**{k: v.to(device) for k, v in batch.items()})
            if self.name == "qa":
                outs += list(zip(out.start_logits.float().cpu(), out.end_logits.float().cpu()))
            else:
                outs += list(out.logits.float().argmax(-1).cpu())
        model.train()
        if self.name == "classify":
            preds = [id2label[int(p)] for p in outs]
            pred_ids = [int(p) for p in outs]
            gold = [f["labels"] for f in feats]
            return accuracy_and_macro_f1(pred_ids, gold), preds
        if self.name == "ner":
            predicted = []
            for s, f, p in zip(data, feats, outs):
                tags = [id2label[int(p[t])] for t in f["first_token"]]
                predicted.append(tags + ["O"] * (len(s.words) - len(tags)))  # words cut off by max_seq_len
            return ner_scores([s.tags for s in data], predicted), predicted
        answers = decode_answers(data, windows, [s for s, _ in outs], [e for _, e in outs], self.args.n_best,
                                 self.args.max_answer_len)
        return squad_scores(answers, {ex.qid: ex.answers for ex in data if ex.answers}), answers


def write_predictions(task: Task, data, predictions, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        if task.name == "ner":
            for s, tags in zip(data, predictions):
                f.writelines(f"{w} {g} {p}\n" for w, g, p in zip(s.words, s.tags, tags))
                f.write("\n")
        elif task.name == "qa":
            json.dump(predictions, f, indent=1, ensure_ascii=False)
        else:
            f.write("prediction\tlabel\n")
            f.writelines(f"{p}\t{e.label}\n" for p, e in zip(predictions, data))


def run(args) -> dict:
    """Fine-tune and evaluate; returns the metrics. Used by the CLI and by tests."""
    validate_args(args)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    task = Task(args.task, args, tokenizer)
    train_data = task.read(args.train, "train", args.max_train_examples) if args.train else []
    eval_data = task.read(args.eval, "eval", args.max_eval_examples) if args.eval else []
    model_config = read_json_object(os.path.join(args.model, "config.json"))
    id2label = task.labels_from(train_data or eval_data, model_config)
    overrides = {"backend": args.backend}
    if id2label is not None:
        overrides["id2label"] = id2label
    model = task.model_cls.from_pretrained(args.model, **overrides).to(device)
    label2id = {v: k for k, v in id2label.items()} if id2label else None
    os.makedirs(args.output_dir, exist_ok=True)

    if train_data:
        feats = task.features(train_data, label2id, train=True)
        feats = feats[0] if task.name == "qa" else feats
        steps_per_epoch = math.ceil(len(feats) / args.batch_size)
        total = args.max_steps or max(1, int(steps_per_epoch * args.epochs))
        opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_schedule(int(args.warmup * total), total))
        amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"fine-tuning ({task.name})", disable=args.no_progress, dynamic_ncols=True)
        rng = random.Random(args.seed)
        step, losses = 0, []
        model.train()
        while step < total:
            order = list(range(len(feats)))
            rng.shuffle(order)
            for i in range(0, len(order), args.batch_size):
                batch = pad_batch([feats[j] for j in order[i:i + args.batch_size]])
                with amp:
                    loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().item())
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
                if step >= total:
                    break
        bar.close()
        train_metrics = {"train_loss_first": losses[0], "train_loss_last20": sum(losses[-20:]) / len(losses[-20:]),
                         "train_steps": step}
    else:
        train_metrics = {}

    metrics = dict(train_metrics)
    if eval_data:
        feats = task.features(eval_data, label2id, train=False)
        windows = None
        if task.name == "qa":
            feats, windows = feats
        scores, predictions = task.evaluate(model, eval_data, feats, device, id2label, windows)
        print("evaluation: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items() if isinstance(v, (int, float))),
              flush=True)
        metrics.update({f"eval_{k}": v for k, v in scores.items()}, eval_examples=len(eval_data))
        write_predictions(task, eval_data, predictions, os.path.join(args.output_dir, "predictions.txt"
                                                                     if task.name != "qa" else "predictions.json"))
    model.save_pretrained(args.output_dir)
    save_tokenizer(tokenizer, args.output_dir)
    with open(os.path.join(args.output_dir, "metrics.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=2)
    print(f"saved to {args.output_dir}", flush=True)
    return metrics


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)

    def body():
        print(json.dumps(run(args), indent=2))
        return 0

    return cli.run("bert-finetune", body, args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
