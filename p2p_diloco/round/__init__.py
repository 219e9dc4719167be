"""The round of DiLoCo on one stage, as plain data and rules, free of the network (docs/design.md §2.4).

- :mod:`.stage`: ``Stage``, one stage's module, inner optimizer (:mod:`.inner`) and parts, its inner steps and round
  end;
- its parts: :mod:`.outer_state` (``OuterState``: anchor, outer momentum, phi0, error feedback, eager's copy),
  :mod:`.exchange` (``Exchange``: the averaging of its rounds and the round in flight) and :mod:`.position`
  (``Clock``: where it stands; ``Position``, what its progress record tells the swarm);
- functions of those parts: what its checkpoint holds (:mod:`.stage_state`) and the state it serves and adopts,
  checked (:mod:`.swarm_state`);
- :mod:`.rules`: the round end of each overlap mode (``none``, ``delayed``, ``eager``), given the outer state, the
  pseudo-gradient and the ``Exchange``;
- :mod:`.outcome`: what averaging a round gave (``RoundOutcome``), what a round end did (``RoundReport``), a round
  still in flight (``PendingRound``);
- :mod:`.outer`: the outer optimizer (Nesterov momentum on the averaged pseudo-gradient).

Nothing here imports hivemind: the averager (``swarm.averaging``) and the simulator (``training.simulate``) both
return a ``RoundOutcome`` behind :class:`.averager.RoundAverager`.
"""

from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport
from p2p_diloco.round.outer import OuterOptimizer
from p2p_diloco.round.position import Position
from p2p_diloco.round.rules import RULES

__all__ = ["RULES", "OuterOptimizer", "PendingRound", "Position", "RoundOutcome", "RoundReport"]
