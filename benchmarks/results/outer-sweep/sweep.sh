#!/bin/bash
# Issue 32 section 2: the outer step (lr, momentum) against the group size K, on the short horizon (tiny, H = 20,
# 20 rounds, batch 4 x 64, one seed). Run from the repository root; each point is one quality.py run whose report and
# quality.json land in runs/outer-sweep/<name>; benchmarks/outer_sweep.py tabulates them.
set -u
OUT=${OUT:-runs/outer-sweep}
base() { .venv/bin/python benchmarks/quality.py --h 20 --rounds 20 --batch 4 --seq 64 --eval-batches 32 --eval-every 2 \
  --jobs 2 --threads 1 "$@"; }
for K in 2 4 8; do
  [ -f $OUT/K$K-ref/quality.json ] || base --workers $K --rows alone,data-parallel --out $OUT/K$K-ref > /dev/null 2>&1
  for point in 0.5:0.5 0.7:0.5 1.0:0.5 1.3:0.5 0.7:0.3 0.7:0.7 1.0:0.0; do
    lr=${point%:*}; m=${point#*:}
    name=K$K-lr$lr-m$m
    [ -f $OUT/$name/quality.json ] && continue
    base --workers $K --rows none/none,delayed/adaptive --set diloco.outer_lr=$lr --set diloco.outer_momentum=$m \
      --out $OUT/$name > /dev/null 2>&1
    echo "$(date +%T) $name done"
  done
done
