"""What a run records about itself is true: the round of its first evaluation, when its ``config.toml`` is written,
its progress line before any loss, its checkpoint lines and what ``export`` says it wrote. One stage process in
this process, no network."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import asdict

import pytest
import torch

from p2p_diloco.cli.main import main
from p2p_diloco.cli.summary import SwarmProgress
from p2p_diloco.config import dump_config, load_config
from p2p_diloco.data import ShardDataset, WindowSampler, eval_batches
from p2p_diloco.model import ModelArgs, Transformer
from p2p_diloco.training import CheckpointError, LocalExecutor, Stage, Trainer, load_latest_checkpoint, save_checkpoint
from tests.helpers import TINY_ARGS, make_shards


def _trainer(tmp_path, output: str, *settings: tuple[str, str]) -> Trainer:
    data = make_shards(tmp_path / "data", with_eval=True) if not (tmp_path / "data").exists() else tmp_path / "data"
    cfg = load_config(None, [("diloco.inner_steps", "4"), ("train.num_rounds", "3"), ("data.batch_size", "4"),
                             ("checkpoint.every_rounds", "1"), ("run.output_dir", str(tmp_path / output)),
                             *settings])
    model = Transformer(ModelArgs(**TINY_ARGS))
    stage = Stage(model, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                  total_steps=cfg.train.num_rounds * cfg.diloco.inner_steps)
    sampler = WindowSampler(ShardDataset(data, "train"), 16, 4, seed=5)
    held_out = eval_batches(ShardDataset(data, "eval"), 16, 4, 2)
    return Trainer(cfg, stage, LocalExecutor(model, torch.device("cpu")), sampler, held_out,
                   output_dir=tmp_path / output, peer_name="p")


class ReloadAtStart:
    """The swarm's sync of a late joiner: at the start it takes over a state of a later round (the checkpoint of
    another peer), as a reload does."""

    def __init__(self, stage: Stage, checkpoint):
        self.stage, self.checkpoint = stage, checkpoint

    def at_start(self, resumed: bool) -> None:
        self.stage.load_state_dict(self.checkpoint.tensors, self.checkpoint.meta)

    def after_round(self) -> None: ...


def _rows(trainer: Trainer, kind: str) -> list[dict]:
    lines = (trainer.output_dir / "metrics-stage0.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def test_a_late_joiners_first_eval_carries_the_round_of_the_state_it_downloaded(tmp_path):
    donor = _trainer(tmp_path, "donor", ("train.num_rounds", "2"))
    donor.run()
    downloaded = load_latest_checkpoint(donor.checkpoint_dirs[0])  # after rounds 0 and 1: its anchor holds 2
    joiner = _trainer(tmp_path, "joiner")
    joiner.syncs = ReloadAtStart(joiner.stage, downloaded)
    joiner._log_sync_events = lambda: False  # (no swarm records to note the reload in)
    joiner.run()
    first = _rows(joiner, "eval")[0]
    assert (first["round"], first["inner_step"]) == (2, 8)
    assert joiner.summary.eval_round_start == 2
    assert [r for r, _ in joiner.ledger.evals] == [2, 3]  # the records' eval_losses: the status page's curve
    fresh = _trainer(tmp_path, "fresh")
    fresh.run()
    assert (_rows(fresh, "eval")[0]["round"], fresh.summary.eval_round_start) == (0, 0)


def test_config_toml_is_written_once_every_check_of_the_start_passed(tmp_path):
    """A start refused by its checkpoint (another run's) leaves the previous config.toml; one that passes writes
    its resolved config, atomically."""
    _trainer(tmp_path, "peer", ("run.run_id", "other-run"), ("train.num_rounds", "1")).run()
    config = tmp_path / "peer" / "config.toml"
    config.write_text("# the previous start's\n")
    refused = _trainer(tmp_path, "peer", ("run.run_id", "this-run"))
    with pytest.raises(CheckpointError, match="belongs to run"):
        refused.run()
    assert config.read_text() == "# the previous start's\n"
    started = _trainer(tmp_path, "peer", ("run.run_id", "this-run"), ("train.num_rounds", "1"),
                       ("checkpoint.resume", "false"))
    started.run()
    assert config.read_text() == dump_config(started.cfg)
    assert [p.name for p in config.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("mode", ["none", "delayed"])
def test_the_end_of_a_run_is_saved_once(tmp_path, caplog, mode):
    trainer = _trainer(tmp_path, "peer", ("diloco.mode", mode))
    with caplog.at_level(logging.INFO, logger="p2p_diloco.training.state.persist"):
        trainer.run()
    saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Saved checkpoint")]
    assert len(saved) == 3 and len(set(saved)) == 3, saved  # one per round, the last after its flush
    final = load_latest_checkpoint(trainer.checkpoint_dirs[0])
    assert (final.step, final.meta["applied_round"]) == (12, 2)  # the last round applied, none in flight


def test_the_progress_line_shows_no_loss_until_one_is_measured(tmp_path, capsys):
    progress = SwarmProgress(tmp_path, ["peer1"], load_config(None, []))
    progress._last_line = 0.0  # (a line is due)
    progress.refresh()
    line = capsys.readouterr().out
    assert "loss -" in line and "nan" not in line
    (tmp_path / "peer1").mkdir()
    (tmp_path / "peer1" / "metrics-stage0.jsonl").write_text(
        json.dumps({"kind": "step", "inner_step": 1, "round": 0, "loss": 4.25}) + "\n")
    progress._last_line = 0.0
    progress.refresh()
    assert "loss 4.250" in capsys.readouterr().out


@pytest.mark.parametrize("applied_round, says", [(-1, "no round applied yet: the initial model"),
                                                  (0, "rounds up to 0 applied")])
def test_export_says_which_rounds_the_model_holds(tmp_path, applied_round, says):
    args = ModelArgs(**dict(TINY_ARGS, vocab_size=300))  # (the byte tokenizer's 257 ids fit)
    tensors = {f"anchor/{name}": p.detach().clone() for name, p in Transformer(args).named_parameters()}
    save_checkpoint(tmp_path / "peer" / "checkpoints" / "stage0of1", 0, tensors,
                    {"run_id": "r", "round": 0, "applied_round": applied_round, "model": asdict(args)}, keep=2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", str(tmp_path / "peer"), "--out", str(tmp_path / "hf"), "--tokenizer", "byte"]) == 0
    assert says in out.getvalue() and "up to -1" not in out.getvalue()
