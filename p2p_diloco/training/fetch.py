"""A stage's state from other peers, for a reload or a resync: asked of the donors its witnesses name, checked
field by field and against the records before anything of it is taken (docs/design.md 3.7, 4.2).

Any exception while handling a donor's data is that donor's: its state is refused and the next donor asked. A donor
that serves a state its own signed record contradicts (and not the agreed one) is lying: its records count for nothing
for a few rounds (:meth:`Witnesses.discredit`).
"""

from __future__ import annotations

import logging
import random
import time

from p2p_diloco.round.stage import Stage
from p2p_diloco.round.swarm_state import StateError
from p2p_diloco.training.witnesses import DISCREDIT_ROUNDS, Witnesses, anchor_votes, canonical_of

logger = logging.getLogger(__name__)

VERIFY_WAIT_ROUNDS = 3  # a training stage waits for a state's second voucher at most this many of its rounds
MIN_VERIFY_WAIT_S = 5.0  # ... and at least this long (records are refreshed at round ends and every 10 s)


class StateFetcher:
    """Downloads and checks one stage's state.

    Args:
        stage: the stage.
        swarm: its :class:`~p2p_diloco.swarm.SwarmLink`.
        witnesses: whose records count (:class:`Witnesses`).
        remembered: applied round -> this stage's own state fingerprint after it (the sync's, shared): a state this
            stage held itself after that round is its own second voucher.
        run_id: the run.
        download_timeout_s: bound of one state download.
        num_rounds: the run's end (``train.num_rounds``): a state at or past it is refused.
        verify_wait_s: how long a downloaded state may wait for the records that vouch for its anchor (a donor serves
            its anchor after an average it has not published yet; the records follow within a few steps).
    """

    def __init__(self, stage: Stage, swarm, witnesses: Witnesses, remembered: dict[int, str], run_id: str,
                 download_timeout_s: float, num_rounds: int | None = None, verify_wait_s: float = 30.0):
        self.stage, self.swarm, self.witnesses, self.remembered = stage, swarm, witnesses, remembered
        self.run_id, self.download_timeout_s = run_id, download_timeout_s
        self.num_rounds, self.verify_wait_s = num_rounds, verify_wait_s
        # the anchor every peer starts from (the run's init seed): a state before any round is checked against it
        self.initial_fingerprint = stage.state_fingerprint()[0] if stage.applied_round < 0 else None
        self.last_download: dict = {}  # duration and bytes of the last state download
        self.last_donor: str | None = None  # who served the last state taken

    def _counted(self) -> list:
        return self.witnesses.counted(self.swarm.others())

    def download(self, at_least_round: int, at_most_round: int | None = None):
        """A checked state from a donor holding the agreed anchor, or None (logged). The donor's inner step is moved
        on by the steps it trained while the state travelled, so that a reloading peer reaches the round's end with
        it. ``at_most_round``: only donors whose records are on that round or before are asked (a resync cannot use
        a later one: downloading it anyway costs a newcomer the seconds in which its next group forms)."""
        if self.stage.averager is None:
            return None
        started = time.monotonic()
        deadline = started + self.download_timeout_s
        asked: set[str] = set()
        if self.witnesses.allowlist:
            return self._download_from(self._counted(), at_least_round, at_most_round, started, deadline, asked)
        # Trust narrowed (against made-up identities) may give nothing: a hostile groupmate that alone shared a
        # group with this stage would otherwise be the only record it believes, it says "behind" and serves states
        # that are refused, and the stage never reloads. The next level counts then, for the donors and the state
        # check alike, for this download only. The levels are read again after each try: a donor discredited by it
        # (see :meth:`_contradicts_own_record`) leaves the level it was in.
        tried: list[frozenset] = []
        widening, state, previous = 0, None, None
        while state is None and time.monotonic() < deadline:
            levels = self.witnesses.levels(self.swarm.others())
            if widening >= len(levels):
                break
            name, level = levels[widening]
            nodes = frozenset(r.node for r in level)
            if nodes in tried:  # (the bootstrap peers are every peer there is, say)
                widening += 1
                continue
            tried.append(nodes)
            if previous is not None:
                logger.warning(f"{self.stage.label}: no usable state from {previous}; asking {name}")
            self.witnesses.widening = widening
            try:
                state = self._download_from(self._counted(), at_least_round, at_most_round, started, deadline, asked)
            finally:
                self.witnesses.widening = 0
            previous = name
        return state

    def _download_from(self, others, at_least_round: int, at_most_round: int | None, started: float,
                       deadline: float, asked: set[str]):
        """:meth:`download` from the donors among ``others`` (then other signed records holding the state they
        agree on) not yet ``asked``."""
        strangers = self.swarm.others()
        donors = self.witnesses.donors(others, own_round=at_most_round, strangers=strangers)
        if at_most_round is not None:
            early = {r.node for r in [*others, *strangers] if r.round <= at_most_round}
            donors = [d for d in donors if d in early]
        if self.num_rounds is not None and self.stage.round_index < self.num_rounds:
            # their state would be refused (past the run's end, :meth:`refusal`): not worth its download
            finished = {r.node for r in [*others, *strangers] if r.round >= self.num_rounds}
            donors = [d for d in donors if d not in finished]
        for donor in donors:
            if donor in asked:
                continue
            asked.add(donor)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            downloaded = self.stage.averager.download_state([donor], timeout_s=remaining)
            if downloaded is None:
                continue
            meta, tensors = downloaded
            self.last_download = {"download_s": round(time.monotonic() - started, 3),
                                  "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
            try:
                refusal = self._refusal_of(donor, meta, tensors, at_least_round, started)
            except Exception as e:  # noqa: BLE001 (whatever the donor's bytes make fail is the donor's offence)
                refusal = f"its state could not be checked ({type(e).__name__}: {e})"
                logger.debug("the check of a donor's state failed", exc_info=True)
            if refusal is not None:
                logger.warning(f"{self.stage.label}: refused the state of {donor}: {refusal}")
                continue
            self.last_donor = donor
            return meta, tensors
        return None

    def download_final(self, fingerprint: str, last: int, refusal, at_round: int | None = None):
        """At the run's end: the state ``fingerprint`` after round ``last`` (the one most finished peers hold, see
        :mod:`~p2p_diloco.training.run_end`), from the peers whose records hold it, believed ones first; or None.
        A served state must be well-formed, of that fingerprint, its own donor's, and of the run's end; then
        ``refusal(meta, tensors, vouched)`` decides (``vouched``: two believed records hold it, one where a single
        peer is believed, as :meth:`refusal` asks of any state). ``at_round``: the round the state's peer is on
        (its ``round``), this stage's own by default (a stage that joins after the run ended: the run's end)."""
        started = time.monotonic()
        deadline = started + self.download_timeout_s
        records = self.witnesses.credited(self.swarm.others())
        counted = self._counted()
        believed = {r.node for r in counted}
        holders = [r.node for r in records if r.applied_round == last and r.anchor == fingerprint]
        votes = anchor_votes(counted, last)
        vouched = bool(believed) and len(set(votes.get(fingerprint, ()))) >= min(2, len(believed))
        for donor in sorted(holders, key=lambda node: (node not in believed, random.random())):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            downloaded = self.stage.averager.download_state([donor], timeout_s=remaining)
            if downloaded is None:
                continue
            meta, tensors = downloaded
            try:
                self.stage.check_state(self.run_id, meta, tensors)
                why = self._contradicts_own_record(donor, meta, tensors)
                if why is None and self.stage.served_fingerprint(meta, tensors) != fingerprint:
                    why = "it is not the final state its record holds"
                at = self.stage.round_index if at_round is None else at_round
                if why is None and (meta["applied_round"], meta["round"]) != (last, at):
                    why = f"it is of round {meta['round']}, applied {meta['applied_round']}, not the run's end"
                why = why or refusal(meta, tensors, vouched)
            except Exception as e:  # noqa: BLE001 (whatever the donor's bytes make fail is the donor's offence)
                why = f"its state could not be checked ({type(e).__name__}: {e})"
            if why is not None:
                logger.warning(f"{self.stage.label}: refused the final state of {donor}: {why}")
                continue
            self.last_download = {"download_s": round(time.monotonic() - started, 3),
                                  "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
            self.last_donor = donor
            return meta, tensors
        return None

    def _refusal_of(self, donor: str, meta: dict, tensors, at_least_round: int, started: float) -> str | None:
        """Why ``donor``'s downloaded state cannot be taken (None: it can; its inner step is then moved on by the
        steps the donor trained while it travelled, so that a reloading peer reaches the round's end with it)."""
        try:
            self.stage.check_state(self.run_id, meta, tensors)  # every field in range before any arithmetic
        except StateError as e:
            return str(e)
        contradiction = self._contradicts_own_record(donor, meta, tensors)
        if contradiction is not None:
            return contradiction
        if meta["round"] < at_least_round:
            return f"its round {meta['round']} is behind {at_least_round}"
        refusal = self.refusal(meta, tensors)
        if refusal is not None:
            return refusal
        step_s = meta["seconds_per_step"]  # 0.0 (not measured yet) or within [1e-6, 86400] s: checked above
        if step_s > 0:
            travelled = int(min(time.monotonic() - started, self.download_timeout_s) / step_s)
            meta["inner_step"] = min(meta["inner_step"] + travelled, self.stage.round_end_step(meta["round"]) - 1)
        return None

    def _contradicts_own_record(self, donor: str, meta: dict, tensors) -> str | None:
        """Why ``donor``'s served state (checked well-formed) is not the one its own signed record claims for that
        round, or None: the record names another fingerprint for the state's applied round (its anchor, or the
        anchor before it for a record one round on). Signed record and served bytes together are the donor's own
        word against itself: its records count for nothing here for :data:`DISCREDIT_ROUNDS` rounds.

        Without it, one groupmate that lies in its records and serves another state would keep an honest peer that
        has fallen a round behind from ever reloading in a swarm of three: the one honest peer ahead finds no second
        voucher (the liar's records contradict it), and the lagging peer trains alone to the run's end, as does the
        newcomer that needs both. A state the counted records agree on is not held against its donor (a
        peer that has just resynced serves the agreed state before its record says so)."""
        applied = meta["applied_round"]
        records = self.swarm.others()  # one read for the donor's claim and the votes
        record = next((r for r in records if r.node == donor), None)
        if record is None:
            return None
        claimed = record.anchor if record.applied_round == applied else \
            record.prior_anchor if record.applied_round == applied + 1 else ""
        fingerprint = self.stage.served_fingerprint(meta, tensors)
        if not claimed or claimed == fingerprint:
            return None
        votes = anchor_votes(self.witnesses.counted(records), applied)
        if votes and canonical_of(votes) == fingerprint:
            return None
        self.witnesses.discredit(donor)
        return (f"its state after round {applied} is not the one its own record claims: its records count for "
                f"nothing here for {DISCREDIT_ROUNDS} rounds")

    def refusal(self, meta: dict, tensors) -> str | None:
        """Why a downloaded (well-formed) state cannot be taken, or None: its round is past the run's end, or its
        anchor is not the one the counted records agree on for its applied round.

        Agreed: the canonical fingerprint of the whole state (:func:`~p2p_diloco.round.swarm_state.fingerprint`: anchor,
        momentum, counts) for that round (most votes, a tie to the smallest node id, as the resync decides),
        confirmed by a second record unless this stage believes one peer only (a swarm of one other peer, one
        bootstrap peer): one record alone, a round ahead of the others with a state only it holds, is what an
        attacker publishes (the honest first peer to apply a round is confirmed by its groupmates within a few
        steps: the wait below). A tie of single votes decides only for a stage that holds a state of that round
        itself: the survivors of a round
        that every member had to apply alone converge on the tie-break's anchor (waiting for a second vote that never
        comes makes a peer late for the next group, which forms without it); a newcomer there keeps waiting. Until
        some record gives one (a donor serves the anchor after an average it may not have published yet), it waits,
        at most ``verify_wait_s``."""
        if self.num_rounds is not None and meta["round"] >= self.num_rounds > self.stage.round_index:
            # (a stage at the run's end itself takes a finished donor's anchor: the agreement at the end)
            return f"its round {meta['round']} is past the run's end ({self.num_rounds} rounds)"
        fingerprint, applied = self.stage.served_fingerprint(meta, tensors), meta["applied_round"]
        if applied < 0:
            return None if fingerprint == self.initial_fingerprint else \
                "its state before any round is not the run's initial one"
        if self.remembered.get(applied) == fingerprint:
            # this stage held that very state after that round itself: the second voucher, and the one it trusts
            # most (a peer reloading onto a groupmate's state it shared finds no other: a hostile third member's
            # records lie, and the groupmate's own record moves on within a round in a fast swarm)
            return None
        deadline = time.monotonic() + self.verify_wait()
        while True:
            others = self._counted()
            votes = anchor_votes(others, applied)
            if votes:
                canonical = canonical_of(votes)
                if fingerprint not in votes or fingerprint != canonical and len(set(votes[canonical])) >= 2:
                    return f"its state after round {applied} is not the one the swarm agrees on"
                alone = len({r.node for r in others}) == 1
                if fingerprint == canonical and (len(set(votes[canonical])) >= 2 or alone
                                                 or applied in self.remembered):
                    return None
            if time.monotonic() >= deadline:
                return f"no two peers agree on the state after round {applied}" if votes else \
                    f"no peer vouches for its state after round {applied}"
            time.sleep(0.5)

    def verify_wait(self) -> float:
        """How long a downloaded state waits for its second voucher: ``verify_wait_s``, and for a stage that trains
        (it knows its step time) at most :data:`VERIFY_WAIT_ROUNDS` of its rounds, at least
        :data:`MIN_VERIFY_WAIT_S`: the wait holds its training, and 30 s of it in a swarm of 2 s rounds leaves a peer
        alone for its next rounds and its groupmates without it."""
        step_s = self.stage.seconds_per_step
        if not step_s > 0:
            return self.verify_wait_s
        rounds_s = VERIFY_WAIT_ROUNDS * self.stage.diloco_cfg.inner_steps * step_s
        return min(self.verify_wait_s, max(MIN_VERIFY_WAIT_S, rounds_s))
