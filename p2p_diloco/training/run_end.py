"""The run's end for one unit (a stage, or a fragment): one final state for the whole swarm (docs/design.md 3.7).

After its last round a unit's final state is the one most finished peers hold: every signed record of a peer that
applied the last round votes (this one's own state included), a tie goes to the state held by the smallest node id.
Every peer computes the same from the same records, whatever it believes. The peers' own beliefs
(:mod:`p2p_diloco.training.witnesses`: the peers met in recent groups) cannot decide it: where the last round splits
the swarm into groups that have met only themselves, or mostly themselves, each group's members would believe their
own state the swarm's, and the run would end on as many models as groups (4 peers in 2 pairs: 2; 16 peers in groups
of 2 to 12: 4).

A unit off that final state downloads it from the peers holding it. A state its believed peers agree on (the
canonical one of :class:`~p2p_diloco.training.sync.SwarmSync`, with two votes) is taken as any resync. One vouched for
by peers it never met is taken only if it is within :data:`NEAR_STEPS` of this unit's own outer steps of the state it
held at the end (anchor and outer momentum): two groups that started the last round from one state end one outer step
apart each, whereas made-up identities voting for a state of their own choosing could otherwise hand every peer any
model at the end. So the most they can do is move the final model by a few outer steps (what a reducer can bias a
round by). Where the vote's state is refused, the unit falls back on its believed peers' canonical state, as any
resync does.

The decision is taken again until every finished peer holds this unit's state or the end's bound passes
(:meth:`~p2p_diloco.training.sync.SyncGroup.agree_at_end`): as peers take the final state, the votes move to it.
Every final state also passes this peer's own check (its held-out loss against its own anchor:
:mod:`~p2p_diloco.training.own_check`), which no number of identities can vote through.

A unit that starts where the run is over (most of its believed peers applied the last round: it joined late, or
restarted after the end) takes that final state and has nothing left to train (:meth:`RunEnd.final_at_start`), if
those peers are ones it has reason to believe (met in its groups, its bootstrap peers, an allowlist: not merely
signed records, which anyone can make) and the state passes its own check. A claim of the end is never a reason to
train nothing or to exit: an end it cannot verify, a final state nobody serves (its holders left) or one that fails
its check, and the peer trains on and says so once (:meth:`RunEnd.give_up`).

Called by :class:`~p2p_diloco.training.sync.SwarmSync` and its ``SyncGroup``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from p2p_diloco.training.witnesses import anchor_votes, canonical_of

logger = logging.getLogger(__name__)

NEAR_STEPS = 6.0
"""How far a final state vouched for only by peers never met may be from this unit's own, in this unit's own outer
steps (the norm of its last pseudo-gradient; the anchor's distance scaled by the outer step's learning rate). Two
groups of one swarm that split for the last round are 1-3 apart (each is one step from the state they shared)."""
MAX_TRIES = 2  # downloads of one final state (its donors may be busy serving the others)


@dataclass
class FinalReference:
    """This unit's own final state, kept before the end changes it: what a final state vouched for only by strangers
    is measured against."""

    anchor: list[torch.Tensor]
    momentum: list[torch.Tensor]
    grad_norm: float
    """The norm of the pseudo-gradient of this unit's last outer step."""
    anchor_per_grad: float
    """How much the anchor moves per unit of pseudo-gradient in one outer step: lr (1 + mu) with Nesterov momentum,
    lr without, lr the last step's (it grows with the group: round/outer.py). Two states that applied different
    pseudo-gradients g, g' to one state differ by this times |g - g'|, and their momenta by |g - g'|."""

    @classmethod
    def of(cls, stage) -> FinalReference:
        outer = stage.outer_optimizer
        scale = outer.last_lr * (1 + outer.momentum if outer.nesterov else 1.0)
        with stage.state_lock:
            return cls([t.clone() for t in stage.anchor], [m.clone() for m in outer.momentum_buffers],
                       float(outer.last_grad_norm), float(scale))

    def steps_from(self, tensors: list[torch.Tensor]) -> float:
        """How far a served state ([anchor..., momentum...], checked for shapes) is from this one, in outer steps."""
        if not self.grad_norm > 0:
            return math.inf
        count = len(self.anchor)
        anchor = distance(tensors[:count], self.anchor) / (self.anchor_per_grad * self.grad_norm)
        momentum = distance(tensors[count:], self.momentum) / self.grad_norm
        return max(anchor, momentum)


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The Euclidean distance between two lists of tensors of the same shapes (in float64)."""
    return math.sqrt(sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b)))


class RunEnd:
    """One unit's agreement on the final state (see the module docstring).

    Args:
        sync: the unit's :class:`~p2p_diloco.training.sync.SwarmSync` (its stage, swarm, witnesses, fetcher).
    """

    def __init__(self, sync):
        self.sync = sync
        self.reference: FinalReference | None = None
        self.tries: Counter[str] = Counter()  # final state -> downloads of it tried
        # the run's end as the records claim it could not be had, or failed this peer's own check: the claim is not
        # acted on again (the stage trains on: SwarmSync._actionable), and that is said once (told)
        self.given_up = False
        self.told = False

    def open(self, others) -> bool:
        """Whether a claim in ``others`` (the counted records) that the run is over can end this stage's training:
        they are of peers it has reason to believe (:meth:`Witnesses.earned`) and their final state has not been
        given up on."""
        return not self.given_up and self.sync.witnesses.earned(self.sync.swarm.others())

    @property
    def last(self) -> int:
        return (self.sync.num_rounds or 0) - 1

    def ready(self) -> bool:
        """Whether this unit is at the run's end: the last round applied, with a swarm to agree with."""
        stage = self.sync.stage
        return self.sync.num_rounds is not None and stage.applied_round == self.last and stage.averager is not None

    def step(self, deadline: float) -> None:
        """Wait (until ``deadline``) for the peers still averaging the last round to apply it, then take the final
        state if this unit does not hold it. Called again until the swarm agrees: each call decides on the records
        as they are then."""
        if not self.ready():
            return
        sync, last = self.sync, self.last
        if self.reference is None:
            self.reference = FinalReference.of(sync.stage)
        # every signed record: the peer still averaging may be one this peer never met (the odd one out of every round)
        records = sync.swarm.others()
        finishing = [r.node for r in records if r.round >= last and r.applied_round < last]
        if finishing:
            sync.swarm.wait_for_groupmates(finishing, last, timeout_s=max(0.0, deadline - time.monotonic()))
            records = sync.swarm.others()
        mine = sync.fingerprints.get(last)
        final = self.final_state(records, mine)
        if final is None or final == mine:
            return
        if self._take(final, f"the swarm's final state after round {last} is another"):
            return
        believed = sync.canonical_if_off(last)  # refused or out of reach: the believed peers' state, as any resync
        if believed is not None and self.tries[believed] < MAX_TRIES:
            self.tries[believed] += 1
            sync.resync(last)

    def final_state(self, records, mine: str | None) -> str | None:
        """The state most finished peers of ``records`` hold after the last round (this unit's own vote included), a
        tie to the one held by the smallest node id; None when no other peer has finished. Every signed record votes
        (a private swarm's members' only), less those of discredited donors."""
        witnesses = self.sync.witnesses
        voters = witnesses.credited(records)
        if witnesses.allowlist:
            voters = [r for r in voters if r.node in witnesses.allowlist]
        votes = anchor_votes(voters, self.last)
        if not votes:
            return None
        if mine is not None:
            votes.setdefault(mine, []).append(self.sync.swarm.node)
        return canonical_of(votes)

    def agreed(self, believed_only: bool = False) -> bool:
        """Whether every other peer that applied the last round holds this unit's state after it (a peer holding the
        final state stays until the others took it: they download it from such peers). Every signed record counts:
        a peer restarted late under a fresh identity is a stranger to the others, and it downloads the final state
        from them while they stay; a record that never agrees costs a wait bounded by the caller.
        ``believed_only``: the peers whose word counts (:meth:`Witnesses.counted`) only, to tell a split of the
        swarm from a stranger's claim."""
        sync = self.sync
        mine = sync.fingerprints.get(self.last)
        records = sync.witnesses.counted(sync.swarm.others()) if believed_only else sync.swarm.others()
        return mine is None or set(anchor_votes(records, self.last)) <= {mine}

    def _take(self, final: str, reason: str) -> bool:
        """Download ``final`` from the peers holding it and take it as a resync; whether it was taken."""
        if self.tries[final] >= MAX_TRIES:
            return False
        self.tries[final] += 1
        sync = self.sync
        state = sync.fetcher.download_final(final, self.last, self._refusal)
        if state is None:
            return False
        sync.take_resync(*state, reason)
        return True

    def _refusal(self, meta: dict, tensors, vouched: bool) -> str | None:
        """Why a final state (checked well-formed and of the voted fingerprint) is refused, or None: it must pass this
        peer's own check (:mod:`~p2p_diloco.training.own_check`), and one that this unit's believed peers do not
        vouch for must be near its own (:data:`NEAR_STEPS`)."""
        why = self.sync.own_check(meta, tensors)
        if why is not None:
            self.sync.refuse(meta, tensors, why)
            return why
        if vouched:
            return None
        steps = self.reference.steps_from(tensors)
        logger.info(f"{self.sync.stage.label}: the swarm's final state is {steps:.2f} outer steps from this one's")
        if steps <= NEAR_STEPS:
            return None
        return (f"it is {steps:.1f} outer steps from this peer's own final state, and only peers never met vouch "
                f"for it (at most {NEAR_STEPS:g})")

    # ---- a unit that starts where the run is over ------------------------------------------------------
    def final_at_start(self) -> str | None:
        """The fingerprint of the final state the believed peers agree on if most of them have applied the last
        round and this unit has not, else None (one identity's claim of the end, or a minority's, ends nothing)."""
        sync, last = self.sync, self.last
        if sync.num_rounds is None or sync.stage.applied_round >= last:
            return None
        others = sync._others()
        if not self.open(others):
            return None
        if not sync._majority(others, lambda r: r.applied_round >= last):
            return None
        votes = anchor_votes(others, last)
        return canonical_of(votes) if votes else None

    def download_at_start(self, fingerprint: str):
        """That final state from the peers holding it, taken only where two believed records vouch for it (one where
        a single peer is believed), as any reload asks; None if none could be had."""
        return self.sync.fetcher.download_final(
            fingerprint, self.last,
            lambda meta, tensors, vouched: None if vouched else "the peers this stage believes do not vouch for it",
            at_round=self.sync.num_rounds)

    def take_at_start(self, state, behind: bool = False) -> None:
        """Become the holder of the final ``state`` at the run's last inner step: nothing is left to train.
        ``behind``: the peer was training, rounds behind the swarm, rather than starting."""
        sync = self.sync
        when = "while this peer was behind" if behind else "before this peer joined"
        sync.take_reload(state, f"the run ended (round {self.last} applied by the swarm) {when}: its final state",
                         sync.num_rounds * sync.stage.diloco_cfg.inner_steps)

    def give_up(self, why: str) -> None:
        """The run's end as claimed cannot be taken (``why``): this stage trains on, and does not wait for it again."""
        sync = self.sync
        self.given_up, self.told = True, True
        logger.warning(f"{sync.stage.label}: the peers this stage believes say run {sync.fetcher.run_id} is over "
                       f"({sync.num_rounds} rounds), but {why}: it trains on, alone if nobody else is left (a run "
                       f"that is really over can be continued with a larger --train.num_rounds, or started anew "
                       f"with another --run-id)")


# ---- the peer's units together (every unit of every stage of the peer, or none: SyncGroup's collectives) ----------
END_POLL_S = 1.0  # how often a peer behind a swarm at the run's end reads the records for its final state


def take_the_end(syncs, executor, behind: bool = False) -> bool:
    """Where the run is over for every unit of the peer, take its final state and skip to the end
    (:meth:`RunEnd.take_at_start`, every unit of every stage or none); whether it was taken. ``behind``: the peer was
    training, rounds behind the swarm, rather than starting."""
    finals = [sync.end.final_at_start() for sync in syncs]
    if executor.any_stage(None in finals):
        return False
    states = [sync.end.download_at_start(final) for sync, final in zip(syncs, finals)]
    if executor.any_stage(None in states):
        # never a reason to train nothing or to exit: what could not be had cannot be verified
        for sync in syncs:
            sync.end.give_up("no peer holding its final state served it (they may have left: their records outlive "
                             "them by minutes)")
        return False
    judge = syncs[0].judge
    why = None if judge is None else judge.judge_all(dict(enumerate(states)))
    if why is not None:
        for sync, state in zip(syncs, states):
            sync.refuse(*state, why)
            sync.end.give_up(f"its final state failed this peer's own check ({why})")
        return False
    for sync, state in zip(syncs, states):
        sync.end.take_at_start(state, behind)
    return True


def wait_for_the_end(syncs, executor, swarm_rounds: list[int]) -> None:
    """Behind a swarm that has trained the run's last round: no round is left to reload into (a donor's state at the
    run's end is refused to a stage behind it, :meth:`StateFetcher.refusal`), so take the run's final state once most
    believed peers have applied the last round (:func:`take_the_end`, as a peer that starts after the end does),
    polling until then, at most the units' ``end_wait_s``. The peer announces the swarm's round first: a finishing
    peer waits for a peer on the last round to apply it before it leaves (:meth:`RunEnd.step`), so the holders of the
    final state are still there to serve it. Where it does not come in time, the peer trains its round and tries
    again after it (and stops with the run-over error once the holders have left). Without this wait, a peer
    restarted on its checkpoint just as its groupmates finish the run would train the rounds left alone and end on
    another model."""
    for sync, swarm_round in zip(syncs, swarm_rounds):
        sync.swarm.announce(sync.stage.position(), max(swarm_round, sync.stage.round_index))
    bound = max(sync.end_wait_s for sync in syncs)
    logger.info(f"Behind a swarm at the run's end (round {max(swarm_rounds)}): waiting up to {bound:.0f} s for its "
                f"final state")
    deadline = time.monotonic() + bound
    while True:
        if take_the_end(syncs, executor, behind=True):
            return
        if executor.any_stage(any(sync.end.given_up for sync in syncs)):
            for sync in syncs:  # its final state could not be had or failed the own check: it trains on (said once)
                sync.restore_record()
            return
        if executor.any_stage(time.monotonic() >= deadline):
            for sync in syncs:
                sync.restore_record()
            break
        time.sleep(END_POLL_S)
    logger.warning(f"The swarm is at the run's end but its final state could not be had within {bound:.0f} s; "
                   f"trying again after the next round")
