#!/usr/bin/env bash
# The quality rows of the `small` preset on a GPU (bf16 autocast: training/executor.py), as issue 32 asks where a
# GPU is at hand. Usage: bash benchmarks/gpu_quality.sh OUT_DIR [SECONDS]
# Where hivemind is not installed (a bare GPU image), wheels in .whl/ are installed into /tmp/site first.
set -u
out=${1:?usage: gpu_quality.sh OUT_DIR [SECONDS]}
limit=${2:-450}
py=${PYTHON:-python3}
if ! $py -c "import hivemind" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi -L 2>/dev/null
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
rows=alone,data-parallel,none/none,delayed/adaptive,delayed/sparseloco
# a one-round smoke of every row first: a CUDA-only failure shows in seconds
timeout 120 $py benchmarks/quality.py --preset small --device cuda --workers 4 --h 5 --rounds 1 --batch 8 --seq 256 \
    --eval-batches 4 --jobs 5 --threads 2 --rows $rows --out "$out/smoke" 2>&1 | tail -9
timeout "$limit" $py benchmarks/quality.py --preset small --device cuda --workers 4 --h 50 --rounds 30 --batch 8 \
    --seq 256 --eval-batches 32 --eval-every 3 --seeds 0,1 --jobs 5 --threads 2 --rows $rows --out "$out" 2>&1 | tail -40
