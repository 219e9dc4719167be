#!/bin/bash
# The quick sweep of SparseLoCo's density, feedback decay and outer step (run from the repository root).
run() { name=$1; shift
  .venv/bin/python benchmarks/quality.py --quick --rows alone,none/sparseloco --jobs 2 --eval-batches 32 \
    --out runs/sparseloco-sweep/$name "$@" 2>&1 | grep "^none/sparseloco" | sed "s/^/$name /"; }
run k64_b95
run k256_b95 --set averaging.sparse_topk=256
run k1024_b95 --set averaging.sparse_topk=1024
run k64_b100 --set averaging.sparse_feedback_decay=1.0
run k256_b100 --set averaging.sparse_topk=256 --set averaging.sparse_feedback_decay=1.0
run k64_lr2 --set diloco.outer_lr=2.0
run k64_m05 --set diloco.outer_momentum=0.5 --set diloco.outer_lr=0.7
run k256_m05 --set averaging.sparse_topk=256 --set diloco.outer_momentum=0.5 --set diloco.outer_lr=0.7
