"""Training steps at static shapes, captured in a CUDA graph.

A packed pre-training step (bert.data.packing, BertForPreTraining's packed call) has fixed shapes and asks the host
nothing, so the whole iteration - forward, backward, gradient clipping and the fused AdamW (or LAMB) step - can be
recorded once as a CUDA graph and replayed: one launch per step instead of thousands, and no Python between
kernels. NVIDIA's MLPerf BERT does the same (its `full_iteration` graph). `GraphedStep` does the recording:

- static input buffers: each step's micro-batches (and the loss denominators) are copied into them;
- warm-up iterations on a side stream (cuBLAS workspaces, Triton's first launches, the optimizer's state),
  then the model, optimizer state and RNG are put back as they were, so warm-up trains nothing;
- the optimizer must be capturable (its step count and learning rate live on the device; the scheduler writes
  the learning rate into that tensor, which the graph reads);
- the outputs the trainer keeps (loss terms and statistics) are cloned after each replay.
"""
from __future__ import annotations

import torch


def record_cuda_graph(fn, warmup: int, prepare):
    """fn() run `warmup` times on a side stream (first launches, workspaces, lazily made state stay out of the
    graph), then prepare(), then fn() captured as a CUDA graph. Returns (replay, fn's outputs in the graph's
    memory, rewritten by every replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    prepare()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph.replay, outputs


class GraphedStep:
    """One training step - `step_fn(batches, denominators)` running forward and backward over every
    micro-batch and then the optimizer step, returning a list of dicts of device scalars - captured as one CUDA
    graph on the first call and replayed on every call after (see the module docstring).

    Every call must bring micro-batches of the same count, keys, shapes and dtypes (a packed batch's) and the
    same non-tensor values; `denominators` maps names to floats (or device scalars), which are copied into the
    graph's inputs. The optimizer must be capturable, its learning rate a device tensor (bert.train.optim.adamw,
    bert.train.optim.lamb).
    `record` does the warm-up and capture (`record_cuda_graph`; tests pass a stand-in that runs on a CPU)."""

    def __init__(self, step_fn, model: torch.nn.Module, optimizer: torch.optim.Optimizer, warmup: int = 3,
                 record=record_cuda_graph):
        self.step_fn, self.model, self.optimizer, self.warmup, self.record = step_fn, model, optimizer, warmup, record
        self.replay = None
        self.batches: list[dict] = []
        self.denominators: dict[str, torch.Tensor] = {}
        self.outputs: list[dict[str, torch.Tensor]] = []

    def __call__(self, batches: list[dict], denominators: dict) -> list[dict[str, torch.Tensor]]:
        if self.replay is None:
            self._capture(batches, denominators)
        self._load(batches, denominators)
        self.replay()
        # Cloned: the next replay overwrites the graph's outputs in place.
        return [{k: v.clone() for k, v in out.items()} for out in self.outputs]

    def _load(self, batches, denominators) -> None:
        if len(batches) != len(self.batches):
            raise ValueError(f"a CUDA-graph step was captured for {len(self.batches)} micro-batches, got {len(batches)}")
        for static, batch in zip(self.batches, batches):
            if static.keys() != batch.keys():
                raise ValueError(f"a CUDA-graph step needs the same batch keys every step: {sorted(static)} "
                                 f"then {sorted(batch)}")
            for k, v in batch.items():
                if isinstance(v, torch.Tensor):
                    if v.shape != static[k].shape or v.dtype != static[k].dtype:
                        raise ValueError(f"a CUDA-graph step needs static shapes: {k} was {tuple(static[k].shape)} "
                                         f"{static[k].dtype}, now {tuple(v.shape)} {v.dtype} (use --packing)")
                    static[k].copy_(v, non_blocking=True)
                elif v != static[k]:
                    raise ValueError(f"a CUDA-graph step needs the same {k} every step: {static[k]!r}, now {v!r}")
        for k, v in denominators.items():
            self.denominators[k].copy_(v, non_blocking=True) if isinstance(v, torch.Tensor) \
                else self.denominators[k].fill_(float(v))

    def _capture(self, batches, denominators) -> None:
        device = next(self.model.parameters()).device
        self.batches = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
        self.denominators = {k: torch.zeros((), dtype=torch.float32, device=device) for k in denominators}
        self._load(batches, denominators)
        saved = self._snapshot(device)
        self.replay, self.outputs = self.record(lambda: self.step_fn(self.batches, self.denominators), self.warmup,
                                                lambda: self.optimizer.zero_grad(set_to_none=True))
        self._restore(saved)

    def _snapshot(self, device: torch.device) -> dict:
        """Copies of what warm-up changes: parameters, optimizer state (absent before the first step), RNG."""
        state = self.optimizer.state
        return {"params": [p.detach().clone() for p in self.model.parameters()],
                "optim": {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[p].items()}
                          for p in list(state)},
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}

    @torch.no_grad()
    def _restore(self, saved: dict) -> None:
        """Put back the values, in place: the graph holds these tensors' addresses. State that warm-up created
        starts from zero, as a fresh optimizer's does."""
        for p, value in zip(self.model.parameters(), saved["params"]):
            p.copy_(value)
        for p, entries in self.optimizer.state.items():
            before = saved["optim"].get(p, {})
            for k, v in entries.items():
                if isinstance(v, torch.Tensor):
                    v.copy_(before[k]) if k in before else v.zero_()
        torch.set_rng_state(saved["rng"])
        if saved["cuda_rng"] is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"], next(self.model.parameters()).device)
