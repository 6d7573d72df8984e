#!/usr/bin/env bash
# The scale issue's benchmark matrix (README, Performance): each configuration is one run of throughput.py with every
# way (non-private NCHW and channels_last, dptrain in both layouts, Opacus hooks and ghost) in one process.
#   benchmarks/scale_matrix.sh            # after `pip install -e '.[bench]'` (make bench installs it)
# Results: benchmarks/results/scale-<model>-<batch>[-poisson]-<malloc>-<date>.json. About 25 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DATE=${DATE:-$(date +%F)}
run() { local name=$1; shift; "$PY" benchmarks/throughput.py "$@" --json "benchmarks/results/scale-$name-$DATE.json"; }
for malloc in tuned system; do
  run "cnn28-256-$malloc" --model cnn28 --batch 256 --fixed-batches --steps 20 --rounds 5 --malloc "$malloc"
  run "cnn28-1024-$malloc" --model cnn28 --batch 1024 --fixed-batches --steps 10 --rounds 3 --malloc "$malloc" --no-memory
  run "resnet20-128-$malloc" --model resnet20 --batch 128 --fixed-batches --steps 6 --rounds 3 --malloc "$malloc" --no-memory
  run "logistic-1024-$malloc" --model logistic --batch 1024 --fixed-batches --steps 150 --rounds 7 --malloc "$malloc" --no-memory
done
# dptrain's default sampling (Poisson batches, sizes vary from step to step)
run "cnn28-256-poisson-tuned" --model cnn28 --batch 256 --steps 20 --rounds 5 --malloc tuned --no-memory
