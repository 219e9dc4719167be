#!/bin/bash
# Issue 32 section 2: the outer step (lr, momentum) against the group size K, on the short horizon (tiny, H = 20,
# 20 rounds, batch 4 x 64, one seed). Run from the repository root; each point is one quality.py run whose report and
# quality.json land in $OUT/<name> (skipped if there already); benchmarks/outer_sweep.py tabulates them.
set -u
OUT=${OUT:-runs/outer-sweep}
base() { .venv/bin/python benchmarks/quality.py --h 20 --rounds 20 --batch 4 --seq 64 --eval-batches 32 --eval-every 2 \
  --jobs 2 --threads 1 "$@"; }
point() { K=$1 lr=$2 m=$3; name=K$K-lr$lr-m$m
  [ -f $OUT/$name/quality.json ] && return
  base --workers $K --rows none/none,delayed/adaptive --set diloco.outer_lr=$lr --set diloco.outer_momentum=$m \
    --out $OUT/$name > /dev/null 2>&1
  echo "$(date +%T) $name done"; }
ref() { [ -f $OUT/K$1-ref/quality.json ] || base --workers $1 --rows alone,data-parallel --out $OUT/K$1-ref > /dev/null 2>&1; }
# order: what the first points showed matters first (K = 2 and 4: an outer step of 1.0 to 1.4 in steady state,
# lr / (1 - momentum), beat larger ones), then the rest of the grid
ref 4; for p in 0.7:0.5 1.0:0.5 0.5:0.5 0.35:0.5; do point 4 ${p%:*} ${p#*:}; done
ref 8; for p in 0.5:0.5 0.7:0.5; do point 8 ${p%:*} ${p#*:}; done
ref 2; for p in 0.5:0.5 0.7:0.5 0.35:0.5; do point 2 ${p%:*} ${p#*:}; done
for p in 0.7:0.3; do point 4 ${p%:*} ${p#*:}; done
for p in 0.35:0.5 1.0:0.5; do point 8 ${p%:*} ${p#*:}; done
for p in 1.0:0.0 0.5:0.7 0.25:0.5; do point 4 ${p%:*} ${p#*:}; done
