"""Fine-tuning tasks: their data (readers.py), what each trains and reports (task.py, the `TASKS` registry) and
their metrics (metrics.py).
"""
