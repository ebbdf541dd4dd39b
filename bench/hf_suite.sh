#!/usr/bin/env bash
# transformers' own model tests on plain and fused models; see bench/hf_suite.py (arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m bertfuse.bench.hf_suite "$@"
