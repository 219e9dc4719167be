"""Fault injection for tests (torchft-style): a process dies at a named point, or a peer turns hostile, when told to.

``P2P_DILOCO_FAULT=<point>:<n>`` makes the process exit at the n-th time it passes ``fault_point(<point>)``
(``os._exit``: no cleanup, like a power cut or SIGKILL); ``<point>:<n>:group`` kills its whole process group
with SIGKILL instead (the peer and every process of it, from its background averager for example). Unset, a
fault point costs a dictionary lookup. Points: ``checkpoint-data-written`` (a checkpoint's data file is in place,
its manifest is not), ``allreduce-group-formed`` (in the averager: a round's group has formed, its all-reduce
is about to start; the groupmates are waiting for this peer's parts).

``P2P_DILOCO_HOLD=<point>:<file>`` makes the process wait at ``hold_point(<point>)`` until ``<file>`` exists (it
writes ``<file>.held`` when it gets there): a test starts a newcomer beside the swarm, so that its imports and its
DHT's start-up overlap the others' rounds, and lets it join at the round the test wants, whatever the machine's
load. Several, comma-separated, hold at each point in turn. Points: ``start`` (a stage process, its DHT up, before it
reads the swarm's records), ``end`` (the last round ended and published, its average in flight not yet applied),
``leave`` (after the run's end was agreed, before the DHT stops: a finished peer still serves its final state).

A hostile peer's averager lies to its groupmates (a test hook for the robust aggregation of
:mod:`p2p_diloco.swarm.averaging.robust`; the peer's own training is unchanged). Only tests and benchmarks turn it on,
and only explicitly: ``p2p-diloco peer --test-hostility <kind>[:<value>]``, or a :class:`Hostility` given to
:class:`~p2p_diloco.swarm.PseudoGradientAverager` (nothing a production peer could inherit from its environment).
An honest averager has the :class:`Honest` behaviour, whose hooks change nothing. Kinds:

- on the wire, every phase (whole tensors, low-rank P and Q), right before the all-reduce sends them:
  ``scale:K`` (contribution times K, default 1000), ``noise:K`` (Gaussian noise of K times the contribution's norm,
  default 100), ``nan``, ``inf``, ``shape`` (every part it sends declares one value more than it holds);
- in the round's metadata: ``fat-metadata:M`` (its record carries M MiB of empty msgpack maps, default 4),
  ``tokens:K`` (claims K times its tokens as its weight, default 1000), ``stale:K``
  (replays its contribution of K rounds ago and claims that round, default 1), ``metadata`` (a malformed
  compression proposal), ``lowball`` (a well-formed record that asks for the least precision: rank 1, 4 bits, a
  link and a round of compute a million times too slow);
- as a reducer: ``reply-nan`` and ``reply-scale:K`` (the averages it returns are NaN, or K times too large),
  ``equivocate:K`` (returns the average K times too large to the first other sender in group order, the true one to
  the rest, default 1.5);
- as a group leader (it never follows another peer, so it leads every group it is in): ``forge-tokens:K`` (relays
  to each follower that follower's own record with K times fewer tokens, which would let it accept an average K
  times larger, and as a reducer returns averages K times too large, default 1000), ``forge-round`` (relays to
  the first follower in group order the next follower's record on the previous round: that follower alone sees
  the member excluded, and the group reads two different partitions of the vector);
- as a follower: ``miss-begin:N`` (ignores the first N BEGIN_ALLREDUCE messages of each round from its leaders, who
  have counted it into their groups, and goes on looking for the round's group: what a follower whose wait for its
  leader timed out on a busy machine does, default 1);
- in the all-reduce: ``stall:S`` (joins groups, then neither sends its parts nor answers for S seconds before it
  leaves the group and looks for the next one, default 30);
- to the swarm's sync: ``false-state:K`` (its progress records claim K rounds more than it has trained and
  applied, which made every peer that read them believe it was behind and reload; and the state it serves to
  newcomers has every anchor value shifted by 1, default 1000); ``poison-momentum:K`` (serves its true anchor
  with outer momentum K times that anchor: with the default K = 1 / (outer_lr * outer_momentum**2) of the default
  outer optimizer, the taker's next Nesterov step sends its anchor to about zero; its records are honest, so a
  benchmark casts the votes for the served state from other identities); ``tiny-clock`` (the state it serves
  claims ``seconds_per_step`` = 5e-320, which once overflowed the downloader's ``int()`` and killed it);
- colluding, honest until their round R (the value, default 3: trust earned by averaging honestly), then all
  together: ``collude-wipe:R`` (their records claim round R + :data:`COLLUDE_AHEAD`, its previous round applied,
  with the fingerprint of an all-zero state, and that is the state they serve: every colluder's records vouch for
  the same forged state, so a victim that met them sees it confirmed) and ``collude-end:R`` (the same, claiming the
  run is over: its last round applied, the zero state its final one).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from typing import Optional

import torch

ENV = "P2P_DILOCO_FAULT"
HOLD_ENV = "P2P_DILOCO_HOLD"
FAULT_EXIT_CODE = 17
HOSTILITY_OPTION = "--test-hostility"
# kind -> default value (None: the kind takes no value)
HOSTILE_KINDS = {"scale": 1000.0, "noise": 100.0, "nan": None, "inf": None, "shape": None, "tokens": 1000.0,
                 "stale": 1.0, "metadata": None, "fat-metadata": 4.0, "equivocate": 1.5,
                 "lowball": None, "reply-nan": None, "reply-scale": 1000.0,
                 "forge-tokens": 1000.0, "forge-round": None, "miss-begin": 1.0, "stall": 30.0, "false-state": 1000.0,
                 "poison-momentum": 1 / (0.7 * 0.5**2), "tiny-clock": None, "collude-wipe": 3.0, "collude-end": 3.0}
COLLUDE_AHEAD = 3  # collude-wipe: how many rounds ahead the colluders' records claim to be
TINY_CLOCK_S = 5e-320  # a subnormal float: positive and finite, and elapsed / it overflows
_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, rest = spec.partition(":")
    if point != name:
        return
    count, _, scope = rest.partition(":")
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] >= int(count or 1):
        if scope == "group":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(FAULT_EXIT_CODE)


def hold_point(name: str, poll_s: float = 0.1) -> None:
    """Wait here until the file that ``P2P_DILOCO_HOLD=<name>:<file>`` names exists (see the module docstring)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    for hold in spec.split(","):
        point, _, path = hold.partition(":")
        if point != name or not path:
            continue
        with open(path + ".held", "a"):
            pass
        while not os.path.exists(path):
            time.sleep(poll_s)


class Honest:
    """What an honest averager does to what it sends: nothing. The averager calls these hooks at the points where a
    hostile peer lies (see the module docstring); :class:`Hostility` overrides them."""

    follows_others = True
    """Whether this peer joins groups led by others (a hostile leader does not: it leads every group it is in)."""

    def claim(self, contribution: list[torch.Tensor], round_index: int,
              weight: float) -> tuple[list[torch.Tensor], int, float]:
        """(contribution, round, weight) this peer claims for a round (in the training process)."""
        return contribution, round_index, weight

    def gather(self, metadata: dict) -> dict:
        """The round's metadata as this peer sends it to its group."""
        return metadata

    def outgoing(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of one all-reduce phase as this peer sends them (in the averager process)."""
        return tensors

    def part(self, serialized_part):
        """A part of this peer's contribution as it goes to a reducer (a hivemind ``runtime_pb2.Tensor``)."""
        return serialized_part

    def reply(self, averaged_part: torch.Tensor, sender_index: int = 0, reducer_index: int = 0) -> torch.Tensor:
        """The average this peer (sender ``reducer_index`` of the all-reduce) returns as a reducer to sender
        ``sender_index``."""
        return averaged_part

    def relay(self, message, follower: bytes, leader: bytes, serializer) -> None:
        """As a group leader (peer id ``leader``, as bytes): the group's records as this peer relays them to
        ``follower`` (a hivemind ``MessageFromLeader`` with BEGIN_ALLREDUCE, changed in place; ``serializer`` reads
        and writes its records)."""

    def gathered(self, data_for_gather: bytes, serializer) -> bytes:
        """The record this peer gathers into its groups, as bytes (in the averager process: a large record does not
        cross the pipe from the training process)."""
        return data_for_gather

    def takes_group(self, round_index: Optional[int]) -> bool:
        """As a follower: whether this peer takes the group its leader has just formed with it (for ``round_index``,
        the round it is averaging)."""
        return True

    async def join_allreduce(self) -> None:
        """Called once this peer's group has formed, right before it averages with it (in the averager process)."""

    def record(self, round_index: int, applied_round: int) -> tuple[int, int]:
        """(round, applied round) as this peer's progress records tell them."""
        return round_index, applied_round

    def record_anchor(self, anchor: str, prior_anchor: str, round_index: int) -> tuple[str, str]:
        """(anchor, prior anchor) fingerprints as this peer's progress record for its ``round_index`` tells them."""
        return anchor, prior_anchor

    def bind(self, shapes, inner_steps: int, num_rounds: int) -> None:
        """The peer's anchor shapes, H and the run's end (called once the stage is built)."""

    def served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        """The state this peer serves to a newcomer (anchor tensors, then momentum)."""
        return meta, tensors


HONEST = Honest()


class Hostility(Honest):
    """What a hostile peer does to what it sends (see the module docstring); built by :func:`parse_hostility`."""

    def __init__(self, kind: str, value: Optional[float]):
        self.kind, self.value = kind, value
        self._sent: dict[int, list[torch.Tensor]] = {}  # stale: contributions of the last rounds
        self.follows_others = not kind.startswith("forge-")
        self._missed: dict[Optional[int], int] = {}  # miss-begin: the round's BEGIN_ALLREDUCE messages ignored
        self._shapes: list[tuple[int, ...]] = []  # collude-*: the anchor's shapes (bind)
        self._inner_steps, self._num_rounds = 1, 1
        self._told_applied: Optional[int] = None  # collude-*: the applied round the last record claimed

    def __repr__(self) -> str:
        return f"Hostility({self.kind}{'' if self.value is None else f':{self.value:g}'})"

    def claim(self, contribution: list[torch.Tensor], round_index: int,
              weight: float) -> tuple[list[torch.Tensor], int, float]:
        if self.kind == "tokens":
            return contribution, round_index, weight * self.value
        if self.kind != "stale":
            return contribution, round_index, weight
        lag = int(self.value)
        self._sent[round_index] = [t.detach().clone() for t in contribution]
        self._sent = {r: c for r, c in self._sent.items() if r >= round_index - lag}
        old = round_index - lag
        return (self._sent[old], old, weight) if old in self._sent else (contribution, round_index, weight)

    def gather(self, metadata: dict) -> dict:
        if self.kind == "lowball":
            slow = {"bandwidth_mbit": metadata["bandwidth_mbit"] * 1e-6,
                    "compute_s": max(metadata["compute_s"], 1.0) * 1e-6}
            return dict(metadata, compression={"rank": 1, "bits": 4, "q_round": -1}, last_error=0.0, **slow)
        return dict(metadata, compression={"rank": "all of it"}) if self.kind == "metadata" else metadata

    def outgoing(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.kind == "scale":
            return [t * self.value for t in tensors]
        if self.kind in ("nan", "inf"):
            return [torch.full_like(t, math.nan if self.kind == "nan" else math.inf) for t in tensors]
        if self.kind == "noise":
            norm = torch.sqrt(sum(t.double().pow(2).sum() for t in tensors))
            noise = [torch.randn_like(t) for t in tensors]
            scale = float(self.value * norm / torch.sqrt(sum(n.double().pow(2).sum() for n in noise)))
            return [n * scale for n in noise]
        return tensors

    def part(self, serialized_part):
        if self.kind == "shape":
            serialized_part.size[0] += 1
        return serialized_part

    def reply(self, averaged_part: torch.Tensor, sender_index: int = 0, reducer_index: int = 0) -> torch.Tensor:
        if self.kind == "equivocate":
            first_other = 1 if reducer_index == 0 else 0
            return averaged_part * self.value if sender_index == first_other else averaged_part
        if self.kind == "reply-nan":
            return torch.full_like(averaged_part, math.nan)
        if self.kind in ("reply-scale", "forge-tokens"):
            return averaged_part * self.value
        return averaged_part

    def relay(self, message, follower: bytes, leader: bytes, serializer) -> None:
        if not self.kind.startswith("forge-"):
            return
        peer_ids, records = list(message.ordered_peer_ids), list(message.gathered)
        followers = [i for i, peer_id in enumerate(peer_ids) if peer_id != leader]
        position = peer_ids.index(follower)
        if self.kind == "forge-tokens":
            target = position  # the follower's own record
        elif position == followers[0] and len(followers) > 1:
            target = followers[1]  # the first follower is told the second is on another round
        else:
            return
        bandwidth, mode, user_bytes = serializer.loads(records[target])
        info = serializer.loads(user_bytes)
        if self.kind == "forge-tokens":
            info["tokens"] = info["tokens"] / self.value
        else:
            info["round"] = info["round"] - 1 if info["round"] > 0 else info["round"] + 1
        records[target] = serializer.dumps([bandwidth, mode, serializer.dumps(info)])
        del message.gathered[:]
        message.gathered.extend(records)

    def bind(self, shapes, inner_steps: int, num_rounds: int) -> None:
        self._shapes, self._inner_steps, self._num_rounds = [tuple(s) for s in shapes], inner_steps, num_rounds

    def _striking(self, round_index: int) -> bool:
        return self.kind in ("collude-wipe", "collude-end") and round_index >= self.value

    def _told(self, round_index: int, applied_round: int) -> tuple[int, int]:
        """The (round, applied round) every colluder claims from its strike on: the same on all of them, so that
        they vouch for one state."""
        if self.kind == "collude-end":
            return self._num_rounds, self._num_rounds - 1
        strike = int(self.value) + COLLUDE_AHEAD
        return strike, strike - 1

    def _forged(self, applied_round: int) -> tuple[list[torch.Tensor], str]:
        """The all-zero state every colluder serves after ``applied_round`` (outer steps: applied + 1), and its
        fingerprint (the same on every colluder)."""
        from p2p_diloco.round.swarm_state import anchor_digest, state_fingerprint

        zeros = [torch.zeros(shape) for shape in self._shapes]
        return zeros, state_fingerprint(anchor_digest(zeros), zeros, applied_round, applied_round + 1)

    def record_anchor(self, anchor: str, prior_anchor: str, round_index: int) -> tuple[str, str]:
        if not self._striking(round_index) or self._told_applied is None:
            return anchor, prior_anchor
        return self._forged(self._told_applied)[1], ""

    def record(self, round_index: int, applied_round: int) -> tuple[int, int]:
        if self._striking(round_index):
            told = self._told(round_index, applied_round)
            self._told_applied = told[1]
            return told
        if self.kind == "false-state":
            return round_index + int(self.value), applied_round + int(self.value)
        return round_index, applied_round

    def served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        if self._striking(int(meta["round"])):
            told, applied = self._told(int(meta["round"]), int(meta["applied_round"]))
            zeros, _ = self._forged(applied)
            start = told * self._inner_steps  # where a peer on that round would be (the end: its last step)
            return dict(meta, round=told, applied_round=applied, outer_steps=applied + 1, round_start_step=start,
                        inner_step=start), \
                zeros + [torch.zeros_like(z) for z in zeros]
        if self.kind == "false-state":
            half = len(tensors) // 2
            return meta, [t + 1.0 for t in tensors[:half]] + list(tensors[half:])
        if self.kind == "poison-momentum":
            anchor = list(tensors[:len(tensors) // 2])
            return meta, anchor + [t * self.value for t in anchor]
        if self.kind == "tiny-clock":
            return dict(meta, seconds_per_step=TINY_CLOCK_S), tensors
        return meta, tensors

    def gathered(self, data_for_gather: bytes, serializer) -> bytes:
        if self.kind != "fat-metadata":
            return data_for_gather
        bandwidth, mode, user_bytes = serializer.loads(data_for_gather)
        padded = dict(serializer.loads(user_bytes), padding=[{}] * int(self.value * 2**20))  # N empty maps: N bytes
        return serializer.dumps([bandwidth, mode, serializer.dumps(padded)])

    def takes_group(self, round_index: Optional[int]) -> bool:
        if self.kind != "miss-begin":
            return True
        missed = self._missed.get(round_index, 0)
        if missed >= self.value:
            return True
        self._missed = {round_index: missed + 1}
        return False

    async def join_allreduce(self) -> None:
        if self.kind == "stall":
            await asyncio.sleep(self.value)
            raise RuntimeError(f"stalled the group for {self.value:g} s (a test hook)")


def parse_hostility(spec: str) -> Hostility:
    """The hostility ``<kind>[:<value>]`` names; ValueError naming the option if it is malformed."""
    where = HOSTILITY_OPTION
    kind, _, value = spec.strip().partition(":")
    if kind not in HOSTILE_KINDS:
        raise ValueError(f"{where}: unknown kind {kind!r}; one of {', '.join(HOSTILE_KINDS)}")
    default = HOSTILE_KINDS[kind]
    if default is None:
        if value:
            raise ValueError(f"{where}: {kind} takes no value, got {spec!r}")
        return Hostility(kind, None)
    try:
        number = float(value) if value else default
    except ValueError:
        raise ValueError(f"{where}: {kind} takes a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{where}: {kind} takes a positive number, got {value!r}")
    return Hostility(kind, number)
