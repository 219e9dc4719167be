"""benchmarks/churn.py's survivor count: a survivor that never ends another round after a kill is attempted and
not completed (the count could not fail before), and one that had already finished is not counted."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "churn.py"


def load_churn():
    spec = importlib.util.spec_from_file_location("churn_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_end(t: float, round_index: int, averaged: bool = True) -> dict:
    return {"kind": "round", "time": t, "round_index": round_index, "applied_round": round_index,
            "averaged": averaged, "anchor_applied_round": round_index, "anchor_sha256": f"a{round_index}"}


def write_peer(out: Path, name: str, events: list[dict]) -> None:
    (out / name).mkdir(parents=True)
    (out / name / "metrics-stage0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_survivor_that_never_ends_another_round_is_not_completed(tmp_path):
    churn = load_churn()
    write_peer(tmp_path, "ok", [round_end(1.0, 0), round_end(2.0, 1), round_end(12.0, 2, averaged=False)])
    write_peer(tmp_path, "hung", [round_end(1.0, 0), round_end(2.0, 1)])  # nothing after the kill at t = 10
    write_peer(tmp_path, "done", [round_end(1.0, 0), round_end(2.0, 1), round_end(3.0, 2), round_end(4.0, 3)])
    write_peer(tmp_path, "victim", [round_end(1.0, 0)])
    args = argparse.Namespace(rounds=4)
    result = churn.analyse(tmp_path, args, ["ok", "hung", "done", "victim"], [{"peer": "victim", "time": 10.0}],
                           [], {}, {})
    survivors = result["survivor_round_ends"]
    assert (survivors["attempted"], survivors["completed"], survivors["averaged"]) == (2, 1, 0)
    assert survivors["max_s_after_kill"] == 2.0


def test_a_round_end_that_applies_nothing_is_skipped_for_the_next_that_applies_a_round(tmp_path):
    """The first round end of an overlap mode applies nothing (its average lands a round later): the survivor's
    count goes on to its next round end, which applies a round."""
    churn = load_churn()
    first = dict(round_end(11.0, 0), applied_round=None, averaged=False)
    write_peer(tmp_path, "survivor", [first, round_end(15.0, 1)])
    write_peer(tmp_path, "fell-back", [first, round_end(16.0, 1, averaged=False)])
    write_peer(tmp_path, "victim", [])
    result = churn.analyse(tmp_path, argparse.Namespace(rounds=4), ["survivor", "fell-back", "victim"],
                           [{"peer": "victim", "time": 10.0}], [], {}, {})
    survivors = result["survivor_round_ends"]
    assert (survivors["attempted"], survivors["completed"], survivors["averaged"]) == (2, 2, 1)
    assert survivors["max_s_after_kill"] == 6.0
