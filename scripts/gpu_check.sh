#!/usr/bin/env bash
# CUDA checks in one command (< 10 minutes): the model-equivalence and cache-path tests on the
# GPU, then a short throughput run. Without CUDA it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device here; nothing to check"
  exit 0
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
# device=auto picks CUDA, so these run the engine, the pools and the tier copies on the GPU.
# test_async_copies runs the copy bookkeeping with late-landing copies between CUDA and pinned
# host pages; the others take the StreamTransfer path (side stream, events, no staging).
"$PY" -m pytest -q -x tests/test_models.py tests/test_engine.py tests/test_hicache.py \
  tests/test_async_copies.py tests/test_radix.py tests/test_deepseek.py tests/test_kv_dtype.py \
  -k "not serve_exits and not auto_size"
"$PY" benchmarks/offline_throughput.py --num-prompts 64
"$PY" benchmarks/hicache_multiturn.py --clients 16 --rounds 4
"$PY" benchmarks/kv_copies.py --clients 16 --rounds 4 --repeats 1 --out "${OUT:-/tmp}/kv-copies"
# Issue 12's last target: a short request beside the longest stop list within 1.5× of alone
# (on the 2-core CPU a second decode row costs almost a whole one; on a GPU it should not).
"$PY" benchmarks/http_streams.py --out "${OUT:-/tmp}/http-streams"
