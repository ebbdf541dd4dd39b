"""The trainer's settings, and its command-line options declared once.

A trainer option is one field of `Settings` declared with `option(...)`: its default, the help of its flag, the
check made before any work ("positive" or "non_negative"), and whether --resume compares it with the checkpoint's.
Both commands' "training" argument group (`add_arguments`, with each command's own defaults), the checks
(`check_arguments`), the settings built from the parsed flags (`from_arguments`) and the trainer options --resume
compares (`resumed`) are derived from those declarations; a command declares only its own options.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from bertfuse.bert.common.commands import add_flags, check_flags, flag, resumed
from bertfuse.bert.train.distributed import DIST_TIMEOUT_MINUTES


def option(default, help: str, *, check: str | None = None, resumed: bool = False, flags: tuple = (), **kwargs):
    """A Settings field that is a trainer option: its flag (bert.common.commands.Flag), less what the field gives
    it in `Settings.as_flags` (the name `--<field-name>` unless `flags` names it, dest, default, and the type of the
    default). help's %(default)s shows the command's default."""
    return field(default=default, metadata={"option": flag(*flags, check=check, resumed=resumed, help=help, **kwargs)})


@dataclass
class Settings:
    steps: int = 0                     # the command's: epochs or --steps
    output_dir: str = option("runs", "checkpoints, logs and the final model (default %(default)s)")
    lr: float = option(1e-4, "peak learning rate (default %(default)s)", check="positive", resumed=True)
    warmup: float = option(0.0, "linear warm-up: a fraction of the steps if < 1, else a number of steps (default "
                                "%(default)s)", check="non_negative", resumed=True)
    lr_decay_power: float = option(1.0, "after the warm-up the learning rate decays to 0 at the last step as ((steps - "
                                        "step) / (steps - warm-up)) ** P: 1 is linear decay, NVIDIA's BERT recipe "
                                        "uses 0.5 (default %(default)s)", check="positive", resumed=True,
                                   metavar="P")
    optimizer: str = option("adamw", "adamw (torch's, fused on CUDA) or lamb (LAMB as fused Triton kernels, "
                                     "bertfuse.kernels.Lamb: the optimizer of BERT's large-batch recipes) (default "
                                     "%(default)s)", resumed=True, choices=["adamw", "lamb"])
    weight_decay: float = option(0.01, "decoupled weight decay (AdamW's or LAMB's), not on biases and LayerNorm "
                                       "(default %(default)s)", check="non_negative", resumed=True)
    grad_accum: int = option(1, "gradient accumulation steps (default 1)", check="positive", resumed=True)
    max_grad_norm: float = option(1.0, "gradient clipping at this global norm (AdamW); with --optimizer lamb, LAMB's "
                                       "pre-normalisation of the gradients by their global norm, not a second clip; "
                                       "0 turns it off (default 1)", check="non_negative", resumed=True)
    max_nonfinite_steps: int = option(
        0, "a step whose loss or gradient norm is not finite never changes the weights; allow up to N such steps in "
           "a row (skipped, like a loss scaler's) before the run stops with an error (default 0: stop at the first)",
        check="non_negative", metavar="N")
    precision: str = option("auto", "auto: bf16 autocast on a GPU with bf16 (sm_80+, MI200/MI300), fp16 on one "
                                    "without (sm_75: T4), fp32 on CPU; fp16 uses a gradient scaler (default auto)",
                            resumed=True, choices=["auto", "fp32", "bf16", "fp16"])
    seed: int = option(0, "random seed (default 0)", resumed=True)
    log_every: int = option(1, "a log row (OUTPUT_DIR/log.jsonl, TensorBoard) every N steps; statistics are summed "
                               "on the device in between, with no per-step host sync (default %(default)s)",
                            check="positive")
    eval_every: int = option(0, "evaluate every N steps; 0: not during training (default %(default)s)",
                             check="non_negative")
    save_every: int = option(0, "checkpoint every N steps; 0: at the end only (default %(default)s)",
                             check="non_negative")
    keep_checkpoints: int = option(3, "keep the last K checkpoints (default %(default)s)", check="positive")
    resume: str | None = option(None, "continue from a checkpoint directory, or from the latest one in OUTPUT_DIR "
                                      "if no path", nargs="?", const="latest")
    overwrite: bool = option(False, "start a fresh run in an OUTPUT_DIR that already holds one (its log and "
                                    "checkpoints are deleted)")
    allow_config_changes: bool = option(False, "with --resume: continue although settings differ from the saved "
                                               "run's (listed)")
    progress: bool = option(True, "no progress bar", flags=("--no-progress",))
    dist_timeout: float = option(DIST_TIMEOUT_MINUTES, "under torchrun: how long a rank waits for the others at a "
                                 "collective, e.g. while rank 0 tokenises the corpus for all (default %(default)s; "
                                 "NCCL's own is 10 minutes)", check="positive", metavar="MINUTES")
    # The commands' own, passed to from_arguments:
    num_workers: int = 0
    adam_eps: float = 1e-6
    compile: str | None = None         # a torch.compile backend ("inductor", "aot_eager"...), or None
    cuda_graphs: bool = False          # capture each step in a CUDA graph (static shapes, one GPU)
    target: tuple[str, float] | None = None  # (an evaluation score, a value): stop once the score reaches it
    run_settings: dict = field(default_factory=dict)   # what --resume compares with the checkpoint's

    @classmethod
    def options(cls) -> list:
        """(field, its declared Flag) of every trainer option, in declaration order."""
        return [(f, f.metadata["option"]) for f in fields(cls) if "option" in f.metadata]

    @classmethod
    def as_flags(cls, **defaults) -> tuple:
        """The trainer's options as command flags (bert.common.commands.Flag), with a command's `defaults` (field
        name -> value)."""
        unknown = set(defaults) - {f.name for f, _ in cls.options()}
        if unknown:
            raise TypeError(f"not trainer options: {sorted(unknown)}")
        out = []
        for f, declared in cls.options():
            kwargs = dict(declared.kwargs, dest=f.name, default=defaults.get(f.name, f.default))
            if isinstance(f.default, bool):
                kwargs["action"] = "store_false" if f.default else "store_true"
            elif f.default is not None and "nargs" not in kwargs:
                kwargs.setdefault("type", type(f.default))
            out.append(declared._replace(names=declared.names or (f"--{f.name.replace('_', '-')}",), kwargs=kwargs))
        return tuple(out)

    @classmethod
    def add_arguments(cls, parser, **defaults) -> None:
        """The trainer's options as one argument group, with a command's `defaults` (field name -> value)."""
        add_flags(parser.add_argument_group("training"), cls.as_flags(**defaults))

    @classmethod
    def check_arguments(cls, args) -> None:
        """The checks of those options, each error naming its flag (before any work)."""
        check_flags(args, cls.as_flags())
        if args.resume and args.resume != "latest" and not os.path.isdir(args.resume):
            raise FileNotFoundError(f"--resume {args.resume}: no such checkpoint directory")

    @classmethod
    def resumed(cls, args) -> dict:
        """The trainer options --resume compares, as parsed."""
        return {name: getattr(args, name) for name in resumed(cls.as_flags())}

    @classmethod
    def from_arguments(cls, args, steps: int, run_settings: dict, **command) -> "Settings":
        """Settings from parsed options: the trainer's, `steps`, the command's own fields, and what --resume
        compares: the trainer's resumed options and the command's `run_settings`."""
        return cls(steps=steps, run_settings={**run_settings, **cls.resumed(args)},
                   **{f.name: getattr(args, f.name) for f, _ in cls.options()}, **command)

