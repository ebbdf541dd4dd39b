"""Pre-training data, one stage a module, each importing only from the stages before it:

    text.py        corpus files -> documents of paragraphs -> sentences
    tokenizer.py   WordPiece: train, load, save (tokenizers)
    corpus.py      documents -> the tokenised corpus, memory-mapped and cached by content
    instances.py   NSP instances as spans of the corpus, drawn without touching a token
    masking.py     the special ids and MLM masking (15% chosen; 80% [MASK], 10% random, 10% kept)
    batch.py       the batch types: the packed micro-batch and its token layout, checked in one place
    packing.py     instances -> rows of a fixed token budget -> packed micro-batches
    pipeline.py    an epoch: shards planned ahead, micro-batches collated by the DataLoader's workers
"""
