"""The training loop shared by pre-training and fine-tuning: `Trainer(job, settings, device, dist).fit()`.

    distributed.py  the device and torchrun/DDP set-up; global batches split into per-rank micro-batches
    settings.py     the trainer's options, each declared once (flag, help, default, check, resumed or not)
    rundir.py       the run directory: its lock, checkpoints, exact resume, the log truncated to a checkpoint
    health.py       the log window summed on the device, non-finite steps, data workers that died
    loop.py         what a job supplies (`Job`) and the loop itself (`Trainer`)
    optim.py        AdamW with BERT's decay groups and linear warm-up and decay
    static.py       a step at static shapes captured as one CUDA graph
"""
