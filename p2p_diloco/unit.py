"""What one stage process averages: a :class:`Unit`, the project's central noun, as one value.

A peer's model is cut two ways (docs/design.md 2.3 and 2.11): into P pipeline stages, one process each, and, in a
run averaged by fragment (``diloco.fragments`` F >= 1), into F fragments that peers of any split average together.
A unit is either a whole stage (F = 0) or one fragment held by a stage process. Every name the project gives a unit
comes from here: the log label, the checkpoint folder, the metadata of its states and checkpoints, the DHT prefix
its averagers share and the run id of its progress records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Unit:
    """One unit: pipeline stage ``stage`` of ``num_stages``, or fragment ``fragment`` of ``num_fragments`` held by
    that stage process."""

    stage: int = 0
    num_stages: int = 1
    fragment: Optional[int] = None
    num_fragments: int = 0

    def __post_init__(self):
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"a unit's stage must lie in [0, {self.num_stages}), got {self.stage}")
        if (self.fragment is None) != (self.num_fragments == 0):
            raise ValueError("a fragment unit names both its fragment and the number of fragments, a stage unit "
                             f"neither (got fragment {self.fragment}, num_fragments {self.num_fragments})")
        if self.fragment is not None and not 0 <= self.fragment < self.num_fragments:
            raise ValueError(f"a unit's fragment must lie in [0, {self.num_fragments}), got {self.fragment}")

    @classmethod
    def of(cls, stage: int, num_stages: int, fragment: Optional[tuple[int, int]] = None) -> Unit:
        """From a stage and the ``(f, F)`` pair the configuration and the model's split give (None: the stage)."""
        if fragment is None:
            return cls(stage, num_stages)
        return cls(stage, num_stages, fragment[0], fragment[1])

    @property
    def is_fragment(self) -> bool:
        return self.fragment is not None

    @property
    def fragment_pair(self) -> Optional[tuple[int, int]]:
        """``(f, F)``, or None for a whole stage."""
        return None if self.fragment is None else (self.fragment, self.num_fragments)

    @property
    def label(self) -> str:
        """For logs: ``Stage 1``, or ``Stage 1 fragment 2``."""
        return f"Stage {self.stage}" + (f" fragment {self.fragment}" if self.is_fragment else "")

    @property
    def folder(self) -> str:
        """Its checkpoint folder: ``stage<j>of<P>``, or ``fragment<f>of<F>`` (one per fragment, whatever the split,
        so that a peer that changes its split still finds its fragments' checkpoints)."""
        if self.is_fragment:
            return f"fragment{self.fragment}of{self.num_fragments}"
        return f"stage{self.stage}of{self.num_stages}"

    @property
    def meta(self) -> dict:
        """How its states and checkpoints name it: a fragment of F, or a stage of P (a fragment's state is served to
        and taken from peers of any split, so its stage is not part of its name)."""
        if self.is_fragment:
            return {"fragment": self.fragment, "num_fragments": self.num_fragments}
        return {"stage": self.stage, "num_stages": self.num_stages}

    @property
    def names(self) -> dict:
        """:attr:`meta` with the stage that holds it, as a checkpoint's or a served state's header records it."""
        return {"stage": self.stage, "num_stages": self.num_stages, **self.meta}

    def matches(self, meta: dict) -> bool:
        """Whether a state's or checkpoint's metadata names this unit."""
        return all(meta.get(key) == value for key, value in self.meta.items())

    def describe(self, meta: dict) -> str:
        """The unit a state's metadata names, in this unit's terms, for an error message."""
        if self.is_fragment:
            return f"fragment {meta.get('fragment')} of {meta.get('num_fragments')}"
        return f"stage {meta.get('stage')} of {meta.get('num_stages')}"

    def group_prefix(self, run_id: str) -> str:
        """The DHT prefix its averagers share on every peer: ``<run_id>_s<j>of<P>``, or ``<run_id>_f<f>of<F>``."""
        if self.is_fragment:
            return f"{run_id}_f{self.fragment}of{self.num_fragments}"
        return f"{run_id}_s{self.stage}of{self.num_stages}"

    def records_run(self, run_id: str) -> str:
        """The run id of the progress records it reads and writes: the run's, or a fragment's own (read by every
        peer that holds the fragment, whatever its split)."""
        return self.group_prefix(run_id) if self.is_fragment else run_id


def run_units(num_stages: int = 1, num_fragments: int = 0) -> list[Unit]:
    """Every unit of a run, one per group prefix: its F fragments (F >= 1), or its P stages. A fragment's stage is
    not part of its names, so it is given as stage 0 of 1 here."""
    if num_fragments:
        return [Unit(0, 1, f, num_fragments) for f in range(num_fragments)]
    return [Unit(j, num_stages) for j in range(num_stages)]
