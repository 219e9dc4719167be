#!/usr/bin/env bash
# Start this node's stage processes of a pipeline-parallel peer whose P stages span several machines.
#
# Every node of the volunteer cluster runs this script with the same arguments; torchrun starts
# NPROC_PER_NODE stage processes here (one per GPU) and joins them with the other nodes' into one peer of
# P = NNODES x NPROC_PER_NODE stages (NCCL on GPUs, gloo on CPUs). Stage j = NODE_RANK x NPROC_PER_NODE +
# local rank. If a stage process dies, the stages on the other nodes stop at their next exchange with it and
# torchrun exits on every node: run the same commands again and the peer resumes from its checkpoints (each node
# keeps its own stages' ones in --output-dir). gloo binds each stage to this node's interface towards MASTER_ADDR
# unless GLOO_SOCKET_IFNAME names one; torchrun's store listens on MASTER_PORT of node 0, unauthenticated: keep
# it on the cluster's private network.
#
#   # node 0 (also the rendezvous host):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 peers/launch-torchrun.sh --config peers/peer.toml \
#       --identity-path peer.id --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm...
#   # node 1:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 peers/launch-torchrun.sh --config peers/peer.toml \
#       --identity-path peer.id --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/Qm...
#
# Each stage process runs its own DHT node: a fixed port in --host-maddrs becomes port + stage index, and
# --identity-path FILE becomes FILE.stage<j>. Everything after the environment goes to `p2p-diloco peer`.
#
# REPLICAS=D (default 1) makes a cluster peer of D data-parallel replicas of P = NNODES x NPROC_PER_NODE / D
# stages: process r is stage r mod P of replica r div P; replica 0 of each stage joins the swarm, the others average
# gradients with it at every inner step (torch DDP).
set -euo pipefail

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
REPLICAS="${REPLICAS:-1}"
PROCESSES=$((NNODES * NPROC_PER_NODE))
PYTHON="${PYTHON:-python3}"

if [ "$REPLICAS" -lt 1 ] || [ $((PROCESSES % REPLICAS)) -ne 0 ]; then
    echo "error: REPLICAS ($REPLICAS) must divide NNODES x NPROC_PER_NODE ($PROCESSES)" >&2
    exit 2
fi
STAGES=$((PROCESSES / REPLICAS))
if [ "$PROCESSES" -lt 2 ]; then
    echo "error: a pipeline needs at least 2 processes (NNODES x NPROC_PER_NODE = $PROCESSES); run 'p2p-diloco peer' instead" >&2
    exit 2
fi

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m p2p_diloco peer --stages "$STAGES" --replicas "$REPLICAS" "$@"
