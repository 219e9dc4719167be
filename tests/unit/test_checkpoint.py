"""Unit tests of checkpoints: atomic files with checksums, pruning, corrupt-latest fallback, exact resume."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.data import ShardDataset, WindowSampler
from p2p_diloco.model import ModelArgs, Transformer
from p2p_diloco.training import (
    CheckpointError,
    LocalExecutor,
    Stage,
    Trainer,
    list_checkpoints,
    load_latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from tests.helpers import TINY_ARGS, make_shards


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3, 4), value), "b": torch.arange(5, dtype=torch.float32) * value}


def test_round_trip_and_pruning(tmp_path):
    for r in range(1, 5):
        save_checkpoint(tmp_path, r, tensors(r), {"round": r, "note": "x"}, keep=3)
    manifests = list_checkpoints(tmp_path)
    assert [m.name for m in manifests] == ["step-00000004.json", "step-00000003.json", "step-00000002.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"step-0000000{r}.{ext}" for r in (2, 3, 4) for ext in ("json", "safetensors")])
    latest = load_latest_checkpoint(tmp_path)
    assert latest.step == 4 and latest.meta == {"round": 4, "note": "x"}
    assert torch.equal(latest.tensors["a"], tensors(4)["a"])


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage_manifest", "missing_data"])
def test_corrupt_latest_falls_back_to_previous(tmp_path, damage, caplog):
    save_checkpoint(tmp_path, 1, tensors(1), {}, keep=3)
    manifest = save_checkpoint(tmp_path, 2, tensors(2), {}, keep=3)
    data = manifest.with_suffix(".safetensors")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "garbage_manifest":
        manifest.write_text("{not json")
    else:
        data.unlink()
    with pytest.raises(CheckpointError):
        read_checkpoint(manifest)
    with caplog.at_level(logging.WARNING):
        latest = load_latest_checkpoint(tmp_path)
    assert latest.step == 1
    assert "falling back to the previous checkpoint" in caplog.text


def test_other_format_is_refused(tmp_path):
    manifest = save_checkpoint(tmp_path, 1, tensors(1), {}, keep=1)
    manifest.write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(CheckpointError, match="not a p2p-diloco-checkpoint"):
        read_checkpoint(manifest)
    assert load_latest_checkpoint(tmp_path) is None


class StopAfter(WindowSampler):
    """A sampler that asks its trainer to stop (as SIGTERM would) once it has served ``limit`` batches."""

    trainer = None
    limit = 10**9

    def next_batch(self):
        if self.num_batches + 1 >= self.limit:
            self.trainer.request_stop()
        return super().next_batch()


def _trainer(tmp_path, dataset, output: str, mode: str, stop_after: int = 10**9):
    cfg = load_config(None, [("diloco.inner_steps", "4"), ("train.num_rounds", "6"), ("diloco.mode", mode),
                             ("data.batch_size", "4"), ("train.eval_every_rounds", "0"),
                             ("checkpoint.every_rounds", "1"), ("run.output_dir", str(tmp_path / output))])
    model = Transformer(ModelArgs(**TINY_ARGS))
    stage = Stage(model, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco, total_steps=24)
    sampler = StopAfter(dataset, 16, 4, seed=5)
    trainer = Trainer(cfg, stage, LocalExecutor(model, torch.device("cpu")), sampler, [],
                      output_dir=tmp_path / output, peer_name="p")
    sampler.trainer, sampler.limit = trainer, stop_after
    return trainer


@pytest.mark.parametrize("mode", ["none", "delayed", "eager"])
@pytest.mark.parametrize("stop_after", [8, 10])
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, mode, stop_after):
    """Stopped at a round boundary (8) or half-way through a round (10), then resumed: the same anchor and
    weights as a run that was never interrupted, in every mode."""
    dataset = ShardDataset(make_shards(tmp_path / "data"), "train")
    straight = _trainer(tmp_path, dataset, "straight", mode)
    straight.run()
    first = _trainer(tmp_path, dataset, "resumed", mode, stop_after=stop_after)
    first.run()
    assert first.stage.inner_step == stop_after and first.summary.stopped_early
    second = _trainer(tmp_path, dataset, "resumed", mode)
    second.run()
    assert second.stage.inner_step == 24 and second.stage.round_index == 6
    for a, b in zip(second.stage.anchor, straight.stage.anchor):
        assert torch.equal(a, b)
    for a, b in zip(second.stage.params, straight.stage.params):
        assert torch.equal(a, b)
    assert second.summary.fallback_rounds == straight.summary.fallback_rounds == 6  # alone: own deltas


def test_stage_refuses_checkpoint_of_other_shape(tmp_path):
    cfg = load_config()
    small = Stage(Transformer(ModelArgs(**TINY_ARGS)), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                  diloco_cfg=cfg.diloco, total_steps=10)
    other = Stage(Transformer(ModelArgs(**dict(TINY_ARGS, dim=64, n_heads=8))), stage_index=0, num_stages=1,
                  inner_cfg=cfg.inner, diloco_cfg=cfg.diloco, total_steps=10)
    with pytest.raises(ValueError, match="has shape"):
        other.load_state_dict(small.state_dict()[0], small.state_dict()[1])


def test_the_round_in_flight_and_the_merge_report_survive_a_checkpoint_of_either_format():
    """A settled round in flight (its average and residual) and a delayed-mode merge report go through the
    checkpoint's JSON and come back whole; a format-1 checkpoint (the outcome's fields beside the round's) loads."""
    from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport

    cfg = load_config(None, [("diloco.mode", "delayed")])

    def stage() -> Stage:
        return Stage(Transformer(ModelArgs(**TINY_ARGS)), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                     diloco_cfg=cfg.diloco, total_steps=10)

    saved = stage()
    average = [torch.full_like(t, 0.5) for t in saved.anchor]
    residual = [torch.full_like(t, 0.1) for t in saved.anchor]
    outcome = RoundOutcome(average=average, residual=residual, averaged=True, group_size=3, group_tokens=30.0,
                           group_peers=("a", "b", "c"), compression={"rank": 0})
    saved.pending = PendingRound(2, [torch.ones_like(t) for t in saved.anchor], 10.0, outcome=outcome)
    saved._merged = RoundReport(3, applied_round=1, waited_s=0.5, outcome=dataclasses.replace(
        outcome, average=None, residual=None))
    meta = json.loads(json.dumps(saved.state_dict()[1]))
    loaded = stage()
    loaded.load_state_dict(saved.state_dict()[0], meta)
    got = loaded.pending.outcome
    assert (got.averaged, got.group_size, got.group_tokens, got.group_peers) == (True, 3, 30.0, ("a", "b", "c"))
    assert all(torch.equal(a, b) for a, b in zip(got.average, average))
    assert all(torch.equal(a, b) for a, b in zip(got.residual, residual))
    assert loaded._merged == saved._merged

    old = dict(meta, pending={"round": 2, "weight": 10.0, "settled": True, "averaged": False, "group_size": 1,
                              "group_tokens": 0.0, "reason": "no group", "share": 1.0})
    loaded = stage()
    loaded.load_state_dict({k: v for k, v in saved.state_dict()[0].items() if not k.startswith("pending_")}, old)
    assert loaded.pending.outcome == RoundOutcome(fallback_reason="no group")
    assert loaded.pending.settled and loaded.pending.round_index == 2
