"""The round of DiLoCo on one stage, as plain data and rules, free of the network (docs/design.md §2.4).

- :mod:`.stage`: ``Stage``, one stage's DiLoCo state and its round end; what its checkpoint holds
  (:mod:`.stage_state`) and the state it serves and adopts, checked (:mod:`.swarm_state`); the inner optimizer
  and its lr (:mod:`.inner`);
- :mod:`.outcome`: what averaging a round gave (``RoundOutcome``), what a round end did (``RoundReport``), a round
  still in flight (``PendingRound``);
- :mod:`.rules`: the round end of each overlap mode (``none``, ``delayed``, ``eager``);
- :mod:`.outer`: the outer optimizer (Nesterov momentum on the averaged pseudo-gradient);
- :mod:`.position`: where a stage stands in the run (what its progress record tells the swarm).

Nothing here imports hivemind: the averager (``swarm.averaging``) and the simulator (``training.simulate``) both
return a ``RoundOutcome`` behind :class:`.averager.RoundAverager`, and the stage owns the state the rules order.
"""

from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport
from p2p_diloco.round.outer import OuterOptimizer
from p2p_diloco.round.position import Position
from p2p_diloco.round.rules import RULES

__all__ = ["RULES", "OuterOptimizer", "PendingRound", "Position", "RoundOutcome", "RoundReport"]
