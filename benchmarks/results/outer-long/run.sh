#!/bin/bash
# Issue 32 section 2 on the long horizon: tabulates the quality.py runs of the outer step against K (commands in
# BENCHMARKS.md, "The outer step against the group size"). Run from the repository root.
R=benchmarks/results
.venv/bin/python benchmarks/outer_long.py --out $R/outer-long \
  --ref 2=$R/quality-tiny-k2-seeds --ref 4=$R/quality-tiny-seeds --ref 8=$R/quality-tiny-k8-seeds \
  --point "2:lr 0.5=$R/quality-tiny-k2-lr0.5" \
  --point "2:lr 0.7 = the rule=$R/quality-tiny-k2-seeds" \
  --point "2:lr 1.0=$R/quality-tiny-k2-lr1.0" \
  --point "4:lr 0.5=$R/quality-tiny-lr0.5" \
  --point "4:lr 0.7=$R/quality-tiny-seeds" \
  --point "4:lr 1.0=$R/quality-tiny-k4-lr1.0,$R/quality-tiny-k4-lr1.0-s12" \
  --point "4:the rule (lr 0.99)=$R/quality-tiny-k4-ge" \
  --point "4:lr 1.4=$R/quality-tiny-k4-lr1.4" \
  --point "8:lr 0.7=$R/quality-tiny-k8-seeds" \
  --point "8:lr 1.0=$R/quality-tiny-k8-lr1.0" \
  --point "8:the rule (lr 0.99)=$R/quality-tiny-k8-ge" \
  --point "8:lr 1.4=$R/quality-tiny-k8-lr1.4"
