"""Hostile groupmates against real hivemind DHTs and averager processes on 127.0.0.1, and in a swarm of real peer
processes: what they send is left out, clipped or refused, honest peers still agree bit for bit, the hostile peers
are named, and a repeat offender is banned. A private swarm (averaging.allowlist) refuses outsiders at matchmaking
and at state download."""

from __future__ import annotations

import dataclasses
import math

import hivemind
import pytest
import torch

from p2p_diloco.config import AveragingConfig
from p2p_diloco.swarm import PseudoGradientAverager
from p2p_diloco.swarm.averaging.allreduce import ExactAllReduceRunner
from p2p_diloco.swarm.averaging.guard import OFFENCES
from p2p_diloco.swarm.averaging.robust import cap_weights
from p2p_diloco.swarm.averaging.server import AveragingServer
from tests.hostile import parse_hostility
from tests.integration.test_swarm import applied, peer_args, rounds_told, summary

pytestmark = pytest.mark.timeout(180)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
CFG = AveragingConfig(matchmaking_time_s=3, request_timeout_s=1, round_timeout_s=8, allreduce_timeout_s=15,
                      next_chunk_timeout_s=5, compression="none")
# ten tensors, each one part of the all-reduce: every groupmate reduces some (a peer only flags what it reduces)
TEMPLATES = [torch.zeros(40, 50) for _ in range(6)] + [torch.zeros(2000) for _ in range(4)]
TOKENS = 1024.0


class Network:
    """A bootstrap DHT; averagers are added on DHTs of their own, hostile ones of a kind of :mod:`tests.hostile`."""

    def __init__(self):
        self.root = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
        self.initial = [str(m) for m in self.root.get_visible_maddrs()]
        self.dhts, self.averagers = [self.root], []

    def dht(self) -> hivemind.DHT:
        self.dhts.append(hivemind.DHT(start=True, initial_peers=self.initial, host_maddrs=LOOPBACK))
        return self.dhts[-1]

    def averager(self, hostile: str = "", cfg: AveragingConfig = CFG, dht=None) -> PseudoGradientAverager:
        make = parse_hostility(hostile).averager if hostile else PseudoGradientAverager
        averager = make(TEMPLATES, dht or self.dht(), run_id="run", stage_index=0, num_stages=1, cfg=cfg)
        self.averagers.append(averager)
        return averager

    def shutdown(self) -> None:
        for averager in self.averagers:
            averager.shutdown()
        for dht in self.dhts:
            dht.shutdown()


@pytest.fixture
def network():
    net = Network()
    yield net
    net.shutdown()


def average_round(averagers, round_index: int, seed: int = 0):
    """Every averager starts the round with its own random contribution; returns (contributions, results)."""
    g = torch.Generator().manual_seed(seed)
    contributions = [[torch.randn(t.shape, generator=g) for t in TEMPLATES] for _ in averagers]
    for averager in averagers:
        averager.set_expected_group_size(len(averagers))
    for averager, contribution in zip(averagers, contributions):
        averager.start_round(contribution, round_index, TOKENS)
    return contributions, [averager.finish_round() for averager in averagers]


def peer_id(averager) -> str:
    return str(averager.peer_id)


def assert_honest_agree(honest_results, honest_contributions) -> None:
    """The honest peers averaged, hold the same bits, and their average is no larger than an honest contribution
    (it is a robust mean of theirs; an attack that got through would be orders of magnitude larger)."""
    assert all(r.fallback_reason == "" for r in honest_results), [r.fallback_reason for r in honest_results]
    first = honest_results[0].average
    for result in honest_results:
        assert all(torch.equal(a, b) for a, b in zip(result.average, first))
    for i, average in enumerate(first):
        assert torch.isfinite(average).all()
        assert average.norm() <= 1.01 * max(c[i].norm() for c in honest_contributions), i


@pytest.mark.parametrize("kinds, compression, reasons", [
    (("scale:1000", "nan"), "none", ({"norm"}, {"nonfinite"})),
    (("inf", "shape"), "none", ({"nonfinite"}, {"malformed"})),
    # low rank: the attacks hit the P and the Q phase (int8 factors: a NaN cannot even be decoded)
    (("nan", "noise:100"), "lowrank", ({"nonfinite", "malformed"}, {"norm"})),
    # SparseLoCo's top-k parts: a NaN part cannot be decoded (its scales are not finite), a scaled one is too large
    (("scale:1000", "nan"), "sparseloco", ({"norm"}, {"nonfinite", "malformed"})),
])
def test_hostile_parts_are_left_out_and_named(network, kinds, compression, reasons):
    cfg = dataclasses.replace(CFG, compression=compression, rank=4, lowrank_min_size=1000)
    honest = [network.averager(cfg=cfg) for _ in range(3)]
    hostile = [network.averager(kind, cfg=cfg) for kind in kinds]
    contributions, results = average_round(honest + hostile, round_index=0)
    assert_honest_agree(results[:3], contributions[:3])
    # exactly the honest peers' mean: the hostile parts weigh nothing (but the slice a "shape" peer reduces holds
    # its own part, which only its messages to the others misstate)
    if compression == "none" and "shape" not in kinds:
        for i in range(len(TEMPLATES)):
            honest_mean = sum(c[i].double() for c in contributions[:3]) / 3
            torch.testing.assert_close(results[0].average[i].double(), honest_mean, rtol=0, atol=1e-6)
    named = {}  # what the honest peers found, together
    for result in results[:3]:
        for suspect, found in result.suspects.items():
            named.setdefault(suspect, set()).update(found)
    for bad, expected in zip(hostile, reasons):
        assert named.get(peer_id(bad), set()) & expected, (peer_id(bad), named)
    assert not any(named.get(peer_id(h), set()) & OFFENCES for h in honest), named


def test_lying_metadata_is_capped_or_excluded(network):
    """A peer claiming 1000x its tokens weighs only max_weight_ratio x the median; a peer with a malformed record,
    and one replaying its previous round's contribution under that round's number, are left out of the round
    (auxiliary peers for the others); every honest peer names them."""
    honest = [network.averager() for _ in range(3)]
    greedy, stale, malformed = (network.averager(kind) for kind in ("tokens:1000", "stale:1", "metadata"))
    group = honest + [greedy, stale, malformed]
    for round_index in range(2):  # in round 0 the stale peer has nothing to replay yet: it is honest
        contributions, results = average_round(group, round_index, seed=round_index)
        assert_honest_agree(results[:3], contributions[:3] + [contributions[3]])
        included = [i for i, a in enumerate(group) if peer_id(a) in results[0].group_peers]
        assert {0, 1, 2, 3} <= set(included) and 5 not in included and (round_index == 0 or 4 not in included)
        weights = cap_weights([1000 * TOKENS if i == 3 else TOKENS for i in included], 2.0)
        assert weights[included.index(3)] == 2 * TOKENS  # the greedy peer's claim, capped
        for t in range(len(TEMPLATES)):
            expected = sum(w * contributions[i][t].double() for w, i in zip(weights, included)) / sum(weights)
            torch.testing.assert_close(results[0].average[t].double(), expected, rtol=0, atol=1e-6)
        for result in results[:3]:
            assert result.group_size == len(included) and result.suspects[peer_id(greedy)] == ["capped"]
            assert result.suspects[peer_id(malformed)] == ["metadata"]
            assert result.suspects.get(peer_id(stale)) == (["round"] if round_index == 1 else None)


def test_repeat_offender_is_banned_and_the_others_go_on(network):
    """A reducer that returns NaN averages fails the all-reduces it takes part in (never a NaN anchor): the honest
    peers then retry the round and either average it among themselves or fall back; after ban_after (3) rounds
    with such an offence the honest peers refuse to group with it and average among themselves at once."""
    honest = [network.averager() for _ in range(3)]
    hostile = network.averager("reply-nan")
    for round_index in range(3):
        contributions, results = average_round(honest + [hostile], round_index, seed=round_index)
        for result in results[:3]:
            assert result.suspects == {peer_id(hostile): ["bad average"]}
            if not result.averaged:
                assert result.fallback_reason
            else:  # the retry, without the hostile reducer
                assert result.group_size == 3 and set(result.group_peers) == {peer_id(h) for h in honest}
                assert all(torch.isfinite(t).all() for t in result.average)
        if all(r.averaged for r in results[:3]):
            assert_honest_agree(results[:3], contributions[:3])
    contributions, results = average_round(honest + [hostile], 3, seed=3)
    assert_honest_agree(results[:3], contributions[:3])
    for result in results[:3]:
        assert result.group_size == 3 and set(result.group_peers) == {peer_id(h) for h in honest}
        assert result.banned == (peer_id(hostile),) and result.suspects == {}
        assert result.ban_reasons == {peer_id(hostile): "offences in rounds [0, 1, 2] (bad average in round 2)"}
    assert not results[3].averaged


def test_private_swarm_refuses_outsiders(network):
    """Two members of an allowlist average with each other and not with an outsider on the same run; the outsider
    gets no state from them, and a member never downloads state from the outsider, even when asked to first."""
    member_dhts = [network.dht(), network.dht()]
    private = dataclasses.replace(CFG, allowlist=[str(d.peer_id) for d in member_dhts])
    members = [network.averager(cfg=private, dht=d) for d in member_dhts]
    outsider = network.averager()
    for averager, name in zip(members + [outsider], ("member0", "member1", "outsider")):
        averager.state_provider = lambda name=name: ({"served_by": name}, [torch.ones(t.shape) for t in TEMPLATES * 2])
    _, results = average_round(members + [outsider], round_index=0)
    for result in results[:2]:
        assert result.fallback_reason == "" and result.group_size == 2
        assert set(result.group_peers) == {peer_id(m) for m in members}
    assert not results[2].averaged
    assert outsider.download_state([peer_id(m) for m in members], timeout_s=10) is None
    downloaded = members[1].download_state([peer_id(outsider), peer_id(members[0])], timeout_s=10)
    assert downloaded is not None and downloaded[0] == {"served_by": "member0"}
    assert len(downloaded[1]) == 2 * len(TEMPLATES) and all(torch.equal(t, torch.ones(t.shape)) for t in downloaded[1])


@pytest.mark.timeout(300)
def test_swarm_with_hostile_peers_trains_and_names_them(tmp_path, processes, bootstrap):
    """Real peer processes: 3 honest tiny peers and 2 hostile ones (tests.hostile.peer scale:1000 and nan) train 3
    rounds together. Every round of the honest peers averages, their anchors are finite and bit-identical after
    every round, the eval loss falls, and each honest peer names both hostile peers in its round metrics."""
    rounds, honest, hostile = 3, ["h0", "h1", "h2"], {"x-scale": "scale:1000", "x-nan": "nan"}
    # 5 processes on a busy machine: a groupmate that starts sending late must not be dropped as if it had left
    patient = ["--averaging.next_chunk_timeout_s", "15",
               # and one that reaches the round's end a few seconds after the others (2 busy cores for 5 trainers)
               # still joins their group: the group forms as soon as all 5 are in, else after 12 s
               "--averaging.target_group_size", "5", "--averaging.matchmaking_time_s", "12",
               "--averaging.request_timeout_s", "5", "--averaging.round_timeout_s", "40"]
    # rounds of 15 steps: 5 processes starting on 2 cores see each other up to a second or two apart, and a
    # peer that finds the others past their first round already reloads instead of averaging it with them
    H = 15
    for name in honest:
        processes.start(name, *peer_args(tmp_path, name, bootstrap, "byz", rounds, H, *patient, wait_for=5))
    for name, kind in hostile.items():
        processes.start_hostile(name, kind, *peer_args(tmp_path, name, bootstrap, "byz", rounds, H, *patient,
                                                       wait_for=5))
    for name in [*honest, *hostile]:
        assert processes.wait(name, timeout=240) == 0, processes.log(name)[-3000:]

    per_peer = [applied(tmp_path, name) for name in honest]
    for name, rounds_seen in zip(honest, per_peer):
        assert [e["applied_round"] for e in rounds_seen] == list(range(rounds)), rounds_told(tmp_path, name)
        assert all(e["averaged"] and e["group_size"] == 5 for e in rounds_seen), rounds_told(tmp_path, name)
    for r in range(rounds):
        assert len({p[r]["anchor_sha256"] for p in per_peer}) == 1, r
    hostile_ids = {name: summary(tmp_path, name)["peer"] for name in hostile}
    for name, rounds_seen in zip(honest, per_peer):
        named: dict[str, set] = {}
        for event in rounds_seen:
            for suspect, reasons in event["suspects"].items():
                named.setdefault(suspect, set()).update(reasons)
        assert "norm" in named.get(hostile_ids["x-scale"], set()), (name, named)
        assert named.get(hostile_ids["x-nan"], set()) & {"nonfinite", "malformed"}, (name, named)
        # no honest peer is named for an offence (one whose contribution was clipped towards the others' is reported,
        # not accused: with rounds ended by the swarm, peers contribute different numbers of steps)
        accused = {peer for peer, reasons in named.items() if reasons & OFFENCES}
        assert accused == set(hostile_ids.values()), (name, named)
        s = summary(tmp_path, name)
        assert math.isfinite(s["eval_loss_final"]) and s["eval_loss_final"] < s["eval_loss_start"] - 0.3, s


def test_a_reducer_that_scales_its_slice_within_the_old_bound_is_refused_and_left_out(network):
    """A reducer returns its slice's averages 10 times too large (5 times the receivers' parts: the mean of 4
    independent parts is half as large as one): under the old bound (20 times the receiver's part) every honest peer
    took them, and its slice of their anchors moved 10-fold. Beyond robust.average_bound (2.5 in a group of 4 equal
    claims, with the codec margin 3.1) no honest reducer goes: each honest peer refuses them, leaves the reducer out of
    the round's retry and averages with the other honest peers in the same round; the reducer is named, not banned
    (an honest late joiner's bound can be met by an honest reducer now and then)."""
    # the attack needs the reducer in the group: with CFG's 3 s of matchmaking, on 2 busy cores the fourth averager
    # once came too late and the honest three averaged without ever meeting it. All four are expected, so a group
    # still assembles as soon as they are in.
    cfg = dataclasses.replace(CFG, matchmaking_time_s=10, round_timeout_s=25)
    honest = [network.averager(cfg=cfg) for _ in range(3)]
    steering = network.averager("reply-scale:10", cfg=cfg)
    contributions, results = average_round(honest + [steering], round_index=0)
    assert_honest_agree(results[:3], contributions[:3])
    for result in results[:3]:
        assert set(result.group_peers) == {peer_id(h) for h in honest}
        assert not result.banned
    named: dict[str, set] = {}
    for result in results[:3]:
        for suspect, reasons in result.suspects.items():
            named.setdefault(suspect, set()).update(reasons)
    assert named == {peer_id(steering): {"implausible average"}}, named


class ReversingReducer(ExactAllReduceRunner):
    """A reducer that returns its slice's averages reversed at 3 times their norm (tests.hostile's kinds take positive
    factors only)."""

    def _reply(self, averaged_part: torch.Tensor, sender_index: int) -> torch.Tensor:
        return averaged_part * -3.0


class ReversingServer(AveragingServer):
    runner_type = ReversingReducer


ReversingServer.__name__ = AveragingServer.__name__  # hivemind names a servicer's handlers after its class


def test_in_a_pair_a_reducer_whose_average_no_part_of_its_own_gives_is_refused_as_an_offence(network):
    """A pair's reducer returns -3 times the average of its slice: 2.1 times the honest member's part, within the
    norm bound of a pair (2.5 with the codec margin), so the honest member took it, and its anchor moved against its
    own pseudo-gradient. The other member's part that average implies (-4 times the member's part, less 3 times the
    other's) is more than the 3 times the member's part that the robust combination leaves any part of a pair: the
    average is refused, an offence of the reducer (`bad average`), and the round falls back."""
    honest = network.averager()
    reversing = PseudoGradientAverager(TEMPLATES, network.dht(), run_id="run", stage_index=0, num_stages=1, cfg=CFG,
                                       server_type=ReversingServer)
    network.averagers.append(reversing)
    _, results = average_round([honest, reversing], round_index=0)
    assert not results[0].averaged and results[0].fallback_reason, results[0]
    assert results[0].suspects == {peer_id(reversing): ["bad average"]}, results[0].suspects


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_a_groupmate_with_an_oversized_record_is_refused_before_its_record_is_decoded(network):
    """A peer gathers 4 MiB of empty msgpack maps into its record (issue 30: 7.6 MiB of them cost each groupmate's
    averager 557 MiB and 1.5 s of its event loop, and the record was even accepted: check_gathered ignored the extra
    field). Its join request is refused by the leader it asks, and a group it leads is refused by its followers,
    before any record is decoded: the honest peers average among themselves, their averagers' peak memory grows by
    less than 64 MiB, and every honest peer that met it bans it at once (an honest peer never sends such a record,
    and an honest leader never relays one: counted as an offence instead, a hostile leader drew its followers away
    from the other honest peers for ban_after rounds, and the byzantine benchmark's swarm split into two pairs)."""
    honest = [network.averager() for _ in range(3)]
    fat = network.averager("fat-metadata:4")
    peaks = [_peak_rss_bytes(h.pid) for h in honest]
    contributions, results = average_round(honest + [fat], round_index=0)
    assert_honest_agree(results[:3], contributions[:3])
    assert all(set(result.group_peers) == {peer_id(h) for h in honest} for result in results[:3])
    grown = [_peak_rss_bytes(h.pid) - peak for h, peak in zip(honest, peaks)]
    assert max(grown) < 64 * 2**20, grown
    named = [result for result in results[:3] if "oversized record" in result.suspects.get(peer_id(fat), [])]
    assert named, [r.suspects for r in results[:3]]
    assert all(set(result.suspects) == {peer_id(fat)} for result in named), [r.suspects for r in named]
    assert all(result.banned == (peer_id(fat),) for result in named), [r.banned for r in named]
    assert not any(result.banned for result in results[:3] if all(result is not n for n in named))
    assert not results[3].averaged


class SignedNetwork(Network):
    """A :class:`Network` of DHT nodes started as peers start theirs (start_dht: entries signed by each node), so
    that averagers compare the digests of their slices (digests.py)."""

    def __init__(self):
        from p2p_diloco.config import DHTConfig
        from p2p_diloco.swarm import start_dht

        self._start = lambda initial: start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial))
        self.root = self._start([])
        self.initial = [str(m) for m in self.root.get_visible_maddrs()]
        self.dhts, self.averagers = [self.root], []

    def dht(self):
        self.dhts.append(self._start(self.initial))
        return self.dhts[-1]


@pytest.fixture
def signed_network():
    net = SignedNetwork()
    yield net
    net.shutdown()


def test_a_reducer_that_sends_one_member_other_averages_is_named_and_banned_by_it(signed_network):
    """A reducer returns its true averages to all but one member, and 1.5 times them to that one: within every bound
    a receiver checks alone, and before, that member's anchor left the others' (one reply stream per member, never
    compared). Now every member publishes a signed digest of the slice it got from each reducer: that member finds
    the reducer's own record naming other bytes than it got, bans it at once (a proof) and does not apply its
    average; the other members hold identical averages; no honest peer is named."""
    honest = [signed_network.averager() for _ in range(3)]
    liar = signed_network.averager("equivocate:1.5")
    for round_index in range(3):  # what is tested needs the liar in the honest peers' group; on a busy machine the
        # honest three may form theirs before its request arrives (then nobody met it: the round is run again)
        contributions, results = average_round(honest + [liar], round_index=round_index)
        if any(peer_id(liar) in result.group_peers for result in results[:3]):
            break
    banned_by = [result for result in results[:3] if result.banned == (peer_id(liar),)]
    assert len(banned_by) == 1, [(r.banned, r.suspects, r.fallback_reason, r.group_peers) for r in results[:3]]
    assert banned_by[0].suspects[peer_id(liar)] == ["equivocated"]
    applied = [result for result in results[:3] if result.averaged and result is not banned_by[0]]
    assert len(applied) == 2
    assert_honest_agree(applied, contributions[:3])
    assert not banned_by[0].averaged or set(banned_by[0].group_peers) <= {peer_id(h) for h in honest}
    for result in results[:3]:
        assert not {p for p, reasons in result.suspects.items() if set(reasons) & OFFENCES} - {peer_id(liar)}
