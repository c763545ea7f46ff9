#!/usr/bin/env bash
# On a GPU/TPU machine: a 2-layer model of the paper's config (configs/qwen3-30b-a3b.yaml)
# trained 3 steps on one 8k sequence per device, its measured peak memory next to the
# on-paper estimates of the same step (benchmarks/bench_memory.py's XLA:CPU compile and, on a
# GPU, `satjax plan --topology h100:N`'s deviceless XLA:GPU compile for the GPU's own target
# config, N = the GPUs here, whatever their model). Uses the machine's own
# python3 with JAX for its accelerator (PYTHON=... to choose another); satjax from this
# checkout. Options pass through, e.g. `scripts/device_check.sh --layers 4 --seq-len 32768`.
# Tested on CPU: `scripts/device_check.sh --config configs/tiny.yaml --seq-len 64`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" scripts/device_check.py --config configs/qwen3-30b-a3b.yaml "$@"
