"""Ending the rounds of the units a stage process holds, all at once, and leaving the swarm at the end.

A unit (:class:`~p2p_diloco.training.ledger.Held`: a whole stage, or one fragment) ends its round with its
pseudo-gradient weighted by the tokens it trained in the round and the group size its records lead it to expect.
Several units end theirs at the same time, each in its own thread: one after the other, blocking mode would take F
averagings, and the records' reads of a P = 1 peer's four fragments can take over a second on a busy machine, so it
would come late to the last fragment's group. At the end of the run, a unit stays until the groupmates of its last
round have that round's result too (:func:`wait_for_groupmates`). Called by
:class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from p2p_diloco.round.fragments import Fragments
from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.training.ledger import Held

logger = logging.getLogger(__name__)


def end_rounds(units: list[Held], fragments: Fragments, step: int, tokens_per_step: int,
               compute_s: float) -> list[RoundReport]:
    """End the round of each of ``units`` at inner step ``step`` (``compute_s``: how long the round's inner steps
    took); one report per unit, in order."""
    tokens = [fragments.round_tokens(unit.stage, step, tokens_per_step) for unit in units]
    expected = expected_group_sizes(units)
    if len(units) == 1:
        return [units[0].stage.end_round(tokens[0], expected[0], compute_s=compute_s)]
    with ThreadPoolExecutor(len(units), thread_name_prefix="round-end") as pool:
        return list(pool.map(lambda unit, n, size: unit.stage.end_round(n, size, compute_s=compute_s),
                             units, tokens, expected))


def expected_group_sizes(units: list[Held]) -> list[int | None]:
    """Each unit's expected group for the round that ends, read from its records (1 for a unit training alone)."""
    def expected(unit: Held) -> int | None:
        return unit.swarm.expected_group_size(unit.stage.round_index) if unit.swarm is not None else 1

    if len(units) == 1:
        return [expected(units[0])]
    with ThreadPoolExecutor(len(units), thread_name_prefix="records") as pool:
        return list(pool.map(expected, units))


def wait_for_groupmates(units: list[Held], last_group: dict[int, list], deadline: float) -> None:
    """Wait, until ``deadline`` (``averaging.next_chunk_timeout_s`` after the last round: the time after which a
    groupmate stops waiting for a part anyway), for each groupmate of unit i's last round (``last_group[i]``) to say
    in its record that it applied that round, or to be gone.

    A peer's own all-reduce ends when it has every part of the average it needs; the parts it reduced for its
    groupmates may still be on the wire, and a process that exits then cuts them off: the groupmate waits out its
    timeouts and falls back on a round everyone else averaged."""
    for i, unit in enumerate(units):
        group = last_group.get(i, [])
        if not group:
            continue
        waiting = unit.swarm.wait_for_groupmates(group, unit.stage.applied_round,
                                                 timeout_s=max(0.0, deadline - time.monotonic()))
        if waiting:
            logger.info(f"{unit.stage.label}: leaving before {len(waiting)} groupmate(s) of the last round said "
                        f"they had its result")
