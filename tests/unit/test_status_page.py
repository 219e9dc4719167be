"""What `status --serve` shows: the progress records' fields for it (eval losses, bytes sent, rounds averaged, bans:
optional, bounded, filled in by the trainer's ledger), the report's eval-loss curve, and the page's HTTP server
(its document, its headers). No DHT; the server listens on 127.0.0.1. The page in a real browser, next to a real
swarm: tests/integration/test_status_page.py."""

from __future__ import annotations

import json
import math
import re
import socket
import urllib.error
import urllib.request

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic.v1 import ValidationError

from p2p_diloco.cli.status_report import build_report
from p2p_diloco.cli.status_serve import Watcher
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.monitoring.web import StatusPage, content_security_policy, page_html
from p2p_diloco.round.outcome import RoundOutcome, RoundReport
from p2p_diloco.swarm.averaging.guard import FORGED, REPORTED_BANS, PeerGuard
from p2p_diloco.swarm.discovery.progress import ProgressRecord, shown_facts
from p2p_diloco.swarm.discovery.records import (
    MAX_BANS_SHOWN,
    MAX_EVALS_SHOWN,
    MAX_REASON_CHARS,
    MAX_RECORD_VALUE_BYTES,
    ProgressSchema,
    ProgressValue,
    RunSchemaValidator,
)
from p2p_diloco.training.ledger import Held, Ledger
from p2p_diloco.training.summary import TrainSummary

PEER = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"  # a peer id's length: 52 characters
OLD_RECORD = {"peer": "QmPeer", "node": "QmNode", "stage": 0, "num_stages": 1, "round": 3, "inner_step": 30,
              "tokens_per_s": 100.0, "loss": 2.5, "time": 1000.0, "applied_round": 2, "anchor": "ab"}


def value(**changes) -> dict:
    return dict(OLD_RECORD, **changes)


def record(node: str, round_: int, evals=(), **changes) -> ProgressRecord:
    return ProgressRecord(peer=node, stage=0, num_stages=1, round=round_, inner_step=10 * round_, tokens_per_s=10.0,
                          loss=2.0, time=99.0, node=node, eval_losses=tuple(evals), **changes)


# ---- the record's new fields ---------------------------------------------------------------------------------

def schema_accepts(progress_value: dict) -> bool:
    """What every node's schema validator (hivemind's SchemaValidator, for the run's progress key) says of a value."""
    validator = RunSchemaValidator(ProgressSchema, "r")
    return validator.validate(DHTRecord(key=DHTID.generate(source="r_progress").to_bytes(),
                                        subkey=DHTProtocol.serializer.dumps(b"[owner:key]"),
                                        value=DHTProtocol.serializer.dumps(progress_value),
                                        expiration_time=get_dht_time() + 60))


def test_an_older_peers_record_without_the_new_fields_is_stored_and_parses():
    """hivemind's validator refuses a value that parses to anything else than what was sent: the optional fields a
    writer left out must not come back as defaults."""
    assert schema_accepts(OLD_RECORD)
    parsed = ProgressValue.parse_obj(OLD_RECORD)
    assert (parsed.eval_losses, parsed.bytes_sent, parsed.rounds_averaged, parsed.bans) == ([], 0, 0, [])
    assert schema_accepts(value(**shown_facts(record("n", 3, [(1, 2.0)], bans=((PEER, "why"),)))))
    assert not schema_accepts(value(eval_losses=[[1, math.nan]]))


@pytest.mark.parametrize("changes", [
    {"eval_losses": [[1, math.nan]]},
    {"eval_losses": [[1, math.inf]]},
    {"eval_losses": [[-1, 2.0]]},
    {"eval_losses": [[1, 2.0]] * (MAX_EVALS_SHOWN + 1)},
    {"eval_losses": [[1, "2.0"]]},
    {"eval_losses": [[1, 2.0, 3.0]]},
    {"bytes_sent": 2**63},
    {"bytes_sent": -1},
    {"bytes_sent": 1.5},
    {"rounds_averaged": "3"},
    {"bans": [[PEER, "x"]] * (MAX_BANS_SHOWN + 1)},
    {"bans": [[PEER, "x" * (MAX_REASON_CHARS + 1)]]},
    {"bans": [[PEER, "line\nbreak"]]},
    {"bans": [[PEER, "caf\u00e9"]]},
    {"bans": [["<img src=x>", "why"]]},
    {"bans": [[PEER]]},
    {"bans": {"peer": "why"}},
])
def test_a_malformed_or_oversized_new_field_refuses_the_record(changes):
    with pytest.raises(ValidationError):
        ProgressValue.parse_obj(value(**changes))


def test_the_largest_record_fits_the_dht_bound_and_markup_in_a_reason_is_just_text():
    """The fields at their bounds keep a signed record under MAX_RECORD_VALUE_BYTES (a signature and its framing
    take under 1 KiB); a reason may hold markup (printable ASCII): the page shows it as text."""
    largest = value(eval_losses=[[2**62, 1e308]] * MAX_EVALS_SHOWN, bytes_sent=2**62, rounds_averaged=2**62,
                    bans=[["Q" * 128, "<script>" + "x" * (MAX_REASON_CHARS - 8)]] * MAX_BANS_SHOWN,
                    peer="P" * 128, node="N" * 128, anchor="f" * 128, prior_anchor="f" * 128)
    parsed = ProgressValue.parse_obj(largest).dict()
    assert parsed["bans"][0][1].startswith("<script>")
    assert len(DHTProtocol.serializer.dumps(parsed)) + 1024 < MAX_RECORD_VALUE_BYTES


def test_what_the_trainer_noted_is_cut_to_what_the_schema_accepts():
    """A record the schema refuses is stored by nobody, and its peer would vanish from the others' round timing:
    whatever the ledger noted, publish_progress sends fields that pass."""
    noted = record("QmNode", 3, evals=[(r, 2.0 if r != 5 else math.nan) for r in range(50)] + [(-1, 1.0)],
                   bytes_sent=2**70, rounds_averaged=-3,
                   bans=tuple((f"Qm{i}", "why \u00e9\n" + "y" * 400) for i in range(30)) + (("bad id!", "x"),))
    facts = shown_facts(noted)
    parsed = ProgressValue.parse_obj(value(**facts)).dict()
    assert [r for r, _ in parsed["eval_losses"]] == list(range(18, 50))  # the last 32 finite ones
    assert (parsed["bytes_sent"], parsed["rounds_averaged"]) == (2**62, 0)
    assert [peer for peer, _ in parsed["bans"]] == [f"Qm{i}" for i in range(14, 30)]
    assert parsed["bans"][0][1].startswith("why ??yyy") and len(parsed["bans"][0][1]) == MAX_REASON_CHARS


FIELD_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**64, max_value=2**64),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=300)),
    lambda inner: st.lists(inner, max_size=40), max_leaves=60)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(evals=FIELD_VALUES, sent=FIELD_VALUES, averaged=FIELD_VALUES, bans=FIELD_VALUES)
def test_any_new_field_is_refused_or_gives_a_strict_json_report(evals, sent, averaged, bans):
    try:
        parsed = ProgressValue.parse_obj(value(eval_losses=evals, bytes_sent=sent, rounds_averaged=averaged,
                                               bans=bans)).dict()
    except ValidationError:
        return
    assert len(parsed["eval_losses"]) <= MAX_EVALS_SHOWN and len(parsed["bans"]) <= MAX_BANS_SHOWN
    found = ProgressRecord(**dict(parsed, eval_losses=tuple(parsed["eval_losses"]), bans=tuple(parsed["bans"])))
    json.dumps(build_report("r", [found], now=1000.0), allow_nan=False)


# ---- the report ---------------------------------------------------------------------------------------------

def test_the_report_shows_each_processes_facts_and_the_swarms_median_eval_curve():
    """Per round, the lower median of the losses the processes report; rounds past the lower median of the
    processes' rounds are left out, so one record claiming rounds (and losses) nobody else has moves nothing."""
    honest = [record("a", 3, [(0, 4.0), (1, 3.5), (2, 3.0), (3, 2.6)], bytes_sent=1000, rounds_averaged=3,
                     bans=(("QmBad", "offences in rounds [1, 2]"),)),
              record("b", 3, [(0, 4.0), (1, 3.4), (2, 3.1), (3, 2.5)], bytes_sent=2000, rounds_averaged=2),
              record("c", 2, [(0, 4.0), (2, 3.2)])]
    liar = record("z", 10**9, [(1, 1e300), (2, -5.0), (10**9, 0.0)], bytes_sent=2**62)
    report = build_report("r", honest + [liar], now=100.0)
    assert report["eval_curve"] == [[0, 4.0], [1, 3.5], [2, 3.0], [3, 2.5]]  # each an honest value
    by_node = {p["node"]: p for p in report["peers"]}
    assert (by_node["a"]["eval_round"], by_node["a"]["eval_loss"], by_node["a"]["rounds_averaged"]) == (3, 2.6, 3)
    assert by_node["a"]["bans"] == [{"peer": "QmBad", "reason": "offences in rounds [1, 2]"}]
    assert by_node["c"]["bytes_sent"] == 0 and by_node["c"]["bans"] == []
    assert report["bytes_sent_total"] == 3000 + 2**62
    no_evals = build_report("r", [record("a", 1)], now=100.0)
    assert no_evals["eval_curve"] == [] and no_evals["peers"][0]["eval_loss"] is None


def test_a_fragment_row_takes_its_eval_loss_from_the_last_fragment_and_its_bans_from_all():
    held = [record("n", 2, (), bans=(("QmX", "stalls"),)), record("n", 2, [(2, 3.0)], bans=(("QmY", "forged"),))]
    for f, r in enumerate(held):
        r.stage, r.num_stages = f, 2
    report = build_report("r", held, now=100.0, num_fragments=2)
    row, = report["peers"]
    assert (row["eval_loss"], row["fragments"]) == (3.0, [0, 1])
    assert row["bans"] == [{"peer": "QmX", "reason": "stalls"}, {"peer": "QmY", "reason": "forged"}]
    assert report["eval_curve"] == [[2, 3.0]]


def test_the_served_curve_keeps_rounds_across_reads():
    watcher = Watcher(load_config(None, []), timeout_s=5.0)
    assert watcher._curve([[0, 4.0], [1, 3.5]]) == [[0, 4.0], [1, 3.5]]
    assert watcher._curve([[1, 3.4], [5, 2.0]]) == [[0, 4.0], [1, 3.4], [5, 2.0]]  # round 0 left the records


# ---- the trainer's side -----------------------------------------------------------------------------------------

class _Link:
    facts = dict


class _Metrics:
    def __init__(self):
        self.rows = []

    def write(self, kind: str, **row) -> None:
        self.rows.append((kind, row))


class _Console:
    def on_eval(self, round_index, loss) -> None: ...
    def on_round(self, report) -> None: ...


def test_the_ledger_tells_the_records_its_evals_bytes_rounds_and_bans():
    links = [_Link(), _Link()]
    summary = TrainSummary("p", "r", 0, 1, num_params=10)
    ledger = Ledger([Held(stage=None, swarm=link) for link in links], _Metrics(), summary, _Console(),
                    inner_steps=5, anchor_digest=False)
    assert links[0].facts() == {"eval_losses": (), "bytes_sent": 0, "rounds_averaged": 0, "bans": (), "groups": (),
                                "train_losses": (), "finished": False}
    ledger.note_eval(0, 0, 4.0, first=True)
    ledger.note_eval(1, 5, None)  # not the last stage: nothing to show
    for r in range(1, MAX_EVALS_SHOWN + 3):
        ledger.note_eval(r, 5 * r, 4.0 - r / 100)
    outcome = RoundOutcome(averaged=True, group_size=2, group_peers=("a", "b"), bytes_sent=700,
                           ban_reasons={f"Qm{i}": f"why {i}" for i in range(MAX_BANS_SHOWN + 2)})
    ledger.account([RoundReport(0, applied_round=0, outcome=outcome)])
    facts = links[1].facts()
    assert facts["eval_losses"][-1] == (MAX_EVALS_SHOWN + 2, 4.0 - (MAX_EVALS_SHOWN + 2) / 100)
    assert len(facts["eval_losses"]) == MAX_EVALS_SHOWN and summary.eval_loss_start == 4.0
    assert (facts["bytes_sent"], facts["rounds_averaged"]) == (700, 1)
    assert facts["bans"][-1] == (f"Qm{MAX_BANS_SHOWN + 1}", f"why {MAX_BANS_SHOWN + 1}")
    assert len(facts["bans"]) == MAX_BANS_SHOWN
    noted = record("n", 3, facts["eval_losses"], bytes_sent=700, rounds_averaged=1, bans=facts["bans"])
    ProgressValue.parse_obj(value(**shown_facts(noted)))


def test_the_guard_reports_why_it_banned_its_last_peers():
    guard = PeerGuard(ban_after=1)
    for i in range(REPORTED_BANS + 3):
        guard.record(7, f"Qm{i}", FORGED)
    reasons = guard.report(7).ban_reasons
    assert len(reasons) == REPORTED_BANS and list(reasons)[-1] == f"Qm{REPORTED_BANS + 2}"
    assert reasons["Qm3"] == "offences in rounds [7] (forged record in round 7)"


# ---- the page's server ------------------------------------------------------------------------------------------

def get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_page_and_its_document_are_served_with_a_policy_that_runs_only_the_pages_own_script():
    page = StatusPage("127.0.0.1", 0)
    try:
        status, headers, body = get(page.url)
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8" and body == page_html().encode()
        policy = headers["Content-Security-Policy"]
        assert policy == content_security_policy(page_html()) and "default-src 'none'" in policy
        assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]{44}'; ", policy)  # the one inline script, no other
        assert "http" not in page_html().replace(SVG_NAMESPACE, "")  # nothing fetched from elsewhere
        assert json.loads(get(page.url + "api/status")[2]) == {}
        page.update({"run_id": "r", "peers": [{"bans": [{"reason": "<script>"}]}]})
        status, headers, body = get(page.url + "api/status")
        assert (status, headers["Content-Type"]) == (200, "application/json")
        assert json.loads(body)["peers"][0]["bans"][0]["reason"] == "<script>"
        page.update({"loss": math.nan})  # never invalid JSON for the page: an error instead
        assert "could not be encoded" in json.loads(get(page.url + "api/status")[2])["error"]
        assert get(page.url + "nothing")[0] == 404
        request = urllib.request.Request(page.url + "api/status", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405
    finally:
        page.close()


SVG_NAMESPACE = "http://www.w3.org/2000/svg"


def test_a_port_in_use_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"--serve: cannot serve on 127.0.0.1:\d+"):
            StatusPage("127.0.0.1", taken.getsockname()[1])
