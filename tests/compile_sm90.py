"""`python tests/compile_sm90.py [--shard I/N] [group ...]`: tests/compile_gpus.py for the H100/H200 family,
`--arch sm_90`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_gpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--arch", "sm_90", *sys.argv[1:]]))
