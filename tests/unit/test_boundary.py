"""What crosses between a unit's training process and its averaging process (swarm/averaging/boundary.py)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from hivemind.utils import MSGPackSerializer

from p2p_diloco.hivemind_adapter.averaging import AveragingMode
from p2p_diloco.swarm.averaging.boundary import Flags, GroupResult, OwnRecord, RoundClaim
from p2p_diloco.swarm.averaging.gathered import decode_record
from p2p_diloco.swarm.averaging.server import AveragingServer

PROPOSAL = {"rank": 8, "bits": 8, "q_round": -1}


def test_a_claim_crosses_as_a_plain_dict_and_comes_back_the_same():
    claim = RoundClaim(3, 128.0, 2.5)
    gathered = MSGPackSerializer.loads(MSGPackSerializer.dumps(claim.to_gather()))
    assert RoundClaim.from_gather(gathered) == claim


def test_the_completed_record_is_the_wire_record_groupmates_accept():
    own = OwnRecord(dict(PROPOSAL), bandwidth_mbit=100.0)
    record = own.record(RoundClaim(3, 128.0, 2.5))
    assert list(record) == ["round", "tokens", "compute_s", "bandwidth_mbit", "compression", "last_error"]
    user = MSGPackSerializer.dumps(record)
    mode, read = decode_record(MSGPackSerializer.dumps([100.0, AveragingMode.NODE.value, user]))
    assert read == record and mode == AveragingMode.NODE


def test_the_averaging_process_keeps_the_proposal_error_and_bandwidth_from_round_to_round():
    own = OwnRecord(dict(PROPOSAL), bandwidth_mbit=100.0)
    own.averaged({"compression_error": 0.25, "bandwidth_mbit": None}, {"rank": 4, "bits": 8, "q_round": 3})
    assert (own.proposal["rank"], own.last_error, own.bandwidth_mbit) == (4, 0.25, 100.0)  # no sample: kept
    own.averaged({"compression_error": 0.5, "bandwidth_mbit": 50.0}, dict(PROPOSAL))
    assert (own.last_error, own.bandwidth_mbit) == (0.5, 75.0)  # half the old, half the new sample
    assert own.record(RoundClaim(4, 1.0, 0.0))["last_error"] == 0.5


def test_an_honest_server_gathers_its_claim_completed_as_it_is():
    own = OwnRecord(dict(PROPOSAL), bandwidth_mbit=10.0)
    claim = RoundClaim(1, 64.0, 1.0)
    assert AveragingServer._record(SimpleNamespace(own=own), claim) == own.record(claim)  # no process, no DHT


def test_results_and_flags_survive_the_pipe():
    for value in (GroupResult({"peer": {"round": 1}}, 64.0, {"rank": 0}), Flags({"p": ["clipped"]}, ["q"], {"q": "x"})):
        assert pickle.loads(pickle.dumps(value)) == value
