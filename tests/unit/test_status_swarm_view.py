"""The swarm at a glance on `status`'s report and page: the progress records' groups of the last rounds, per-round
train losses and finished flag (bounded by the schema, filled in by the trainer's ledger), each stage process's state
(training, finished, silent), the document's groups (who averaged with whom), and what `status --serve` remembers
across reads (stage processes gone, each one's train-loss curve). No DHT, no network. The page in a real browser:
tests/integration/test_status_page.py."""

from __future__ import annotations

import json
import math

import pytest
from hivemind.dht.protocol import DHTProtocol
from hypothesis import HealthCheck, given, settings
from pydantic.v1 import ValidationError

from p2p_diloco.cli.status_report import MAX_GROUP_ROUNDS, SILENT_AFTER_S, build_report, format_report, swarm_groups
from p2p_diloco.cli.status_serve import KEEP_GONE_S, MAX_GONE_ROWS, MAX_PEER_CURVE_POINTS, SwarmMemory
from p2p_diloco.round.outcome import RoundOutcome, RoundReport
from p2p_diloco.swarm.discovery.progress import ProgressRecord, shown_facts
from p2p_diloco.swarm.discovery.records import (
    MAX_BANS_SHOWN,
    MAX_EVALS_SHOWN,
    MAX_GROUP_MEMBERS_SHOWN,
    MAX_GROUPS_SHOWN,
    MAX_REASON_CHARS,
    MAX_RECORD_VALUE_BYTES,
    MAX_TRAIN_LOSSES_SHOWN,
    ProgressValue,
)
from p2p_diloco.training.ledger import Held, Ledger
from p2p_diloco.training.summary import TrainSummary
from p2p_diloco.unit import Unit
from tests.unit.test_status_page import FIELD_VALUES, OLD_RECORD, schema_accepts, value

NODE = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # an RSA identity's peer id: 46 characters
ID_52 = "12D3KooW" + "A" * 44  # an Ed25519 one's: 52


def node(i: int) -> str:
    return f"Qm{i:044d}"


def record(name: str, round_: int, time: float = 99.0, **changes) -> ProgressRecord:
    return ProgressRecord(peer=f"peer-{name}", stage=0, num_stages=1, round=round_, inner_step=10 * round_,
                          tokens_per_s=10.0, loss=2.0, time=time, node=name, **changes)


# ---- the record's fields ----------------------------------------------------------------------------------------

def test_the_new_fields_at_their_caps_are_stored_and_an_older_record_still_parses():
    full = value(groups=[(2**62, [ID_52] * MAX_GROUP_MEMBERS_SHOWN)] * MAX_GROUPS_SHOWN,
                 train_losses=[(2**62, -1e308)] * MAX_TRAIN_LOSSES_SHOWN, finished=True)
    assert schema_accepts(full) and ProgressValue.parse_obj(full).dict()["finished"] is True
    assert schema_accepts(OLD_RECORD)
    old = ProgressValue.parse_obj(OLD_RECORD)
    assert (old.groups, old.train_losses, old.finished) == ([], [], False)
    assert "groups" not in old.dict()  # hivemind's validator compares the parse with what was sent


@pytest.mark.parametrize("changes", [
    {"groups": [(1, [NODE])] * (MAX_GROUPS_SHOWN + 1)},
    {"groups": [(1, [NODE] * (MAX_GROUP_MEMBERS_SHOWN + 1))]},
    {"groups": [(1, [])]},
    {"groups": [(-1, [NODE])]},
    {"groups": [(1, ["<img src=x>"])]},
    {"groups": [(1, ["Qm.dots"])]},
    {"groups": [(1, ["Q" * 57])]},
    {"groups": [(1, NODE)]},
    {"groups": [(1.0, [NODE])]},
    {"groups": {"1": [NODE]}},
    {"train_losses": [(1, math.nan)]},
    {"train_losses": [(1, -math.inf)]},
    {"train_losses": [(1, "2.0")]},
    {"train_losses": [(-1, 2.0)]},
    {"train_losses": [(1, 2.0)] * (MAX_TRAIN_LOSSES_SHOWN + 1)},
    {"finished": 1},
    {"finished": "true"},
    {"finished": None},
])
def test_a_malformed_or_oversized_group_loss_or_flag_refuses_the_record(changes):
    with pytest.raises(ValidationError):
        ProgressValue.parse_obj(value(**changes))
    assert not schema_accepts(value(**changes))


def largest_record() -> dict:
    """Every field at its bound (the longest names, the largest numbers)."""
    return value(eval_losses=[(2**62, 1e308)] * MAX_EVALS_SHOWN, bytes_sent=2**62, rounds_averaged=2**62,
                 bans=[("Q" * 128, "<script>" + "x" * (MAX_REASON_CHARS - 8))] * MAX_BANS_SHOWN,
                 peer="P" * 128, node="N" * 128, anchor="f" * 128, prior_anchor="f" * 128, round=2**62,
                 inner_step=2**62, applied_round=2**62, tokens_per_s=1e308, loss=-1e308, time=1e308,
                 groups=[(2**62, ["Q" * 56] * MAX_GROUP_MEMBERS_SHOWN)] * MAX_GROUPS_SHOWN,
                 train_losses=[(2**62, -1e308)] * MAX_TRAIN_LOSSES_SHOWN, finished=True)


def test_the_largest_record_stays_well_inside_the_dht_bound():
    """A signature and its framing take under 1 KiB; the largest record leaves 2 KiB more besides."""
    size = len(DHTProtocol.serializer.dumps(ProgressValue.parse_obj(largest_record()).dict()))
    assert size + 1024 + 2048 < MAX_RECORD_VALUE_BYTES, size


def test_what_the_ledger_noted_is_cut_to_what_the_schema_accepts():
    members = [node(i) for i in range(40, 0, -1)] + ["<b>x</b>", "Q" * 60, 7]
    noted = record(NODE, 9, groups=((-1, (NODE,)),) + tuple((r, tuple(members)) for r in range(5)) +
                   ((5, ("bad id!",)),),
                   train_losses=tuple((r, math.nan if r == 40 else 3.0 - r / 100) for r in range(50)) + ((-2, 1.0),),
                   finished=1)
    facts = shown_facts(noted)
    parsed = ProgressValue.parse_obj(value(**facts)).dict()
    assert [r for r, _ in parsed["groups"]] == [2, 3, 4]  # the last 3 with a member left
    assert parsed["groups"][-1][1] == [node(i) for i in range(1, MAX_GROUP_MEMBERS_SHOWN + 1)]  # sorted, the first
    assert [r for r, _ in parsed["train_losses"]] == [r for r in range(17, 50) if r != 40]  # the last 32 finite
    assert parsed["finished"] is True
    assert schema_accepts(value(**facts))
    writer = node(40)  # the last of a group too large to name whole: still named (readers show only its groups)
    kept = shown_facts(noted, writer)["groups"][-1][1]
    assert len(kept) == MAX_GROUP_MEMBERS_SHOWN and kept[-1] == writer and kept[:-1] == [node(i) for i in range(1, 32)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=FIELD_VALUES, losses=FIELD_VALUES, finished=FIELD_VALUES)
def test_any_group_loss_or_flag_is_refused_or_gives_a_strict_json_report(groups, losses, finished):
    try:
        parsed = ProgressValue.parse_obj(value(groups=groups, train_losses=losses, finished=finished)).dict()
    except ValidationError:
        return
    found = ProgressRecord(**dict(parsed, groups=tuple((r, tuple(nodes)) for r, nodes in parsed["groups"]),
                                  train_losses=tuple(parsed["train_losses"])))
    report = build_report("r", [found], now=1000.0)
    report["peers"] = SwarmMemory().update(report["peers"], 1000.0)
    json.dumps(report, allow_nan=False)


# ---- the report -------------------------------------------------------------------------------------------------

def test_each_row_has_its_state_train_losses_and_groups():
    """finished (its last round applied: whatever its age), silent (not refreshed for 3 refresh periods), training."""
    now = 1000.0
    records = [record("a", 3, time=now - 1, train_losses=((1, 3.0), (2, 2.5)), groups=((1, ("a", "b")),)),
               record("b", 3, time=now - SILENT_AFTER_S - 1, groups=((1, ("a", "b")),)),
               record("c", 3, time=now - 100, finished=True),
               record("d", 3, time=now - SILENT_AFTER_S + 1)]
    report = build_report("r", records, now=now)
    by_node = {p["node"]: p for p in report["peers"]}
    assert {n: p["state"] for n, p in by_node.items()} == {"a": "training", "b": "silent", "c": "finished",
                                                          "d": "training"}
    assert by_node["a"]["train_losses"] == [[1, 3.0], [2, 2.5]] and by_node["b"]["train_losses"] == []
    assert by_node["a"]["groups"] == [{"round": 1, "unit": 0, "nodes": ["a", "b"]}]
    json.dumps(report, allow_nan=False)
    table = format_report(report).splitlines()
    assert table[1].split()[-1] == "state" and [line.split()[-1] for line in table[2:6]] == \
        ["training", "silent", "finished", "training"]


def test_the_document_shows_the_distinct_groups_of_the_last_rounds_newest_first():
    """Each group once however many members name it, its members with their peers; a record names only groups it
    was in, and one claiming rounds nobody else has moves nothing."""
    records = [record("a", 6, groups=((3, ("a", "b")), (4, ("a", "b")), (5, ("a", "b")))),
               record("b", 6, groups=((4, ("a", "b")), (5, ("a", "b", "c")))),
               record("c", 6, groups=((5, ("a", "b", "c")), (5, ("x", "y")))),  # (x, y): not c's to name
               record("d", 6, groups=((1, ("d",)), (2, ("d",)))),
               record("z", 10**9, groups=((10**9 - 1, ("a", "z")),))]
    groups = build_report("r", records, now=100.0)["groups"]
    assert [(g["round"], g["unit"]) for g in groups] == [(5, 0), (4, 0), (3, 0), (2, 0)]  # MAX_GROUP_ROUNDS
    assert len(groups) == MAX_GROUP_ROUNDS
    assert [[m["node"] for m in group] for group in groups[0]["groups"]] == [["a", "b"], ["a", "b", "c"]]
    assert groups[1]["groups"] == [[{"node": "a", "peer": "peer-a"}, {"node": "b", "peer": "peer-b"}]]
    gone = [{"node": "a", "peer": "peer-a", "round": 2, "state": "left", "groups": [{"round": 1, "unit": 0,
                                                                                      "nodes": ["a", "q"]}]}]
    assert swarm_groups(gone)[0]["groups"] == [[{"node": "a", "peer": "peer-a"}, {"node": "q", "peer": None}]]


def test_a_fragment_row_is_finished_when_all_its_fragments_are_and_names_each_fragments_groups():
    held = [record("n", 4, finished=True, groups=((2, ("m", "n")),)),
            record("n", 4, finished=False, groups=((2, ("n", "o")),), train_losses=((3, 2.0),))]
    for f, r in enumerate(held):
        r.stage, r.num_stages = f, 2
    report = build_report("r", held, now=100.0, num_fragments=2)
    row, = report["peers"]
    assert row["state"] == "training" and row["train_losses"] == [[3, 2.0]]
    assert [(g["round"], g["unit"], [m["node"] for m in g["groups"][0]]) for g in report["groups"]] == \
        [(2, 0, ["m", "n"]), (2, 1, ["n", "o"])]
    held[1].finished = True
    assert build_report("r", held, now=100.0, num_fragments=2)["peers"][0]["state"] == "finished"


# ---- what status --serve remembers ----------------------------------------------------------------------------

def rows(*records: ProgressRecord, now: float = 1000.0) -> list[dict]:
    return build_report("r", list(records), now=now)["peers"]


def test_a_stage_process_whose_record_is_gone_is_shown_as_left_or_finished_for_a_while():
    memory = SwarmMemory()
    now = 1000.0
    shown = memory.update(rows(record("a", 2, time=now - 2), record("b", 2, time=now - 3, finished=True),
                               record("c", 2, time=now - 4), now=now), now)
    assert [(p["node"], p["state"]) for p in shown] == [("a", "training"), ("b", "finished"), ("c", "training")]
    now += 5
    shown = memory.update(rows(record("a", 3, time=now - 1), now=now), now)
    assert [(p["node"], p["state"], p["last_seen_s"]) for p in shown] == \
        [("a", "training", 1.0), ("b", "finished", 8.0), ("c", "left", 9.0)]  # the last seen first
    shown = memory.update(rows(record("a", 3, time=now - 1), record("c", 3, time=now - 1), now=now), now)
    assert [(p["node"], p["state"]) for p in shown] == [("a", "training"), ("c", "training"), ("b", "finished")]
    now = 997.0 + KEEP_GONE_S + 1  # b was last seen at 997, c at 1004
    assert [p["node"] for p in memory.update(rows(record("a", 3, time=now - 1), now=now), now)] == ["a", "c"]
    now = 1004.0 + KEEP_GONE_S + 1
    assert [(p["node"], p["state"]) for p in memory.update([], now)] == [("a", "left")]


def test_at_most_the_last_seen_gone_rows_are_kept():
    memory = SwarmMemory()
    many = [record(f"n{i:03d}", 1, time=100.0 + i) for i in range(MAX_GONE_ROWS + 10)]
    memory.update(rows(*many, now=200.0), 200.0)
    shown = memory.update([], 201.0)
    assert len(shown) == MAX_GONE_ROWS and shown[0]["node"] == f"n{MAX_GONE_ROWS + 9:03d}"
    assert all(p["state"] == "left" for p in shown)


def test_each_stage_process_keeps_its_train_loss_curve_across_reads():
    memory = SwarmMemory()
    first = memory.update(rows(record("a", 2, train_losses=((0, 4.0), (1, 3.5)))), 1000.0)
    assert first[0]["train_losses"] == [[0, 4.0], [1, 3.5]]
    later = memory.update(rows(record("a", 4, train_losses=((1, 3.4), (3, 3.0)))), 1001.0)
    assert later[0]["train_losses"] == [[0, 4.0], [1, 3.4], [3, 3.0]]  # round 0 left the record
    gone = memory.update(rows(record("b", 4)), 1002.0)
    assert (gone[1]["node"], gone[1]["state"], gone[1]["train_losses"]) == ("a", "left", later[0]["train_losses"])
    long = tuple((r, 1.0) for r in range(MAX_PEER_CURVE_POINTS + 40))
    for start in range(0, len(long), 30):
        curve = memory.update(rows(record("b", 4, train_losses=long[start:start + 30])), 1003.0)[0]["train_losses"]
    assert len(curve) == MAX_PEER_CURVE_POINTS and curve[-1][0] == len(long) - 1


# ---- the trainer's side ---------------------------------------------------------------------------------------

class _Stage:
    def __init__(self):
        self.applied_round, self.inner_step, self.unit = -1, 0, Unit.of(0, 1)

    def state_fingerprint(self) -> tuple[str, str]:
        return "f", "sha"


class _Link:
    facts = dict
    record_reads = 0


class _Metrics:
    def write(self, kind: str, **row) -> None: ...


class _Console:
    def on_eval(self, round_index, loss) -> None: ...
    def on_round(self, report) -> None: ...


def test_the_ledger_tells_each_units_groups_the_rounds_mean_train_losses_and_when_it_finished():
    units = [Held(stage=_Stage(), swarm=_Link()), Held(stage=_Stage(), swarm=_Link())]
    ledger = Ledger(units, _Metrics(), TrainSummary("p", "r", 0, 1, num_params=10), _Console(), inner_steps=2,
                    anchor_digest=False, num_rounds=6)
    for r in range(6):
        for loss in (4.0 - r, 3.0 - r, math.nan):
            ledger.note_loss(r, loss)
        for i, unit in enumerate(units):
            unit.stage.applied_round = r
            outcome = RoundOutcome(averaged=r != 2, group_peers=() if r == 2 else (f"m{i}", "n", f"r{r}"))
            ledger.write_rounds([unit], [RoundReport(r, applied_round=r, outcome=outcome)])
        assert units[0].swarm.facts()["finished"] == (r == 5)
    facts = [unit.swarm.facts() for unit in units]
    assert facts[0]["groups"] == ((3, ("m0", "n", "r3")), (4, ("m0", "n", "r4")), (5, ("m0", "n", "r5")))
    assert facts[1]["groups"][-1] == (5, ("m1", "n", "r5"))  # each fragment its own group
    assert facts[0]["train_losses"] == tuple((r, 3.5 - r) for r in range(6))
    no_end = Ledger(units, _Metrics(), TrainSummary("p", "r", 0, 1, num_params=10), _Console(), inner_steps=2,
                    anchor_digest=False)
    assert units[0].swarm.facts()["finished"] is False and no_end.num_rounds is None
