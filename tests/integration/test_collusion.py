"""Issue 49 with real peer processes, DHTs and averagers on 127.0.0.1: identities that averaged honestly with a peer
(and so are believed by it) strike together, vouching for one all-zero state in their signed records and serving it.
Every record check passes (a majority of the peers met vouch for it, it is exactly the state they vouch for); the
honest peers' own check (their held-out loss: ``training/own_check.py``) refuses it, and they train on together.
The same refusals as pure logic: ``tests/unit/test_own_check.py``."""

from __future__ import annotations

import math

import pytest

from tests.integration.test_swarm import applied, events, peer_args, rounds_told, summary

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("kind", ["collude-wipe:2", "collude-end:2"])
def test_colluders_met_in_groups_cannot_wipe_or_end_an_honest_peers_model(tmp_path, processes, bootstrap, kind):
    """Two honest peers and two colluders average together for rounds 0-1 (so each honest peer believes all three
    others); from round 2 the colluders' records claim 3 rounds more (``collude-wipe``) or the run's end
    (``collude-end``), both vouching for the same all-zero state, which is what they serve. Before the own check an
    honest peer reloaded it (or took it as the final state and stopped training). Now: the honest peers refuse it,
    train every round, never reload, hold one anchor after every round they averaged together, and learn."""
    rounds, H = 8, 10
    honest, colluders = ("h0", "h1"), ("c0", "c1")
    patient = ["--averaging.target_group_size", "4", "--averaging.matchmaking_time_s", "8",
               "--averaging.request_timeout_s", "5", "--averaging.round_timeout_s", "40",
               "--averaging.next_chunk_timeout_s", "15", "--train.state_timeout_s", "30"]
    for name in honest:
        processes.start(name, *peer_args(tmp_path, name, bootstrap, "collude", rounds, H, *patient, wait_for=4))
    for name in colluders:
        processes.start_hostile(name, kind, *peer_args(tmp_path, name, bootstrap, "collude", rounds, H, *patient,
                                                       wait_for=4))
    for name in honest:
        assert processes.wait(name, timeout=280) == 0, processes.log(name)[-4000:]
    for name in colluders:  # they train on, honestly but for their records and the state they serve
        assert processes.wait(name, timeout=120) == 0, processes.log(name)[-4000:]

    for name in honest:
        s = summary(tmp_path, name)
        log = processes.log(name)
        assert s["reloads"] == 0 and s["rounds_completed"] == rounds, (s, rounds_told(tmp_path, name))
        assert "refused a state" in log, log[-4000:]
        # nothing of theirs taken: a resync is the honest peers' own agreement (the end's one final state)
        assert all(e["action"] == "resync" and e["donor_round"] <= rounds for e in events(tmp_path, name, "sync")), \
            events(tmp_path, name, "sync")
        assert math.isfinite(s["eval_loss_final"]) and s["eval_loss_final"] < s["eval_loss_start"] - 0.3, s
        early = [e for e in applied(tmp_path, name) if e["applied_round"] < 2]
        assert early and all(e["averaged"] for e in early), rounds_told(tmp_path, name)  # trust earned honestly
    assert summary(tmp_path, "h0")["anchor_sha256"] == summary(tmp_path, "h1")["anchor_sha256"], \
        (rounds_told(tmp_path, "h0"), rounds_told(tmp_path, "h1"))
    other = summary(tmp_path, "h1")["peer"]  # and they averaged with each other after the strike
    after = [e for e in applied(tmp_path, "h0") if e["applied_round"] >= 2]
    if kind.startswith("collude-wipe"):
        assert any(e["averaged"] and other in e["group_peers"] for e in after), rounds_told(tmp_path, "h0")
    # collude-end: not always. The colluders' records name the run's last round, and a believed record ahead ends
    # the rounds of one honest peer early: in a quarter of the runs (CI at c1f9452, 1 of 4 here) it ran 2 rounds
    # ahead of the other, which then found every round "moved past" and fell back until the end, where the two take
    # one final state (asserted above). A liveness cost of the attack that is still open (docs/threat-model.md 6)
    # (a round's anchor can differ between them where one fell back in an earlier round: a fresh-clone run had the
    # two off by one round around the strike, mended by a resync; what must hold is the final model, above)
