"""What every hostile peer's parts share: the parsed :class:`Hostility` (its kind, its value, and what its parts tell
each other), and the base classes that carry it into the honest averager's seams.

A hostile peer is the honest one with some parts replaced by subclasses (one per kind, in :mod:`.wire`,
:mod:`.metadata`, :mod:`.leader` and :mod:`.state`): :class:`HostileAverager` (the training process's client) starts a
:class:`HostileServer` through its ``server_type`` seam, the server runs its kind's all-reduce runner through its
``runner_type`` seam, and a stage process builds them (and a :class:`HostileLink` for kinds that lie in their
records) through ``stage_process.SWARM_CLASSES`` (see :mod:`.peer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from p2p_diloco.swarm.averaging.allreduce import ExactAllReduceRunner
from p2p_diloco.swarm.averaging.averager import PseudoGradientAverager
from p2p_diloco.swarm.averaging.server import AveragingServer
from p2p_diloco.swarm.discovery.link import SwarmLink

logger = logging.getLogger(__name__)


@dataclass
class Kind:
    """One kind of hostility: its default value (None: it takes none) and the parts it replaces (None: honest)."""

    default: Optional[float]
    averager: Optional[type] = None
    server: Optional[type] = None
    runner: Optional[type] = None
    link: Optional[type] = None


@dataclass
class Hostility:
    """A hostile peer's kind and value (``<kind>[:<value>]``, parsed by :func:`tests.hostile.parse_hostility`), and
    the facts its parts in the training process share: its anchor's shapes (told by its server), H and the run's end
    (told by its link)."""

    kind: str
    value: Optional[float]
    parts: Kind
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    inner_steps: int = 1
    num_rounds: int = 1

    def __repr__(self) -> str:
        return f"Hostility({self.kind}{'' if self.value is None else f':{self.value:g}'})"

    def averager(self, *args, **kwargs) -> PseudoGradientAverager:
        """A :class:`PseudoGradientAverager` of this kind (called as the honest one is)."""
        return (self.parts.averager or HostileAverager)(*args, hostility=self, **kwargs)

    def link(self, *args, **kwargs) -> SwarmLink:
        """A :class:`SwarmLink` of this kind (called as the honest one is): honest unless the kind lies in records."""
        return SwarmLink(*args, **kwargs) if self.parts.link is None else \
            self.parts.link(*args, hostility=self, **kwargs)


class HostileAverager(PseudoGradientAverager):
    """The client of a hostile peer: it starts its kind's server (honest in what it claims unless a subclass)."""

    def __init__(self, *args, hostility: Hostility, **kwargs):
        self.hostility = hostility
        super().__init__(*args, server_type=partial(hostility.parts.server or HostileServer, hostility=hostility),
                         **kwargs)


class HostileServer(AveragingServer):
    """The background averager of a hostile peer: it runs its kind's all-reduce runner (honest unless a subclass).
    Every subclass is named as the honest server: hivemind names a servicer's handlers after its class, and honest
    peers call ``AveragingServer``'s."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__name__ = AveragingServer.__name__

    def __init__(self, templates, *args, hostility: Hostility, **kwargs):
        self.hostility = hostility  # before the fork at the end of AveragingServer.__init__
        hostility.shapes = [tuple(t.shape) for t in templates]
        if hostility.parts.runner is not None:
            self.runner_type: Callable[..., ExactAllReduceRunner] = partial(hostility.parts.runner,
                                                                            hostility=hostility)
        logger.warning(f"This peer is hostile to its groupmates ({hostility}): a test hook")
        super().__init__(templates, *args, **kwargs)


HostileServer.__name__ = AveragingServer.__name__


class HostileRunner(ExactAllReduceRunner):
    """An all-reduce of a hostile peer (honest unless a subclass)."""

    def __init__(self, *, hostility: Hostility, **kwargs):
        self.hostility = hostility
        super().__init__(**kwargs)


class HostileLink(SwarmLink):
    """The records of a hostile peer (honest unless a subclass); tells the :class:`Hostility` H and the run's end."""

    def __init__(self, *args, hostility: Hostility, **kwargs):
        self.hostility = hostility
        super().__init__(*args, **kwargs)
        hostility.inner_steps, hostility.num_rounds = self.inner_steps, self.num_rounds or 1
