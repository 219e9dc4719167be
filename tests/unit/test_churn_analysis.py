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
