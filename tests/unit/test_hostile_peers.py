"""Unit tests of the hostile test peers themselves (tests/hostile): every kind parses, the state kinds serve and
record what they claim, colluders vouch for one forged state, and the launcher refuses what it cannot run. The
kinds' attacks against real averagers: tests/integration/test_byzantine.py, test_hostile_leader.py, test_collusion.py.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.round.position import Position
from p2p_diloco.swarm.averaging.server import AveragingServer
from tests.hostile import KINDS, TINY_CLOCK_S, parse_hostility
from tests.hostile.base import HostileServer
from tests.hostile.peer import main, one_process
from tests.hostile.state import (
    COLLUDE_AHEAD,
    CollusionLink,
    CollusionState,
    FalseStateLink,
    PoisonedMomentum,
    ShiftedState,
    TinyClock,
)

SHAPES = [(2, 3), (4,)]
ANCHOR = [torch.ones(shape) for shape in SHAPES]
MOMENTUM = [torch.full(shape, 0.5) for shape in SHAPES]
META = {"round": 5, "applied_round": 4, "outer_steps": 5, "inner_step": 52, "round_start_step": 50,
        "seconds_per_step": 0.1}


def part(cls, spec: str, **state):
    """A hostile part with no process, DHT or network, only its hostility and ``state``: a link made without its
    ``__init__``, a stand-in for a server (an averager made so would end in hivemind's ``__del__``)."""
    hostility = parse_hostility(spec)
    hostility.shapes, hostility.inner_steps, hostility.num_rounds = SHAPES, 10, 8
    if issubclass(cls, AveragingServer):
        return SimpleNamespace(hostility=hostility, **state)
    obj = cls.__new__(cls)
    vars(obj).update(state, hostility=hostility)
    return obj


def test_every_kind_parses_at_its_default_and_replaces_some_part():
    for kind, parts in KINDS.items():
        hostility = parse_hostility(kind)
        assert (hostility.kind, hostility.value) == (kind, parts.default)
        assert parts.averager or parts.server or parts.runner or parts.link, kind


def test_hostile_servers_answer_under_the_honest_servers_handler_names():
    assert HostileServer.__name__ == ShiftedState.__name__ == AveragingServer.__name__


def test_the_state_kinds_serve_what_they_claim():
    served = ShiftedState._served(part(ShiftedState, "false-state:1"), META, ANCHOR + MOMENTUM)[1]
    assert all(torch.equal(s, a + 1) for s, a in zip(served[:2], ANCHOR)) and served[2:] == MOMENTUM
    served = PoisonedMomentum._served(part(PoisonedMomentum, "poison-momentum:4"), META, ANCHOR + MOMENTUM)[1]
    assert served[:2] == ANCHOR and all(torch.equal(s, 4 * a) for s, a in zip(served[2:], ANCHOR))
    meta, tensors = TinyClock._served(part(TinyClock, "tiny-clock"), META, ANCHOR + MOMENTUM)
    assert meta["seconds_per_step"] == TINY_CLOCK_S > 0 and tensors == ANCHOR + MOMENTUM


def test_a_false_state_link_claims_rounds_ahead():
    link = part(FalseStateLink, "false-state:3", anchor_fingerprint="a", prior_anchor_fingerprint="p")
    assert link._progress_told(Position(round=5, inner_step=52, applied_round=4)) == (8, 7, "a", "p")


@pytest.mark.parametrize("spec, told", [("collude-wipe:3", (3 + COLLUDE_AHEAD, 2 + COLLUDE_AHEAD)),
                                        ("collude-end:3", (8, 7))])
def test_colluders_are_honest_until_their_round_then_vouch_for_the_zero_state_they_serve(spec, told):
    link = part(CollusionLink, spec, anchor_fingerprint="a", prior_anchor_fingerprint="p")
    state = part(CollusionState, spec)
    early = dict(META, round=2, applied_round=1)
    assert link._progress_told(Position(round=2, inner_step=22, applied_round=1)) == (2, 1, "a", "p")
    assert CollusionState._served(state, early, ANCHOR + MOMENTUM) == (early, ANCHOR + MOMENTUM)

    told_round, applied, fingerprint, prior = link._progress_told(Position(round=3, inner_step=32, applied_round=2))
    assert (told_round, applied, prior) == (*told, "")
    meta, tensors = CollusionState._served(state, dict(META, round=3, applied_round=2), ANCHOR + MOMENTUM)
    assert (meta["round"], meta["applied_round"], meta["outer_steps"]) == (*told, told[1] + 1)
    assert meta["inner_step"] == meta["round_start_step"] == told[0] * 10
    assert all(not t.any() for t in tensors) and [tuple(t.shape) for t in tensors] == SHAPES * 2
    # the fingerprint in their records is that of the state they serve: every colluder's votes confirm it
    from p2p_diloco.round.swarm_state import anchor_digest, state_fingerprint

    anchor, momentum = tensors[:2], tensors[2:]
    assert fingerprint == state_fingerprint(anchor_digest(anchor), momentum, meta["applied_round"], meta["outer_steps"])


def test_the_launcher_refuses_what_it_cannot_run(capsys):
    assert main(["scale:10"]) == 2 and "usage" in capsys.readouterr().err
    assert main(["explode", "--", "--model.preset", "tiny"]) == 2 and "unknown kind" in capsys.readouterr().err
    assert one_process(["--model.preset", "tiny"]) and not one_process(["--stages", "2"])
    assert main(["nan", "--", "peer", "--replicas", "2"]) == 2 and "one process" in capsys.readouterr().err


def test_no_honest_module_knows_the_hostile_peers():
    """Hostile peers are test code: nothing in p2p_diloco imports tests.hostile (or any test module)."""
    for path in Path(__file__).resolve().parents[2].joinpath("p2p_diloco").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.split(".")[0] == "tests" for name in names), path
