"""`p2p-diloco status --serve` in a real headless browser (Chromium from the OS packages, its own headless mode):
the page of a small swarm shows every peer with its state, the swarm's eval-loss curve, each peer's train-loss curve
and the groups of the last rounds, and a hostile record or document is shown as text, never run, without hiding the
other peers. Skipped, naming the package, where Chromium is missing
(`.ci/run` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from p2p_diloco.monitoring.web import StatusPage
from tests.integration.conftest import LOOPBACK, Processes
from tests.integration.test_swarm import peer_args

pytestmark = pytest.mark.timeout(240)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs a headless browser: install the OS package chromium (apt-get install chromium)")
TITLE = "p2p-diloco status"
HOSTILE_REASON = "<script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\">"


def browse(url: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its script has run (and read its document) for a few seconds of the page's time; with
    ``screenshot``, a PNG of the page too."""
    shot = [f"--screenshot={screenshot}", "--window-size=1200,900"] if screenshot else []
    done = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=4000",
                           *shot, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Page(HTMLParser):
    """What a dumped DOM shows: the peer rows (class -> text), the title, the state line, the elements by tag, the
    groups ((round, [member nodes]) and the members' texts) and the peers' train-loss curves (node -> points)."""

    def __init__(self, dom: str):
        super().__init__()
        self.rows: list[dict] = []
        self.tags: dict[str, int] = {}
        self.texts: dict[str, str] = {}  # element id -> its text
        self.curve_points = None
        self.groups: list[tuple[str, list[str]]] = []
        self.members: list[str] = []
        self.peer_curves: dict[str, int] = {}
        self._open: list[tuple[str, str]] = []  # (tag, the key its text goes to)
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        key = ""
        if tag == "tr" and attrs.get("class") == "peer":
            self.rows.append({"node": attrs.get("data-node")})
        elif tag == "td" and self.rows and (attrs.get("class") or "").startswith("c-"):
            key = "row:" + attrs["class"][2:]
            self.rows[-1][key[4:]] = ""
        elif tag == "ul" and attrs.get("class") == "group":
            self.groups.append((attrs.get("data-round"), []))
        elif tag == "li" and attrs.get("class") == "member" and self.groups:
            self.groups[-1][1].append(attrs.get("data-node"))
            self.members.append("")
            key = "member"
        elif tag == "polyline" and attrs.get("class") == "peer-curve":
            self.peer_curves[attrs.get("data-node")] = int(attrs.get("data-points"))
        elif attrs.get("id") in ("state", "run") or (tag == "title" and "title" not in self.texts):  # not an SVG's
            key = "id:" + (attrs.get("id") or tag)
            self.texts[key[3:]] = ""
        if attrs.get("id") == "curve":
            self.curve_points = int(attrs.get("data-points", "0"))
        self._open.append((tag, key or (self._open[-1][1] if self._open else "")))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass

    def handle_data(self, data):
        key = self._open[-1][1] if self._open else ""
        if key.startswith("row:"):
            self.rows[-1][key[4:]] += data
        elif key.startswith("id:"):
            self.texts[key[3:]] += data
        elif key == "member":
            self.members[-1] += data


def assert_nothing_ran(dom: str, page: Page) -> None:
    assert page.texts["title"] == TITLE and page.tags.get("script") == 1 and "img" not in page.tags, dom[-3000:]


@needs_chromium
def test_a_hostile_document_is_shown_as_text_and_the_other_rows_still_show(tmp_path):
    """Markup in every string, rows, points, states and groups of the wrong types: the page runs none of it, skips
    what it cannot show, and shows the well-formed row, curve and group."""
    hostile = {"run_id": "<b>run</b>", "num_peers": {"x": 1}, "error": None, "read_at": "soon",
               "peers": [{"peer": "QmGood", "node": "good", "stage": 0, "num_stages": 1, "round": 3, "inner_step": 15,
                          "tokens_per_s": 1234.4, "loss": 2.51234, "eval_loss": 2.6, "rounds_averaged": 3,
                          "bytes_sent": 2_500_000, "last_seen_s": 4.2, "state": "finished",
                          "train_losses": [[0, 4.0], [1, "x"], None, "<img>", [2, 3.0], [3, 1e308, 1]],
                          "bans": [{"peer": "QmBad", "reason": HOSTILE_REASON}, "<i>x</i>", None]},
                         None, 7, "<img src=x>", [1, 2],
                         {"peer": {"o": 1}, "node": ["<img src=x>"], "round": 1e308, "bans": "<img src=x>",
                          "fragments": "abc", "bytes_sent": -5, "state": HOSTILE_REASON, "train_losses": "<img>"},
                         {"node": "x" * 10_000, "eval_loss": "NaN", "tokens_per_s": "<img src=x>",
                          "state": ["finished"], "train_losses": [[0, {"v": 1}], [1, 2.0]]}],
               "eval_curve": [[0, 4.0], [1, "x"], None, "<img>", [2, 3.0, 5], [3, 2.5]],
               "groups": [None, "<img src=x>", {"round": "3", "groups": [[{"node": "a"}]]}, {"round": 2, "groups": "x"},
                          {"round": 3, "unit": "<b>", "groups": [
                              [{"node": "<script>document.title='owned'</script>", "peer": HOSTILE_REASON},
                               {"node": "good", "peer": "QmGood"}, "<img src=x>", None, [1]],
                              "<img src=x>", {"node": "x"}]}]}
    page = StatusPage("127.0.0.1", 0)
    try:
        page.update(hostile)
        dom = browse(page.url, tmp_path)
    finally:
        page.close()
    shown = Page(dom)
    assert_nothing_ran(dom, shown)
    assert shown.texts["run"] == "<b>run</b>" and "&lt;script&gt;document.title" in dom
    good, odd, long = shown.rows
    assert (good["node"], good["round"], good["tokens"], good["loss"], good["sent"]) == \
        ("good", "3", "1,234", "2.512", "2.5 MB")
    assert good["bans"] == "QmBad: " + HOSTILE_REASON  # as text; the ban entries that are not objects left out
    assert (odd["peer"], odd["round"], odd["stage"], odd["bans"], odd["sent"]) == ("-", "1e+308", "-/-", "-", "-")
    assert len(long["node"]) == 203 and long["eval-loss"] == "-" and long["tokens"] == "-"
    assert shown.curve_points == 3
    assert (good["state"], odd["state"], long["state"]) == ("finished", HOSTILE_REASON, "-")
    assert shown.peer_curves == {"good": 3, "x" * 200 + "...": 1}  # the points of the right types only
    assert shown.groups == [("3", ["<script>document.title='owned'</script>", "good"])]
    assert shown.members == ["..." + HOSTILE_REASON[-8:], "QmGood"]  # short names, as text


def http_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for_document(url: str, ready, timeout_s: float, proc) -> dict:
    deadline = time.monotonic() + timeout_s
    document: dict = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"status --serve exited with {proc.returncode}"
        document = http_json(url)
        if ready(document):
            return document
        time.sleep(1.0)
    raise AssertionError(f"the page's document was not ready within {timeout_s} s: {json.dumps(document)[:3000]}")


@needs_chromium
def test_the_page_of_a_small_swarm_shows_its_peers_and_eval_curve_and_a_hostile_record_as_text(
        tmp_path, processes: Processes, bootstrap):
    """Two tiny peers train 2 rounds next to a signed record whose ban reason is markup and whose numbers are at
    the schema's bounds; the page, read by Chromium, shows both peers as the JSON endpoint has them, finished, with
    a train-loss curve each and the group they averaged in, the swarm's eval loss after rounds 0-2, the hostile
    record's reason and claimed group as text, and runs no script but its own."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.config import DHTConfig
    from p2p_diloco.swarm import ProgressRecord, publish_progress, start_dht
    from p2p_diloco.swarm.discovery.records import run_record_validators

    run = "web-status"
    status = processes.start("status", "status", "--initial-peers", *bootstrap, "--run-id", run, "--serve", "0")
    for name in ("p0", "p1"):
        processes.start(name, *peer_args(tmp_path, name, bootstrap, run, 2, 5, wait_for=2))
    for name in ("p0", "p1"):
        assert processes.wait(name, timeout=150) == 0, processes.log(name)[-3000:]
    # (written once the peers are done: a stranger's record that never reaches the final anchor keeps the peers
    # holding it at the end of the run for round_timeout_s, as it should; the bootstrap node keeps theirs)
    hostile = start_dht(DHTConfig(host_maddrs=[LOOPBACK], initial_peers=bootstrap),
                        record_validators=run_record_validators(run))
    hostile_node = hostile.peer_id.to_base58()
    try:
        publish_progress(hostile, run, ProgressRecord(
            peer="QmHostile", stage=0, num_stages=1, round=1, inner_step=5, tokens_per_s=1e300, loss=1e300,
            time=get_dht_time(), eval_losses=((1, 1e300), (2**62, -1e300)), bytes_sent=2**62,
            rounds_averaged=10**15, bans=(("QmSomeone", HOSTILE_REASON),),
            groups=((1, (hostile_node, "QmFake")),), train_losses=((0, 1e300), (1, -1e300))), ttl_s=300)
        url = re.search(r"(http://127\.0\.0\.1:\d+/)", processes.log("status")).group(1)

        def ready(document: dict) -> bool:
            honest = [p for p in document.get("peers", []) if p["peer"] != "QmHostile"]
            return len(document["peers"]) == 3 and len(honest) == 2 and all(
                p["eval_round"] == 2 and p["rounds_averaged"] >= 1 and p["state"] == "finished" for p in honest)

        document = wait_for_document(url + "api/status", ready, 60, status)
        dom = browse(url, tmp_path, screenshot=tmp_path / "status-page.png")
    finally:
        hostile.shutdown()
    shown = Page(dom)
    assert_nothing_ran(dom, shown)
    by_node = {row["node"]: row for row in shown.rows}
    assert set(by_node) == {p["node"] for p in document["peers"]}
    for peer in document["peers"]:
        row = by_node[peer["node"]]
        assert (row["round"], row["rounds-averaged"]) == (str(peer["round"]), str(peer["rounds_averaged"]))
        if peer["peer"] != "QmHostile":
            assert row["eval-loss"] == f"{peer['eval_loss']:.3f}" and peer["bytes_sent"] > 0, row
            assert re.fullmatch(r"[0-9.]+ (B|KB|MB|GB)", row["sent"]), row
        else:
            assert row["bans"] == "QmSomeone: " + HOSTILE_REASON
    assert [r for r, _ in document["eval_curve"]] == [0, 1, 2] and shown.curve_points == 3
    honest = sorted(p["node"] for p in document["peers"] if p["peer"] != "QmHostile")
    assert {by_node[node]["state"] for node in honest} == {"finished"}
    assert by_node[hostile_node]["state"] == "training"
    # who averaged with whom: both peers in one group (each averaged a round, and a group has two at least)
    together = [r for r, nodes in shown.groups if sorted(nodes) == honest]
    assert together and all(p["groups"] for p in document["peers"] if p["peer"] != "QmHostile"), document["groups"]
    assert ("1", sorted([hostile_node, "QmFake"])) in shown.groups  # a claim of its own group, shown as such
    # a train-loss curve per stage process: each honest peer's rounds 0 and 1 (the hostile record's 2 points too)
    for peer in document["peers"]:
        assert shown.peer_curves[peer["node"]] == len(peer["train_losses"]) >= 2, (peer, shown.peer_curves)
    assert "3 peer(s), 3 stage process(es)" in shown.texts["state"]
    assert (tmp_path / "status-page.png").stat().st_size > 10_000
