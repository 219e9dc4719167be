"""The round package's two interfaces to the network (round/averager.py): the swarm's averager and the simulator
implement RoundAverager, the swarm's records implement RoundRecords, each with the parameters the round calls them
with; a stage reads its records only through that interface; and the round package imports nothing that imports
hivemind."""

from __future__ import annotations

import inspect
import pkgutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import p2p_diloco.round
from p2p_diloco.config import DiLoCoConfig, InnerConfig
from p2p_diloco.round.averager import RoundAverager, RoundRecords
from p2p_diloco.round.outcome import RoundOutcome
from p2p_diloco.round.stage import Stage


def _members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


def _parameters(member) -> list[str]:
    function = member.fget if isinstance(member, property) else member
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("protocol, implementation", [
    (RoundAverager, "p2p_diloco.swarm.averaging.averager:PseudoGradientAverager"),
    (RoundAverager, "p2p_diloco.training.simulate:ExactAverager"),
    (RoundRecords, "p2p_diloco.swarm.discovery.link:SwarmLink"),
])
def test_each_implementation_has_every_member_with_the_interfaces_parameters(protocol, implementation):
    module, name = implementation.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    members = _members(protocol)
    assert members, protocol  # a walk that found nothing would pass anything
    for member in members:
        theirs, ours = vars(protocol)[member], inspect.getattr_static(cls, member, None)
        assert ours is not None, (cls.__name__, member)
        assert isinstance(ours, property) == isinstance(theirs, property), (cls.__name__, member)
        assert _parameters(ours)[:len(_parameters(theirs))] == _parameters(theirs), (cls.__name__, member)


class _Matching:
    """An averager whose round never finds its group: finish_round asks ``hopeless`` as a real one does."""

    compresses, round_settled = False, True

    def __init__(self):
        self.asked: list[int] = []

    def set_expected_group_size(self, size):
        pass

    def start_round(self, contribution, round_index, weight, compute_s=0.0, budget_s=0.0):
        self.round_index = round_index

    def finish_round(self, timeout=None, hopeless=None, feedback=None):
        if hopeless is not None and hopeless(self.round_index):
            self.asked.append(self.round_index)
            return RoundOutcome(fallback_reason="the other peers have all moved past this round")
        return RoundOutcome(fallback_reason="TimeoutError")

    def abandon_round(self):
        pass

    def cancel_round(self):
        pass

    def shutdown(self):
        pass


class _Records:
    def __init__(self, past: bool):
        self.past, self.asked = past, []

    def moved_past(self, round_index: int) -> bool:
        self.asked.append(round_index)
        return self.past


@pytest.mark.parametrize("records", [None, _Records(past=True), _Records(past=False)])
def test_a_stage_asks_its_records_whether_the_round_is_hopeless(records):
    averager = _Matching()
    stage = Stage(nn.Linear(3, 2), stage_index=0, num_stages=1, inner_cfg=InnerConfig(),
                  diloco_cfg=DiLoCoConfig(mode="none", inner_steps=2), total_steps=4, averager=averager,
                  records=records)
    for p in stage.params:
        p.data.add_(torch.ones_like(p))
    stage.inner_step = 2
    report = stage.end_round(tokens=64, expected_group_size=2)
    if records is None:
        assert averager.asked == [] and report.outcome.fallback_reason == "TimeoutError"
    else:
        assert records.asked == [0]
        assert averager.asked == ([0] if records.past else [])


def test_the_round_package_imports_nothing_that_imports_hivemind():
    modules = [f"p2p_diloco.round.{m.name}" for m in pkgutil.iter_modules(p2p_diloco.round.__path__)]
    assert len(modules) >= 8, modules
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'hivemind'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
