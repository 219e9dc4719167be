"""Issue 30 item 3b without a network: how a member judges each reducer from the digests the group published. The
reducer's own record against what this peer got is a proof; without it, a strict majority of the others decides;
nothing a member other than the reducer claims gets an honest reducer named. The attack against real averagers is
in ``tests/integration/test_byzantine.py``."""

from __future__ import annotations

import pytest

from p2p_diloco.swarm.averaging.digests import EQUIVOCATED, OUTVOTED, judge, parse_claim, slice_digest

GOOD, BAD = slice_digest([b"the average"]), slice_digest([b"another average"])
ME, R, A, B = "me", "reducer", "a", "b"


def claims(**by_member) -> dict:
    return {member: {"-": per_reducer} for member, per_reducer in by_member.items()}


def test_slice_digests_depend_on_every_part_and_its_order():
    assert slice_digest([b"x", b"y"]) == slice_digest([b"x", b"y"]) != slice_digest([b"y", b"x"])
    assert slice_digest([b"xy"]) != slice_digest([b"x", b"y"]) and len(GOOD) == 32


def test_a_reducer_whose_own_record_differs_from_what_this_peer_got_equivocated():
    assert judge(ME, {"-": {R: BAD}}, claims(reducer={R: GOOD}, a={R: GOOD})) == [(R, EQUIVOCATED)]
    assert judge(ME, {"-": {R: GOOD}}, claims(reducer={R: GOOD}, a={R: BAD})) == []  # a's problem, or a's lie


@pytest.mark.parametrize("liars", [1, 2, 5])
def test_no_number_of_lying_members_gets_an_honest_reducer_named(liars):
    """The reducer's own record stands against every other claim: members cannot sign it."""
    lies = {f"liar{i}": {R: BAD} for i in range(liars)}
    assert judge(ME, {"-": {R: GOOD}}, claims(reducer={R: GOOD}, **lies)) == []


def test_without_the_reducers_record_a_strict_majority_of_the_others_decides():
    assert judge(ME, {"-": {R: BAD}}, claims(a={R: GOOD}, b={R: GOOD})) == [(R, OUTVOTED)]
    assert judge(ME, {"-": {R: BAD}}, claims(a={R: GOOD})) == []  # 1 against 1: nobody can tell
    assert judge(ME, {"-": {R: GOOD}}, claims(a={R: BAD}, b={R: GOOD})) == []


def test_this_peers_own_slice_is_never_judged_on_others_claims():
    assert judge(ME, {"-": {ME: GOOD}}, claims(a={ME: BAD}, b={ME: BAD})) == []


def test_a_claim_of_another_shape_is_dropped():
    members = {ME: 0, R: 1}
    assert parse_claim({"node": R, "digests": {"-": {R: GOOD}}}, members) == {"-": {R: GOOD}}
    for value in (None, [], {"digests": []}, {"digests": {"-": {"stranger": GOOD}}}, {"digests": {"-": {R: "xx"}}},
                  {"digests": {str(i): {} for i in range(4)}}, {"digests": {"-": {R: 5}}}):
        assert parse_claim(value, members) is None, value
