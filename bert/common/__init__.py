"""What every stage of bert uses and that depends on none of them: how a run ends (errors.py), the command lines'
shared parts (commands.py), atomic file writes (files.py), named seed streams (seeds.py) and the ordered worker
pool (workers.py).
"""
