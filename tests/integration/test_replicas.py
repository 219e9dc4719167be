"""A cluster peer: D data-parallel replicas x P pipeline stages in one peer (torch DDP over gloo), as real processes:
it learns what one replica of D times the batch learns, and averages with an ordinary peer once per stage and round,
not once per replica."""

from __future__ import annotations

import pytest

from tests.integration.conftest import LOOPBACK, TINY_TRAINING
from tests.integration.test_pipeline import pipeline_peer
from tests.integration.test_swarm import events, summary

pytestmark = pytest.mark.timeout(420)


def alone(tmp_path, name: str, *extra: str) -> list[str]:
    return ["peer", "--host-maddrs", LOOPBACK, "--output-dir", str(tmp_path / name), "--train.num_rounds", "3",
            "--diloco.inner_steps", "10", *TINY_TRAINING, "--data.seed", "5", *extra]


def test_two_replicas_learn_what_one_replica_of_twice_the_batch_learns(tmp_path, processes):
    """A peer of 2 replicas of batch 4 and a peer of one replica of batch 8, each alone, from one seed: the replicas
    draw the batches of 8 from one stream and train on their halves, DDP averages their gradients, so every round's
    eval loss is the one-replica peer's up to the order of float sums (measured: 3.1772647 against 3.1772571 after
    3 rounds), and the round's tokens count both replicas. (The same 32 eval sequences: 8 batches of 4, 4 of 8.)"""
    processes.start("two", *alone(tmp_path, "two", "--replicas", "2", "--data.batch_size", "4",
                                  "--data.eval_batches", "8"))
    processes.start("one", *alone(tmp_path, "one", "--data.batch_size", "8", "--data.eval_batches", "4"))
    for name in ("two", "one"):
        assert processes.wait(name, timeout=300) == 0, processes.log(name)[-3000:]
    curves = {name: [e["eval_loss"] for e in events(tmp_path, name, "eval")] for name in ("two", "one")}
    assert len(curves["one"]) == 4 and curves["one"][-1] < curves["one"][0] - 1.0, curves
    assert curves["two"] == pytest.approx(curves["one"], rel=1e-4, abs=0), curves
    assert summary(tmp_path, "two")["tokens"] == summary(tmp_path, "one")["tokens"] == 3 * 10 * 8 * 32
    assert "stage 0 replica 1: 30 inner steps, stopped by replica 0" in processes.log("two")


def test_a_peer_of_two_replicas_and_two_stages_averages_with_a_one_process_peer(tmp_path, processes, bootstrap):
    """A peer of 2 replicas x 2 stages (4 processes) and an ordinary one-process peer in one run, averaged by
    fragment (F = 2: the cluster's stage j holds fragment j): every round each fragment is averaged by both, in a
    group of 2 (replica 0 of each stage is the peer's one member; its replica adds tokens, not members), and each
    fragment's anchor is bit-identical on both peers after every round; the round's weight is both replicas'
    tokens; every process of the cluster peer ends."""
    rounds, common = 3, ["--diloco.fragments", "2", "--train.wait_for_peers", "2"]
    processes.start("cluster", *pipeline_peer(tmp_path, "cluster", "--stages", "2", "--replicas", "2", *common,
                                              maddrs=bootstrap, rounds=rounds))
    processes.start("single", *pipeline_peer(tmp_path, "single", *common, maddrs=bootstrap, rounds=rounds))
    for name in ("cluster", "single"):
        assert processes.wait(name, timeout=360) == 0, processes.log(name)[-3000:]

    def by_fragment(name: str, stages: int) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for stage in range(stages):
            for e in events(tmp_path, name, "round", stage):
                if e["applied_round"] is not None:
                    out.setdefault(e["fragment"], []).append(e)
        return out

    cluster, single = by_fragment("cluster", 2), by_fragment("single", 1)
    told = {"cluster": cluster, "single": single}
    for f in (0, 1):
        assert [e["applied_round"] for e in cluster[f]] == [e["applied_round"] for e in single[f]] == \
            list(range(rounds)), told
        for mine, theirs in zip(cluster[f], single[f]):
            assert mine["averaged"] and theirs["averaged"] and mine["group_size"] == theirs["group_size"] == 2, told
            assert mine["anchor_sha256"] == theirs["anchor_sha256"], (f, told)
            assert mine["group_tokens"] == theirs["group_tokens"], (f, told)
    # the cluster's rounds weigh twice the single peer's (2 replicas of the same batch, the same steps)
    assert summary(tmp_path, "cluster")["tokens"] == 2 * summary(tmp_path, "single")["tokens"]
    log = processes.log("cluster")
    for stage in (0, 1):
        assert f"stage {stage} replica 1: {rounds * 8} inner steps, stopped by replica 0" in log, log[-3000:]
