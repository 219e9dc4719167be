"""Keeping a stage in step with the swarm: newcomers, peers that fell behind, anchors that diverged.

Decisions come from the swarm's progress records (round, last applied round and anchor fingerprint of every
live stage process); states come from other peers through hivemind's state sharing
(:mod:`p2p_diloco.training.state.swarm_state`):

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

The stages of a pipelined peer change rounds together or not at all. Called by the trainer.
"""

from __future__ import annotations

import logging
import math
import time

from p2p_diloco.swarm.discovery.progress import moved_past
from p2p_diloco.training.stage import Stage
from p2p_diloco.training.state.swarm_state import StateError
from p2p_diloco.training.summary import anchor_fingerprint

logger = logging.getLogger(__name__)
REMEMBERED_ROUNDS = 4


class SwarmSync:
    """Reloads and resyncs one stage.

    Args:
        stage: the stage.
        swarm: its :class:`~p2p_diloco.swarm.SwarmLink`.
        executor: the peer's executor (stages of a pipeline agree through it).
        run_id: the run.
        download_timeout_s: bound of one state download.
    """

    def __init__(self, stage: Stage, swarm, executor, run_id: str, download_timeout_s: float):
        self.stage, self.swarm, self.executor, self.run_id = stage, swarm, executor, run_id
        self.download_timeout_s = download_timeout_s
        self.fingerprints: dict[int, str] = {}  # applied round -> this stage's anchor fingerprint after it
        self.events: list[dict] = []
        self.last_download: dict = {}  # duration and bytes of the last state download
        self.holds_canonical = True  # this stage's anchor is the one the swarm agrees on (see _diverged_round)
        self.canonical: str | None = None  # that anchor's fingerprint, for the last diverged round
        # a round this stage's anchor lacks: a reload in delayed mode from a donor whose last round was still
        # averaging (that average goes to the donor's group only). Until a resync, this stage's anchor gets no
        # vote from that round on: where only one other peer has published a round yet, the tie-break must not
        # make the anchor known to be off the canonical one (seen in CI: the reloaded peer never resynced)
        self.missed_round: int | None = None

    def remember(self, fingerprint: str) -> None:
        """Note this stage's anchor fingerprint after its last applied round."""
        if self.stage.applied_round >= 0:
            self.fingerprints[self.stage.applied_round] = fingerprint
            for old in sorted(self.fingerprints)[:-REMEMBERED_ROUNDS]:
                del self.fingerprints[old]

    def rank_as_donor(self) -> None:
        """Newcomers download from the most advanced stage first (a client-mode peer serves no state)."""
        if self.stage.averager is not None and not self.stage.averager.client_mode:
            bonus = 0.5 if self.holds_canonical else 0.0  # a peer off the canonical anchor is asked last
            self.stage.averager.state_sharing_priority = float(self.stage.applied_round + 1) + bonus

    def at_start(self, resumed: bool) -> None:
        others = self.swarm.others()
        swarm_round = max((r.round for r in others), default=0)
        mine = self.stage.round_index
        # a peer one round ahead whose average of this stage's round is still in flight (delayed mode: it is
        # applied at the end of the next round) can still be joined in that round: no reload then (reloading
        # skipped the round the others were still matching for, and they fell back on it; seen in CI)
        behind = any(r.round > mine + 1 or (r.round == mine + 1 and r.applied_round >= mine) for r in others)
        reason = "joining the swarm" if not resumed else \
            f"{swarm_round - self.stage.round_index} round(s) behind the swarm"
        # resumed with a round in flight (delayed/eager) that no other peer can still average: its average cannot
        # be had any more and the others' anchors hold it; waiting out the round's timeouts for it left a
        # restarted peer behind a fast swarm to its end (seen in make test)
        pending = self.stage.pending
        if not behind and pending is not None and not pending.settled and moved_past(others, pending.round_index):
            behind, reason = True, f"round {pending.round_index}, in flight here, was averaged without this peer"
        # the stages see the records at slightly different times: they decide together, or one would wait in the
        # reload's collective while another trains on (a hang seen in CI)
        if self.executor.any_stage(behind):
            self._reload(reason if behind else "another stage of this peer is reloading", swarm_round)

    def after_round(self) -> None:
        others = self.swarm.others()
        swarm_round = max((r.round for r in others), default=0)
        mine = self.stage.round_index
        if self.stage.diloco_cfg.round_end == "swarm":
            # a peer that ended this stage's round (it publishes the next one before averaging) is still
            # averaging it until it applies it: this stage ends its round at its next step and joins them
            # (reloading instead lost this stage's round in flight and cost it a resync; seen in make test)
            behind = any(r.round > mine + 1 or (r.round == mine + 1 and r.applied_round >= mine) for r in others)
        else:  # rounds of H steps: a peer a round ahead is a whole round's compute ahead
            behind = swarm_round > mine
        if self.executor.any_stage(behind):  # the stages of a pipeline decide together (see at_start)
            self._reload(f"{swarm_round - mine} round(s) behind the swarm" if behind
                         else "another stage of this peer is reloading", swarm_round)
            return
        diverged = self._diverged_round(others)
        if diverged is not None:
            self._resync(diverged)
        self.rank_as_donor()

    def _diverged_round(self, others) -> int | None:
        """The newest applied round for which this stage's anchor is not the swarm's canonical one, or None.

        The canonical anchor after a round is the fingerprint most stage processes report for it; a tie goes to
        the anchor held by the smallest node id. Every peer computes the same from the same records, so exactly
        the peers off it resync, also when there is no majority (two survivors of a broken round, each with its
        own anchor, would otherwise keep averaging pseudo-gradients onto different anchors forever). The
        tie-break must not change from round to round: peers compare at whichever applied round their records
        happen to share, and a tie-break by the fingerprint itself could name one peer at one round and the
        other at the next, so that neither ever resyncs (seen on a loaded machine)."""
        for applied, mine in sorted(self.fingerprints.items(), reverse=True):
            # a peer that applied the next round since (delayed mode: a few steps into it) still tells its anchor
            # after this one: a peer that ends its rounds a little behind the others compares all the same
            theirs = [(r.node, r.anchor) for r in others if r.applied_round == applied and r.anchor] + \
                [(r.node, r.prior_anchor) for r in others if r.applied_round == applied + 1 and r.prior_anchor]
            if not theirs:
                continue
            known_off = self.missed_round is not None and applied >= self.missed_round
            holders: dict[str, list[str]] = {} if known_off else {mine: [self.swarm.node]}
            for node, fingerprint in theirs:
                holders.setdefault(fingerprint, []).append(node)
            canonical = min(holders, key=lambda fp: (-len(holders[fp]), min(holders[fp])))
            self.holds_canonical, self.canonical = canonical == mine, canonical
            if self.holds_canonical:
                self.missed_round = None  # another peer holds this anchor too: it is not off after all
            return None if self.holds_canonical else applied
        self.holds_canonical = True  # nobody to compare with
        return None

    def _download(self):
        """A checked state from some peer, or None (logged). The donor's inner step is moved on by the steps it
        trained while the state travelled, so that a reloading peer reaches the round's end with it."""
        started = time.monotonic()
        downloaded = self.stage.averager.download_state(timeout_s=self.download_timeout_s) \
            if self.stage.averager is not None else None
        if downloaded is None:
            return None
        meta, tensors = downloaded
        self.last_download = {"download_s": round(time.monotonic() - started, 3),
                              "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
        try:
            self.stage.check_state(self.run_id, meta, tensors)
        except StateError as e:
            logger.warning(f"Stage {self.stage.stage_index}: refused a downloaded state: {e}")
            return None
        step_s = meta.get("seconds_per_step")
        if isinstance(step_s, float) and math.isfinite(step_s) and step_s > 0:
            H = self.stage.diloco_cfg.inner_steps
            travelled = int((time.monotonic() - started) / step_s)
            meta["inner_step"] = min(meta["inner_step"] + travelled, meta["round_start_step"] + H - 1)
        return meta, tensors

    def _reload(self, reason: str, swarm_round: int) -> None:
        if swarm_round > self.stage.round_index:  # the others count this stage in while it downloads
            self.swarm.announce(self.stage.position(), swarm_round)
        state = self._download()
        points = self.executor.common_value(None if state is None else (state[0]["round"], state[0]["inner_step"]))
        if state is None or None in points or len({r for r, _ in points}) != 1:
            # a pipeline's stages change rounds together or not at all
            logger.warning(f"Stage {self.stage.stage_index}: {reason}, but no usable state could be downloaded "
                           "now; trying again after the next round")
            return
        meta, tensors = state
        self.stage.adopt(meta, tensors, "reload", inner_step=min(step for _, step in points))
        self.fingerprints.clear()
        # a donor two rounds past its anchor has a round in flight whose average this stage cannot get
        self.missed_round = meta["applied_round"] + 1 if meta["round"] >= meta["applied_round"] + 2 else None
        self.holds_canonical = self.missed_round is None
        self._record("reload", reason, meta)

    def _resync(self, diverged_round: int) -> None:
        state = self._download()
        if state is None:
            return
        meta, tensors = state
        if meta["round"] > self.stage.round_index:
            # the donor trains a later round: taking its anchor while staying on this round would leave this
            # stage a round behind with a round nobody else averages (seen under load: resync, then reload, then
            # resync again, round after round). A reload, decided by all stages together, catches up instead.
            logger.info(f"Stage {self.stage.stage_index}: the donor is on a later round ({meta['round']}, this "
                        f"stage {self.stage.round_index}); resync later")
            return
        # the anchors are comparable by the rounds they took, not by the round each peer trains in (a donor can
        # be a little behind or ahead in time); a donor missing rounds this peer applied cannot serve it
        if meta["applied_round"] < self.stage.applied_round:
            logger.info(f"Stage {self.stage.stage_index}: the donor's anchor is older (applied "
                        f"{meta['applied_round']}, this stage {self.stage.applied_round}); resync later")
            return
        if meta["applied_round"] == diverged_round and self.canonical is not None and \
                anchor_fingerprint(tensors[:len(self.stage.anchor)]) != self.canonical:
            logger.info(f"Stage {self.stage.stage_index}: the donor is off the swarm's anchor too; resync later")
            return
        self.stage.adopt(meta, tensors, "resync")
        self.fingerprints.clear()
        self.missed_round = None
        self._record("resync", f"the anchor after round {diverged_round} differed from the swarm's", meta)

    def _record(self, kind: str, reason: str, meta: dict) -> None:
        logger.warning(f"Stage {self.stage.stage_index}: {kind} from a peer ({reason}); now at round "
                       f"{self.stage.round_index}, anchor after round {self.stage.applied_round}")
        self.events.append({"action": kind, "reason": reason, "round": self.stage.round_index,
                            "applied_round": self.stage.applied_round, "donor_round": meta["round"],
                            **self.last_download})
