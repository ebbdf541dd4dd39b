"""What a transformers user runs instead of this project, today: which attention each transformers variant of the
end-to-end suite takes on a device, and whether the installed transformers keeps padding-free sequences apart.

Padding-free training (DataCollatorWithFlattening: one row, position ids restarting per sequence) is exact only
where the attention keeps each sequence to itself. Flash attention has read the restarts from the position ids for
long; SDPA, eager and flex attention do so from transformers 5.25 on, and before that attend across the whole row.
That is decided here by running the installed code (`flattening_refusal`), not by its version number: a baseline
that lets sequences see each other would be fast and wrong, so its row is left out with the reason.
"""
from __future__ import annotations

# Most recent first: the flash attention transformers runs where its package is installed (no hub download).
FLASH = ("flash_attention_4", "flash_attention_3", "flash_attention_2")


class LeftOut(Exception):
    """A variant that does not run here, for the reason given (its row's status: "left out: <reason>")."""


def installed_flash() -> tuple[str | None, list[str]]:
    """(the first of FLASH that transformers finds installed for this machine's GPU or None, the ones it does not)."""
    from transformers.utils import import_utils

    found = [name for name in FLASH
             if getattr(import_utils, f"is_{name.replace('attention', 'attn')}_available", lambda: False)()]
    return (found[0] if found else None), [name for name in FLASH if name not in found]


def attention_of(variant: str, device) -> str:
    """The attn_implementation a transformers variant runs: SDPA, flex attention ("-flex") or the newest flash
    attention installed ("-fa"; LeftOut where none is or on a CPU)."""
    if "-fa" in variant:
        if device.type != "cuda":
            raise LeftOut("flash attention needs a CUDA GPU")
        name, missing = installed_flash()
        if name is None:
            raise LeftOut(f"none of {', '.join(missing)} is installed")
        return name
    return "flex_attention" if "-flex" in variant else "sdpa"


def flattening_refusal(attention: str, device) -> str | None:
    """Why the installed transformers' BertForMaskedLM with `attention` is not exact on flattened batches (None
    where it is): a tiny model's outputs on a sequence alone against the same sequence flattened after another.
    Attention weights drawn wide (initializer_range 0.5) make sequences that see each other differ by far more than
    rounding, in float32 and in the half precision flash attention needs."""
    import torch
    import transformers

    half = attention.startswith("flash")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, initializer_range=0.5, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):  # the benchmark's own model is drawn after this, from the same seed
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(cfg).to(device, torch.bfloat16 if half else torch.float32).eval()
        first, second = torch.randint(4, 64, (1, 7)).to(device), torch.randint(4, 64, (1, 5)).to(device)
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None].to(device)
    with torch.no_grad():
        alone = model(input_ids=first).logits.float()
        flat = model(input_ids=torch.cat([first, second], 1), position_ids=position_ids).logits[:, :7].float()
    error = ((flat - alone).abs().max() / alone.abs().max()).item()
    if error <= (2e-2 if half else 1e-4):
        return None
    return (f"transformers {transformers.__version__} with attn_implementation={attention!r} lets flattened sequences "
            f"attend to each other (relative difference {error:.2g}; transformers keeps them apart from 5.25 on)")
