python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
s=$(date +%s); timeout 150 python3 -m p2p_diloco swarm --peers 1 --stages 2 --output-dir /tmp/sw2 --sample-tokens 0 --run.device cuda --train.num_rounds 1 --diloco.inner_steps 10 > $OUT/p2_one_gpu.log 2>&1; echo "== p2 on 1 GPU rc=$? $(( $(date +%s) - s )) s"; grep -i "error" $OUT/p2_one_gpu.log | sort | uniq | head -5
s=$(date +%s); timeout 150 python3 -m p2p_diloco swarm --peers 2 --output-dir /tmp/sw1 --sample-tokens 20 --run.device cuda --train.num_rounds 2 --diloco.inner_steps 20 > $OUT/p1_cuda.log 2>&1; echo "== p1 cuda rc=$? $(( $(date +%s) - s )) s"; tail -9 $OUT/p1_cuda.log
