#!/usr/bin/env bash
# The quality rows of the `small` preset on a GPU (bf16 autocast: training/executor.py), as issue 32 asks where a
# GPU is at hand. Usage: bash benchmarks/gpu_quality.sh OUT_DIR [SECONDS]
#   H, ROUNDS, SEEDS, ROWS (environment): inner steps per round (default 20, the default config's), rounds (50),
#   seeds (0) and rows (alone, data parallel, blocking DiLoCo in fp32 and in the default's compression, the default).
#   DEVICE: cuda unless set (cpu: a check of the script itself).
# Where hivemind is not installed (a bare GPU image), wheels in .whl/ are installed into /tmp/site first.
set -u -o pipefail
out=${1:?usage: gpu_quality.sh OUT_DIR [SECONDS]}
limit=${2:-450}
h=${H:-20}
rounds=${ROUNDS:-50}
seeds=${SEEDS:-0}
rows=${ROWS:-alone,data-parallel,none/none,none/adaptive,delayed/adaptive}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
if ! $py -c "import hivemind" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi -L 2>/dev/null
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
jobs=$(( $(echo "$rows" | tr ',' '\n' | wc -l) ))
# a one-round smoke of every row first: a CUDA-only failure shows in seconds
timeout 120 $py benchmarks/quality.py --preset small --device "$device" --workers 4 --h 2 --rounds 1 --batch 8 --seq 256 \
    --eval-batches 2 --jobs "$jobs" --threads 2 --rows "$rows" --out "$out/smoke" 2>&1 | tail -$(( jobs + 4 )) || exit 1
timeout "$limit" $py benchmarks/quality.py --preset small --device "$device" --workers 4 --h "$h" --rounds "$rounds" \
    --batch 8 --seq 256 --eval-batches 32 --eval-every 5 --seeds "$seeds" --jobs "$jobs" --threads 2 --rows "$rows" \
    --out "$out" 2>&1 | tail -40
