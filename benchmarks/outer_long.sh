#!/bin/bash
# Tabulates the long-horizon quality.py runs of the outer step (lr, momentum) and of H against K into
# benchmarks/results/outer-long (commands in BENCHMARKS.md, "How often the swarm averages" and "The outer step against
# the group size"); each --point folder is one run's output. Run from the repository root.
R=benchmarks/results
.venv/bin/python benchmarks/outer_long.py --out $R/outer-long \
  --ref 2=$R/quality-tiny-k2-seeds --ref 4=$R/quality-tiny-seeds --ref 8=$R/quality-tiny-k8-seeds \
  --point "2:lr 0.5=$R/quality-tiny-k2-lr0.5" \
  --point "2:lr 0.7 = the rule=$R/quality-tiny-k2-seeds" \
  --point "2:lr 1.0=$R/quality-tiny-k2-lr1.0" \
  --point "2:H 10 (150 rounds)=$R/quality-tiny-k2-h10" \
  --point "2:H 20 (75 rounds)=$R/quality-tiny-k2-h20" \
  --point "2:H 20, merge at 1=$R/quality-tiny-k2-h20-ov1" \
  --point "4:lr 0.5=$R/quality-tiny-lr0.5" \
  --point "4:lr 0.7=$R/quality-tiny-seeds" \
  --point "4:lr 1.0=$R/quality-tiny-k4-lr1.0,$R/quality-tiny-k4-lr1.0-s12" \
  --point "4:the rule (lr 0.99)=$R/quality-tiny-k4-ge" \
  --point "4:lr 1.4=$R/quality-tiny-k4-lr1.4" \
  --point "4:lr 2.0, momentum 0=$R/quality-tiny-k4-lr2.0-m0.0" \
  --point "4:lr 1.5, momentum 0.25=$R/quality-tiny-k4-lr1.5-m0.25" \
  --point "4:lr 0.4, momentum 0.8=$R/quality-tiny-k4-lr0.4-m0.8" \
  --point "4:H 10 (150 rounds)=$R/quality-tiny-k4-h10,$R/quality-tiny-k4-h10-s12" \
  --point "4:H 20 (75 rounds)=$R/quality-tiny-k4-h20" \
  --point "4:H 20, merge at 1=$R/quality-tiny-k4-h20-ov1" \
  --point "4:H 20, merge at 4=$R/quality-tiny-k4-h20-ov4" \
  --point "4:H 25 (60 rounds)=$R/quality-tiny-k4-h25,$R/quality-tiny-k4-h25-s12" \
  --point "4:H 100 (15 rounds)=$R/quality-tiny-k4-h100" \
  --point "4:H 50, merge at 2=$R/quality-tiny-k4-h50-ov2" \
  --point "8:lr 0.7=$R/quality-tiny-k8-seeds" \
  --point "8:lr 1.0=$R/quality-tiny-k8-lr1.0" \
  --point "8:the rule (lr 0.99)=$R/quality-tiny-k8-ge" \
  --point "8:lr 1.4=$R/quality-tiny-k8-lr1.4" \
  --point "8:H 10 (150 rounds)=$R/quality-tiny-k8-h10" \
  --point "8:H 20 (75 rounds)=$R/quality-tiny-k8-h20" \
  --point "8:H 20, merge at 1=$R/quality-tiny-k8-h20-ov1,$R/quality-tiny-k8-h20-ov1-s1,$R/quality-tiny-k8-h20-ov1-s2"
