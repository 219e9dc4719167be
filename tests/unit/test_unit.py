"""The unit's names, as every part of the project gives them (p2p_diloco/unit.py)."""

from __future__ import annotations

import pytest

from p2p_diloco.unit import Unit, run_units


def test_a_stage_unit_is_named_by_its_stage_of_p():
    unit = Unit(1, 3)
    assert (unit.label, unit.folder, unit.meta) == ("Stage 1", "stage1of3", {"stage": 1, "num_stages": 3})
    assert unit.group_prefix("run") == "run_s1of3"
    assert unit.records_run("run") == "run"
    assert unit.fragment_pair is None and not unit.is_fragment


def test_a_fragment_unit_is_named_by_its_fragment_whatever_the_split():
    unit = Unit.of(1, 2, (3, 4))
    assert (unit.label, unit.folder, unit.meta) == ("Stage 1 fragment 3", "fragment3of4",
                                                     {"fragment": 3, "num_fragments": 4})
    assert unit.group_prefix("run") == unit.records_run("run") == "run_f3of4"
    assert unit.fragment_pair == (3, 4)
    # the same fragment on another split has the same names, except its label
    other = Unit.of(0, 1, (3, 4))
    assert (other.folder, other.meta, other.group_prefix("run")) == (unit.folder, unit.meta, unit.group_prefix("run"))


def test_matches_and_describe_read_a_states_metadata():
    unit = Unit(0, 2)
    assert unit.matches({"stage": 0, "num_stages": 2, "round": 5})
    assert not unit.matches({"stage": 1, "num_stages": 2})
    assert unit.describe({"stage": 1, "num_stages": 2}) == "stage 1 of 2"
    fragment = Unit(0, 1, 1, 2)
    assert fragment.matches({"fragment": 1, "num_fragments": 2, "stage": 0, "num_stages": 3})
    assert not fragment.matches({"stage": 0, "num_stages": 1})
    assert fragment.describe({"stage": 0}) == "fragment None of None"


def test_run_units_gives_one_unit_per_group_prefix():
    assert [u.group_prefix("r") for u in run_units(2)] == ["r_s0of2", "r_s1of2"]
    assert [u.group_prefix("r") for u in run_units(3, 2)] == ["r_f0of2", "r_f1of2"]


@pytest.mark.parametrize("args", [(2, 2), (-1, 1), (0, 1, 0, 0), (0, 1, None, 2), (0, 1, 2, 2)])
def test_a_unit_that_cannot_exist_is_refused(args):
    with pytest.raises(ValueError, match="unit"):
        Unit(*args)


def test_a_unit_is_a_frozen_hashable_value():
    assert Unit(0, 1) == Unit.of(0, 1) and len({Unit(0, 1), Unit.of(0, 1, None)}) == 1
    with pytest.raises(AttributeError):
        Unit(0, 1).stage = 2
