#!/usr/bin/env bash
# CUDA check of p2p-diloco on the lent GPU: hivemind and its deps come as wheels in .whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
chmod +x /tmp/site/hivemind/hivemind_cli/p2pd 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import sys,torch,hivemind;print(sys.version.split()[0],'torch',torch.__version__,'cuda',torch.cuda.is_available(),torch.cuda.get_device_name(0),'hivemind',hivemind.__version__)" 2>&1 | tail -1
run() { name=$1; shift; s=$(date +%s); timeout 170 python3 -m p2p_diloco "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s )) s"; grep -v "^\s*$" $OUT/$name.log | tail -${TAILN:-14}; }
run small2_cuda swarm --peers 2 --output-dir /tmp/sw --sample-tokens 40 --run.device cuda --model.preset small --train.num_rounds 3 --diloco.inner_steps 40
run tiny_p2_cuda swarm --peers 2 --stages 2 --output-dir /tmp/sw2 --sample-tokens 0 --run.device cuda --train.num_rounds 2 --diloco.inner_steps 20
TAILN=10 run medium1_cuda swarm --peers 1 --output-dir /tmp/sw3 --sample-tokens 20 --run.device cuda --model.preset medium --train.num_rounds 1 --diloco.inner_steps 30
grep -h -i "autocast\|bf16\|bfloat\|device" $OUT/*.log | sort | uniq -c | head -8
ls /tmp/sw/peer0/checkpoints/stage0of1 2>/dev/null | tail -2
TAILN=6 run generate_cuda generate /tmp/sw/peer0 --prompt "def " --max-new-tokens 40 --device cuda
