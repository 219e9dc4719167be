"""Keeping a stage in step with the swarm: newcomers, peers that fell behind, anchors that diverged.

Decisions come from the swarm's progress records (round, last applied round and anchor fingerprint of every
live stage process); states come from other peers through hivemind's state sharing
(:mod:`p2p_diloco.round.swarm_state`):

- at start, a stage (new or resumed) reloads when another peer is two rounds ahead of it, or one round ahead
  with this stage's round already applied (a peer one whole round behind can never again meet the others'
  round key), or, resumed with a round in flight, when no other peer can still average that round;
  otherwise it trains its round and joins the others' averaging of it (in delayed mode a peer
  on the next round is still averaging this one);
- after every round end, a stage that is behind reloads; one whose anchor fingerprint for an applied round
  is not the swarm's canonical one (most votes, ties go to the smallest node id; a round of its fell
  back while theirs averaged) ``resync``s its anchor and momentum from a peer at the same point, keeping its
  own progress; peers holding the canonical anchor rank first as donors. Records carry the anchor after the
  applied round and the one before, so a stage ending its round just after the others applied the next
  average (delayed mode applies it a few steps into the round) still compares. A stage that reloaded from a donor
  with a round in flight (delayed mode) knows its anchor lacks that round's average: its own anchor gets no
  vote from that round on, so it resyncs as soon as one other peer has published a later anchor.

Whom it believes, in order (a private swarm's members; the peers met in recent groups; a newcomer's bootstrap
peers; every signed record), is :mod:`p2p_diloco.training.witnesses`.

When the peers of one level give no usable state (a hostile groupmate that alone shared a group with this stage),
the next levels count for that download, in turn. Being behind takes a majority of the believed records, not one
record with a high round. The state is the whole of it: records carry a fingerprint of anchor, outer momentum and
counts (``swarm_state.fingerprint``), a downloaded state is taken only if its fingerprint is the one the
believed records agree on for its applied round, vouched for by two of them (one where a single peer is believed),
its round is not behind this stage's nor the swarm's, and it is below the run's end. Donors are the peers whose
record holds the agreed state (self-declared donor priorities are ignored): the believed ones first, those that
another believed peer vouches for before those only they vouch for (a record a round ahead with a state nobody else
holds is asked last), then other signed records holding that same state (the bytes are checked all the same). Any
exception while handling a donor's data is that donor's: its state is refused and the next donor asked. A donor that
serves a state its own signed record contradicts (and not the agreed one) is lying: its records count for nothing
for :data:`DISCREDIT_ROUNDS` rounds.

The stages of a pipelined peer change rounds together or not at all. Called by the trainer. Whose records count
and which donors hold the agreed state: :mod:`p2p_diloco.training.witnesses`; a state's download and its checks:
:mod:`p2p_diloco.training.fetch`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from p2p_diloco.medians import lower_median
from p2p_diloco.round.stage import Stage
from p2p_diloco.swarm.discovery.progress import moved_past
from p2p_diloco.training.fetch import StateFetcher
from p2p_diloco.training.own_check import OwnCheck
from p2p_diloco.training.run_end import RunEnd, take_the_end, wait_for_the_end
from p2p_diloco.training.witnesses import REFUSED_ROUNDS, Witnesses, anchor_votes, canonical_of

logger = logging.getLogger(__name__)
REMEMBERED_ROUNDS = 4
# a peer's stage processes agree on one reload point this many times at most, downloading again the states a round
# behind the others' in between; then they train the round and try again after it
RELOAD_ATTEMPTS = 3
JUDGED_ATTEMPTS = 2  # downloads in one reload decision when the own check refuses the first state


class SwarmSync:
    """Reloads and resyncs one stage.

    Args:
        stage: the stage.
        swarm: its :class:`~p2p_diloco.swarm.SwarmLink`.
        executor: the peer's executor (stages of a pipeline agree through it).
        run_id: the run.
        download_timeout_s: bound of one state download.
        num_rounds: the run's end (``train.num_rounds``): a state at or past it is refused.
        allowlist: ``averaging.allowlist`` (a private swarm's peer ids): only their records count.
        bootstrap: the peer ids of ``dht.initial_peers``: what a stage that has met nobody believes, if they have
            records (see the module docstring).
        verify_wait_s: how long a downloaded state may wait for the records that vouch for its anchor (a donor serves
            its anchor after an average it has not published yet; the records follow within a few steps).
        end_wait_s: how long a stage behind a swarm that trained the run's last round waits for the swarm to apply
            it, to take the final state (:func:`~p2p_diloco.training.run_end.wait_for_the_end`): the bound of that
            round's averaging.
    """

    def __init__(self, stage: Stage, swarm, executor, run_id: str, download_timeout_s: float,
                 num_rounds: int | None = None, allowlist=(), verify_wait_s: float = 30.0, bootstrap=(),
                 end_wait_s: float = 90.0):
        self.stage, self.swarm, self.executor, self.num_rounds = stage, swarm, executor, num_rounds
        self.end_wait_s = end_wait_s
        self.witnesses = Witnesses(swarm.node, lambda: stage.round_index, allowlist, bootstrap)
        self.fingerprints: dict[int, str] = {}  # applied round -> this stage's state fingerprint after it
        self.fetcher = StateFetcher(stage, swarm, self.witnesses, self.fingerprints, run_id, download_timeout_s,
                                    num_rounds, verify_wait_s)
        self.events: list[dict] = []
        self.end = RunEnd(self)
        self.holds_canonical = True  # this stage's anchor is the one the swarm agrees on (see _diverged_round)
        self.canonical: str | None = None  # that anchor's fingerprint, for the last diverged round
        # a round this stage's anchor lacks: a reload in delayed mode from a donor whose last round was still
        # averaging (that average goes to the donor's group only). Until a resync, this stage's anchor gets no
        # vote from that round on: where only one other peer has published a round yet, the tie-break must not
        # make the anchor known to be off the canonical one (the reloaded peer would then never resync)
        self.missed_round: int | None = None
        # this peer's own check of any state offered to it (its held-out loss: own_check.py), set by its SyncGroup;
        # None only where a test drives the records logic alone
        self.judge: OwnCheck | None = None
        self.unit = 0  # this unit's index among the judge's
        self.refusals = 0  # states from others refused by that check

    def remember(self, fingerprint: str) -> None:
        """Note this stage's anchor fingerprint after its last applied round."""
        if self.stage.applied_round >= 0:
            self.fingerprints[self.stage.applied_round] = fingerprint
            for old in sorted(self.fingerprints)[:-REMEMBERED_ROUNDS]:
                del self.fingerprints[old]

    def _others(self) -> list:
        return self.witnesses.counted(self.swarm.others())

    def _actionable(self, others) -> list:
        """``others`` less the records at or past the run's end where this stage cannot act on that claim: they are
        of identities it has no reason to believe (:meth:`Witnesses.earned`), or the final state they claim could
        not be had or failed this peer's own check (:attr:`RunEnd.given_up`). A claim that the run is over is never
        a reason to train nothing: the stage trains, and says so once."""
        if self.num_rounds is None:
            return others
        # past the run's end itself (a round after its last one, or that round applied and more): no honest peer
        # says that, and there is no final state to wait for
        others = [r for r in others if r.round <= self.num_rounds and r.applied_round < self.num_rounds]
        if self.end.open(others):
            return others
        kept = [r for r in others if r.round < self.num_rounds]
        if len(kept) < len(others) and not self.end.told:
            self.end.told = True
            why = "its final state could not be had or failed this peer's own check" if self.end.given_up else \
                "they are peers this stage has never averaged with"
            logger.warning(f"{self.stage.label}: {len(others) - len(kept)} record(s) say run {self.fetcher.run_id} "
                           f"is over, and this stage cannot verify it ({why}); it trains on")
        return kept

    @staticmethod
    def _majority(others, ahead) -> bool:
        """Whether more than half of ``others`` are ``ahead``: one record, forged or stale, is not the swarm."""
        return 2 * sum(1 for r in others if ahead(r)) > len(others)

    @staticmethod
    def _ahead_of(mine: int):
        """A record of a peer this stage cannot meet in its round any more: two rounds ahead, or one round ahead
        with this stage's round already applied (one on the next round that has not applied this one is still
        averaging it, and can be joined)."""
        return lambda r: r.round > mine + 1 or (r.round == mine + 1 and r.applied_round >= mine)

    def at_start(self, resumed: bool) -> None:
        SyncGroup([self], self.executor, self.judge).at_start(resumed)

    def after_round(self) -> None:
        SyncGroup([self], self.executor, self.judge).after_round()

    def behind_at_start(self, resumed: bool) -> tuple[bool, str, int]:
        """Whether this stage must reload before its first round: (behind, why, the swarm's round)."""
        others = self._actionable(self._others())
        swarm_round = lower_median([r.round for r in others]) if others else 0
        mine = self.stage.round_index
        # a peer one round ahead whose average of this stage's round is still in flight (delayed mode: it is
        # applied at the end of the next round) can still be joined in that round: no reload then (a reload
        # skips the round the others are still matching for, and they fall back on it)
        behind = self._majority(others, self._ahead_of(mine))
        reason = "joining the swarm" if not resumed else \
            f"{swarm_round - self.stage.round_index} round(s) behind the swarm"
        # resumed with a round in flight (delayed/eager) that no other peer can still average: its average cannot
        # be had any more and the others' anchors hold it; waiting out the round's timeouts for it leaves a
        # restarted peer behind a fast swarm to the run's end
        pending = self.stage.pending
        if not behind and pending is not None and not pending.settled and moved_past(others, pending.round_index):
            behind, reason = True, f"round {pending.round_index}, in flight here, was averaged without this peer"
        return behind, reason, swarm_round

    def behind_after_round(self) -> tuple[bool, str, int]:
        """Whether this stage must reload after its round end: (behind, why, the swarm's round)."""
        others = self._actionable(self._others())
        swarm_round = lower_median([r.round for r in others]) if others else 0
        mine = self.stage.round_index
        if self.stage.diloco_cfg.round_end == "swarm":
            # a peer that ended this stage's round (it publishes the next one before averaging) is still
            # averaging it until it applies it: this stage ends its round at its next step and joins them
            # (a reload instead loses this stage's round in flight and costs it a resync)
            behind = self._majority(others, self._ahead_of(mine))
        else:  # rounds of H steps: a peer a round ahead is a whole round's compute ahead
            behind = self._majority(others, lambda r: r.round > mine)
        return behind, f"{swarm_round - mine} round(s) behind the swarm", swarm_round

    def resync_if_diverged(self) -> None:
        diverged = self._diverged_round(self._others())
        if diverged is not None:
            self._resync(diverged)

    def _diverged_round(self, others) -> int | None:
        """The newest applied round for which this stage's anchor is not the swarm's canonical one, or None.

        The canonical anchor after a round is the fingerprint most stage processes report for it; a tie goes to
        the anchor held by the smallest node id. Every peer computes the same from the same records, so exactly
        the peers off it resync, also when there is no majority (two survivors of a broken round, each with its
        own anchor, would otherwise keep averaging pseudo-gradients onto different anchors forever). The
        tie-break must not change from round to round: peers compare at whichever applied round their records
        happen to share, and a tie-break by the fingerprint itself could name one peer at one round and the
        other at the next, so that neither ever resyncs."""
        for applied, mine in sorted(self.fingerprints.items(), reverse=True):
            # a peer that applied the next round since (delayed mode: a few steps into it) still tells its anchor
            # after this one: a peer that ends its rounds a little behind the others compares all the same
            holders = anchor_votes(others, applied)
            if not holders:
                continue
            known_off = self.missed_round is not None and applied >= self.missed_round
            if not known_off:
                holders.setdefault(mine, []).append(self.swarm.node)
            canonical = canonical_of(holders)
            self.holds_canonical, self.canonical = canonical == mine, canonical
            if self.holds_canonical:
                self.missed_round = None  # another peer holds this anchor too: it is not off after all
            return None if self.holds_canonical else applied
        self.holds_canonical = True  # nobody to compare with
        return None

    def reload_state(self, swarm_round: int, at_least_round: int | None = None):
        """Step 1 of a reload: announce the swarm's round (the others count this stage in while it downloads) and
        download a state not behind this stage or the swarm (the records announce the next round as a round
        ends), nor behind ``at_least_round``; None if none could be had."""
        if swarm_round > self.stage.round_index:
            self.swarm.announce(self.stage.position(), swarm_round)
        floor = max(self.stage.round_index, swarm_round - 1, at_least_round if at_least_round is not None else -1)
        return self.fetcher.download(at_least_round=floor)

    def take_reload(self, state, reason: str, inner_step: int) -> None:
        """Step 2 of a reload: become the donor of ``state`` at ``inner_step`` (agreed by the whole peer)."""
        meta, tensors = state
        self.stage.adopt(meta, tensors, "reload", inner_step=inner_step)
        self.fingerprints.clear()
        # a donor two rounds past its anchor has a round in flight whose average this stage cannot get
        self.missed_round = meta["applied_round"] + 1 if meta["round"] >= meta["applied_round"] + 2 else None
        self.holds_canonical = self.missed_round is None
        self._record("reload", reason, meta)

    def at_end(self, deadline: float) -> None:
        """The run's end, with the last round applied: take the swarm's final state if this stage does not hold it
        (:class:`~p2p_diloco.training.run_end.RunEnd`; called again until the swarm agrees)."""
        self.end.step(deadline)

    def agreed_at_end(self, believed_only: bool = False) -> bool:
        """Whether every other finished peer holds this stage's final state (:meth:`RunEnd.agreed`)."""
        return self.end.agreed(believed_only)

    def canonical_if_off(self, applied_round: int) -> str | None:
        """The believed peers' canonical state after ``applied_round`` if this stage's is not it, else None."""
        return self.canonical if self._diverged_round(self._others()) == applied_round else None

    def resync(self, diverged_round: int) -> None:
        """Take the believed peers' canonical state (see :meth:`resync_if_diverged`)."""
        self._resync(diverged_round)

    def _resync(self, diverged_round: int) -> None:
        state = self.fetcher.download(at_least_round=self.stage.round_index, at_most_round=self.stage.round_index)
        if state is None:
            return
        meta, tensors = state
        if meta["round"] > self.stage.round_index:
            # the donor trains a later round: taking its anchor while staying on this round would leave this
            # stage a round behind with a round nobody else averages (it would resync, then reload, then resync
            # again, round after round). A reload, decided by all stages together, catches up instead.
            logger.info(f"{self.stage.label}: the donor is on a later round ({meta['round']}, this "
                        f"stage {self.stage.round_index}); resync later")
            return
        # the anchors are comparable by the rounds they took, not by the round each peer trains in (a donor can
        # be a little behind or ahead in time); a donor missing rounds this peer applied cannot serve it
        if meta["applied_round"] < self.stage.applied_round:
            logger.info(f"{self.stage.label}: the donor's anchor is older (applied "
                        f"{meta['applied_round']}, this stage {self.stage.applied_round}); resync later")
            return
        why = self.own_check(meta, tensors)
        if why is not None:
            self.refuse(meta, tensors, why)
            return
        self.take_resync(meta, tensors, f"the anchor after round {diverged_round} differed from the swarm's")

    def own_check(self, meta: dict, tensors) -> str | None:
        """Why this unit's own check (:meth:`OwnCheck.judge_unit`) refuses a state for it alone, or None."""
        return None if self.judge is None else self.judge.judge_unit(self.unit, meta, tensors)

    def refuse(self, meta: dict, tensors, why: str) -> None:
        """A state that passed the records' checks failed this peer's own: its donor and every record vouching for it
        count for nothing for a few rounds (the next download asks others), and it is logged."""
        self.refusals += 1
        fingerprint = self.stage.served_fingerprint(meta, tensors)
        vouchers = set(self.witnesses.discredit_vouchers(self.swarm.others(), meta["applied_round"], fingerprint))
        if self.fetcher.last_donor is not None:
            self.witnesses.discredit(self.fetcher.last_donor, REFUSED_ROUNDS)
            vouchers.add(self.fetcher.last_donor)
        logger.warning(f"{self.stage.label}: refused a state of round {meta['round']} (anchor after round "
                       f"{meta['applied_round']}) that {len(vouchers)} peer(s) vouched for: {why}. Their records count "
                       f"for nothing here for {REFUSED_ROUNDS} rounds")

    def restore_record(self) -> None:
        """Publish this stage's own round again after announcing another it did not reach (a reload refused or not
        had): the others read a record of a round it is not on as a peer that moved past theirs."""
        self.swarm.announce(self.stage.position(), self.stage.round_index)

    def take_resync(self, meta: dict, tensors, reason: str) -> None:
        """Take a downloaded (checked) state as a resync: its anchor and momentum, this stage's own progress kept."""
        self.stage.adopt(meta, tensors, "resync")
        self.fingerprints.clear()
        self.missed_round = None
        self._record("resync", reason, meta)

    def _record(self, kind: str, reason: str, meta: dict) -> None:
        logger.warning(f"{self.stage.label}: {kind} from a peer ({reason}); now at round "
                       f"{self.stage.round_index}, anchor after round {self.stage.applied_round}")
        self.events.append({"action": kind, "reason": reason, "round": self.stage.round_index,
                            "applied_round": self.stage.applied_round, "donor_round": meta["round"],
                            **self.fetcher.last_download})


class SyncGroup:
    """The syncs of one stage process (one per fragment it holds; one for its stage when the run averages by stage),
    deciding together with the peer's other stage processes: a reload moves every fragment and every stage of the
    peer to the same round and inner step, or none (the trainer's inner steps are the peer's, one clock for all);
    a resync is each fragment's own (it keeps the round and the progress).

    The collectives through ``executor`` are the same in number on every stage process of the peer, whatever
    fragments each holds (one decision, one agreement on the reload point): a stage that decides alone waits in
    the reload's collective while another trains on, and the peer hangs."""

    def __init__(self, syncs: list[SwarmSync], executor, own_check: OwnCheck | None = None):
        self.syncs, self.executor, self.own_check = syncs, executor, own_check
        for unit, sync in enumerate(syncs):
            sync.judge, sync.unit = own_check, unit

    def at_start(self, resumed: bool) -> None:
        if not take_the_end(self.syncs, self.executor):
            self._reload_if_behind([sync.behind_at_start(resumed) for sync in self.syncs])

    def after_round(self) -> None:
        if not self._reload_if_behind([sync.behind_after_round() for sync in self.syncs]):
            for sync in self.syncs:
                sync.resync_if_diverged()

    def agree_at_end(self, deadline: float, on_change, poll_s: float = 1.0) -> bool:
        """The run's end: each unit takes the swarm's final state if it does not hold it (:meth:`SwarmSync.at_end`),
        ``on_change()`` noting what changed, and stays while another finished peer holds another state (it may be
        downloading this one), deciding again as the votes move; at most until ``deadline``. Whether every unit's
        finished peers agree. No collectives: a resync is each unit's own."""
        while True:
            for sync in self.syncs:
                sync.at_end(deadline)
            on_change()
            if all(sync.agreed_at_end() for sync in self.syncs):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def believed_agree_at_end(self) -> bool:
        """Whether every unit's believed peers hold its final anchor (:meth:`SwarmSync.agreed_at_end`)."""
        return all(sync.agreed_at_end(believed_only=True) for sync in self.syncs)

    def _reload_if_behind(self, decisions: list[tuple[bool, str, int]]) -> bool:
        """Reload every fragment when any fragment of any stage of the peer is behind; whether the peer decided to.

        The reload point is one inner step t for the whole peer, inside the round of every fragment's state (with
        streaming sync the fragments' rounds end at different steps: states of rounds 9 and 8 fit one step when
        the round-8 fragment's round ends after the round-9 one's began), the most advanced such step up to where
        the donors were."""
        behind = any(b for b, _, _ in decisions)
        if not self.executor.any_stage(behind):
            return False
        swarm_rounds = [swarm_round for _, _, swarm_round in decisions]
        if self.executor.any_stage(any(sync.num_rounds is not None and swarm_round >= sync.num_rounds
                                       for sync, swarm_round in zip(self.syncs, swarm_rounds))):
            wait_for_the_end(self.syncs, self.executor, swarm_rounds)
            return True
        for attempt in range(JUDGED_ATTEMPTS):
            if attempt:
                # the refused state's vouchers count for nothing now: decided again on the other records, the next
                # download asks others (a newcomer first sent to made-up identities' state reaches the swarm's in
                # the same decision, not after a round of training alone)
                decisions = [sync.behind_after_round() for sync in self.syncs]
                if not self.executor.any_stage(any(b for b, _, _ in decisions)):
                    break
                swarm_rounds = [swarm_round for _, _, swarm_round in decisions]
            if self._reload(decisions, swarm_rounds) != "refused":
                break
        return True

    def _reload(self, decisions: list[tuple[bool, str, int]], swarm_rounds: list[int]) -> str:
        """One try of :meth:`_reload_if_behind`: "taken", "none" (no usable state) or "refused" (by the own check)."""
        states = self._download_all(swarm_rounds)
        for attempt in range(RELOAD_ATTEMPTS):
            local = None if None in states else \
                (*self._window(zip(self.syncs, states)), max(state[0]["inner_step"] for state in states))
            points = self.executor.common_value(local)
            lo = None if None in points else max(p[0] for p in points)
            hi = None if None in points else min(p[1] for p in points)
            if lo is not None and lo <= hi:
                break
            if lo is None or attempt == RELOAD_ATTEMPTS - 1:
                # a peer's stages and fragments change rounds together or not at all
                where = ", ".join(f"{s.stage.label}: " + ("none" if st is None else
                                                          f"round {st[0]['round']} at step {st[0]['inner_step']}")
                                  for s, st in zip(self.syncs, states))
                logger.warning(f"Behind the swarm, but no usable state for every fragment and stage of this peer could "
                               f"be downloaded now ({where}); trying again after the next round")
                for sync in self.syncs:
                    sync.restore_record()
                return "none"
            # another stage process of this peer got states of a later round (the swarm moved on while they came;
            # a newcomer next to a fast swarm would train a whole round alone before trying again):
            # the states that end before the peer's common window begins are downloaded again, from its round
            states = self._download_again(states, swarm_rounds, self._late(states, lo), lo)
        step = max(lo, min(hi, max(p[2] for p in points)))
        if self.own_check is not None:  # every stage process of the peer, together
            why = self.own_check.judge_all(dict(enumerate(states)))
            if why is not None:
                for sync, state in zip(self.syncs, states):
                    sync.refuse(*state, why)
                    sync.restore_record()
                return "refused"
        for sync, state, (b, reason, _) in zip(self.syncs, states, decisions):
            sync.take_reload(state, reason if b else "another stage or fragment of this peer is reloading", step)
        return "taken"

    @staticmethod
    def _window(pairs) -> tuple[int, int]:
        """The inner steps t at which each (sync, state) pair's state round is its fragment's round (``round_at(t)``):
        [lo, hi], empty when lo > hi."""
        pairs = list(pairs)
        lo = max(sync.stage.round_start_step(state[0]["round"]) for sync, state in pairs)
        hi = min(sync.stage.round_end_step(state[0]["round"]) - 1 for sync, state in pairs)
        return lo, hi

    def _late(self, states: list, lo: int) -> list[int]:
        """The units whose state is missing or of a round that ends before inner step ``lo``."""
        return [i for i, (sync, state) in enumerate(zip(self.syncs, states))
                if state is None or sync.stage.round_end_step(state[0]["round"]) - 1 < lo]

    def _download_again(self, states: list, swarm_rounds: list[int], late: list[int], lo: int) -> list:
        """``states`` with the ``late`` ones downloaded again, at least from the round that holds inner step ``lo``
        (each unit from its own donors, at the same time)."""
        floors = {i: self.syncs[i].stage.round_at(lo) for i in late}
        with ThreadPoolExecutor(max(len(late), 1), thread_name_prefix="reload") as pool:
            again = list(pool.map(lambda i: self.syncs[i].reload_state(swarm_rounds[i], floors[i]), late))
        states = list(states)
        for i, state in zip(late, again):
            states[i] = state
        return states

    def _download_all(self, swarm_rounds: list[int]) -> list:
        """Every unit's state for a reload, downloaded at the same time (each from its own donors); a unit whose
        state's round ends before another's begins is downloaded again (twice at most): the swarm moved on while
        the first came (fragment states of rounds 9 and 10, say, leave the peer without a reload for a round)."""
        if len(self.syncs) == 1:
            return [self.syncs[0].reload_state(swarm_rounds[0])]
        with ThreadPoolExecutor(len(self.syncs), thread_name_prefix="reload") as pool:
            states = list(pool.map(lambda i: self.syncs[i].reload_state(swarm_rounds[i]), range(len(self.syncs))))
        for _ in range(2):
            got = [(sync, state) for sync, state in zip(self.syncs, states) if state is not None]
            if not got:
                break
            lo, _ = self._window(got)
            late = self._late(states, lo)
            if not late:
                break
            states = self._download_again(states, swarm_rounds, late, lo)
        return states
