"""Hostile peers in the round's metadata (the record each member gathers into its group):

- ``tokens:K`` (:class:`InflatedTokens`): claims K times its tokens as its weight (default 1000);
- ``stale:K`` (:class:`StaleReplay`): replays its contribution of K rounds ago and claims that round (default 1);
- ``metadata`` (:class:`MalformedProposal`): a malformed compression proposal;
- ``lowball`` (:class:`Lowball`): a well-formed record that asks for the least precision (rank 1, 4 bits, a link and a
  round of compute a million times too slow);
- ``fat-metadata:M`` (:class:`FatRecord`): its record carries M MiB of empty msgpack maps (default 4).

The first two replace the client's ``_contribution_to_send`` (what the training process claims); the last three the
server's ``_record`` (the record the averaging process completes from that claim).
"""

from __future__ import annotations

import torch

from tests.hostile.base import HostileAverager, HostileServer


class InflatedTokens(HostileAverager):
    def _contribution_to_send(self, contribution, round_index: int, weight: float):
        return contribution, round_index, weight * self.hostility.value


class StaleReplay(HostileAverager):
    def __init__(self, *args, **kwargs):
        self._sent: dict[int, list[torch.Tensor]] = {}  # the contributions of the last rounds
        super().__init__(*args, **kwargs)

    def _contribution_to_send(self, contribution, round_index: int, weight: float):
        lag = int(self.hostility.value)
        self._sent[round_index] = [t.detach().clone() for t in contribution]
        self._sent = {r: c for r, c in self._sent.items() if r >= round_index - lag}
        old = round_index - lag
        return (self._sent[old], old, weight) if old in self._sent else (contribution, round_index, weight)


class MalformedProposal(HostileServer):
    def _record(self, claim) -> dict:
        return dict(super()._record(claim), compression={"rank": "all of it"})


class Lowball(HostileServer):
    def _record(self, claim) -> dict:
        record = super()._record(claim)
        slow = {"bandwidth_mbit": record["bandwidth_mbit"] * 1e-6, "compute_s": max(record["compute_s"], 1.0) * 1e-6}
        return dict(record, compression={"rank": 1, "bits": 4, "q_round": -1}, last_error=0.0, **slow)


class FatRecord(HostileServer):
    def _record(self, claim) -> dict:
        return dict(super()._record(claim), padding=[{}] * int(self.hostility.value * 2**20))  # N empty maps: N bytes
