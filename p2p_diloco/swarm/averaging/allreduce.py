"""A hivemind all-reduce whose result is bit-identical on every groupmate and robust to hostile groupmates.

hivemind's ``AllReduceRunner`` sends each sender ``average - sender's part`` and the sender adds it to
its own part, so groupmates end up a few ulps apart. DiLoCo needs every peer that saw the same average
to hold the *same* anchor, so here each reducer sends the average itself (encoded with the reducer's own
codec) and uses the decoded copy of the same bytes locally; its own contribution to the parts it reduces is
what its codec would have sent, as everyone else's. Decoding goes through our codec registry (which also
knows hivemind's) and checks every part's shape. The byte counters (payload bytes of the
protobuf messages, both directions) feed the per-round metrics.

Against broken or hostile groupmates: the reducer keeps every sender's part and combines them with
:func:`p2p_diloco.swarm.averaging.robust.combine` (non-finite and far too large parts left out, CenteredClip),
weighting each sender by the group's capped record of its tokens rather than the weight written in its messages
(:class:`RobustPartReducer`); a part that cannot be decoded or has the wrong shape is refused; an average returned
by a reducer is refused when it is non-finite or larger than an honest reducer's can be (``plausible_bound``, from
:func:`~p2p_diloco.swarm.averaging.robust.average_bound`: the reducer lands in ``runner.implausible`` and is left out
of the round's retry), and is an offence (left out too) when non-finite, far larger still (``average_bound``), or, in
a pair, no average of this peer's part with any part of the other member
(:func:`~p2p_diloco.swarm.averaging.robust.pair_excess`, judged from this peer's part as the reducer decoded it, the
two weights, and the rounding of the average's codec); a reducer that took this
peer's parts and returned no average within the reducer timeout (2 x ``averaging.next_chunk_timeout_s``: an honest
reducer answers once every sender's part is in, or a sender timeout after) stalled the group. Explicit refusals and
broken connections are not stalls: a reducer that read the group differently, or left it, refuses at once. Every
such finding lands in ``runner.flags`` as (peer id, reason). A reducer that is gone, or whose handler failed,
before returning any average of this peer's parts lands in ``runner.silent``: the averager leaves it out of the
round's retry (a staller that joined every retry of a round failed them all). A reducer that refuses the parts as
sent under another view of the group lands in ``runner.refused_by``: the averager leaves out the group's leader. One
that says it is in no group at all (it gave up on the leader, who had counted it in) lands in ``runner.absent``: the
group re-forms with it, and leaves it out after its second time in a round (``PeerGuard.absent``). Such a reducer, and
one whose handler failed, sends this peer no parts either: unless it has begun to, it is refused as a sender at once
(hivemind would wait for its parts until the sender timeout, ``next_chunk_timeout_s``).

A reducer's stream of averages can break half-way through while the reducer and the others finish the all-reduce
(on a busy machine the stream to one member can end a few parts short, as if closed, and only that member falls
back). So each reducer keeps the averages of its slice for a while (:class:`ServedAverages`, the exact bytes every
groupmate got), and a member whose stream ended short or broke asks the reducer for them again
(``rpc_fetch_averages``, served by the averager) and takes the parts it is missing, with the same checks.

Each member keeps a digest of the slice it got from every reducer (:meth:`ExactAllReduceRunner.slice_digests`; of its
own slice, what it served): the averager compares them across the group (:mod:`~p2p_diloco.swarm.averaging.digests`).

The reducer's half of a slice (:class:`~p2p_diloco.swarm.averaging.slices.RobustPartReducer`) and the averages kept to
serve again (:class:`~p2p_diloco.swarm.averaging.slices.ServedAverages`) are :mod:`~p2p_diloco.swarm.averaging.slices`.
Built on hivemind internals (``AllReduceRunner``, ``TensorPartContainer``), through
:mod:`p2p_diloco.hivemind_adapter.averaging`.
Called only by :class:`p2p_diloco.swarm.averaging.server.AveragingServer`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import typing
from collections.abc import AsyncIterator

import torch

from p2p_diloco.compression.codecs import average_rounding, decode_tensor
from p2p_diloco.hivemind_adapter.averaging import (
    AllreduceException,
    AllReduceRunner,
    BannedException,
    P2PContext,
    P2PDaemonError,
    P2PHandlerError,
    PeerID,
    aiter_with_timeout,
    amap_in_executor,
    attach_event_on_finished,
    averaging_pb2,
    ban_sender,
    get_logger,
    input_parts,
    outputs_registered,
)
from p2p_diloco.swarm.averaging.digests import slice_digest
from p2p_diloco.swarm.averaging.guard import BAD_AVERAGE, IMPLAUSIBLE, MALFORMED, NOT_IN_GROUP, STALL
from p2p_diloco.swarm.averaging.robust import RobustRule, pair_excess
from p2p_diloco.swarm.averaging.slices import RobustPartReducer, ServedAverages

logger = get_logger(__name__)

# indices into the shared int64 traffic counter tensor
BYTES_SENT, BYTES_RECEIVED = 0, 1
# how a reducer that is gone, or that failed its handler (a staller leaving the group), ends a sender's stream; an
# explicit refusal or failure is a message code instead (a reducer that read the group differently, or whose own
# all-reduce failed)
GONE = (ConnectionError, P2PDaemonError, P2PHandlerError, asyncio.IncompleteReadError, asyncio.TimeoutError)
# the codecs' rounding of the average and of this peer's own part, on top of robust.average_bound (blockwise int4
# moves a part's norm by a few percent; fp32 and fp16 by far less)
CODEC_MARGIN = 1.25
# in a pair: the float rounding of the reducer's weighted mean and of the receiver's norms (robust.pair_excess; the
# codec's rounding of the average is measured)
PAIR_SLACK = 1.001


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce that returns the group average itself (not a difference), identical on all peers.

    Args:
        traffic: a shared int64 tensor of two counters (bytes sent, bytes received), updated in place.
        weights: peer id -> the weight of its parts in this peer's reductions (absent: 0).
        rule: how this peer's reducer combines the parts.
        claims: peer id -> the tokens it claims (the outlier test's scale, see ``robust.combine``; default: weights).
        plausible_bound: an average returned by a reducer whose norm is more than this many times this peer's own
            part (with :data:`CODEC_MARGIN`) is refused, and the reducer left out of the round's retry (0: no bound;
            see :func:`~p2p_diloco.swarm.averaging.robust.average_bound`).
        average_bound: an average more than this many times this peer's own part is refused and the reducer's
            offence (0: no bound).
        kwargs: everything ``AllReduceRunner`` takes.

    Seams for tests (``tests/hostile`` subclasses them): :meth:`_reply`, the average this peer returns to a sender as
    a reducer, and hivemind's ``_generate_input_for_peer``, the parts it sends.
    """

    def __init__(self, *, traffic: torch.Tensor, weights: dict, rule: RobustRule, average_bound: float = 0.0,
                 plausible_bound: float = 0.0, claims: dict | None = None,
                 result_compression=None, **kwargs):
        super().__init__(**kwargs)
        # the codec of each tensor's averages (SparseLoCo's top-k parts come back as sparse averages)
        self._result_compression = result_compression or self.tensor_part_container.compression
        self._traffic, self._average_bound, self._rule = traffic, average_bound, rule
        self._plausible_bound = plausible_bound * CODEC_MARGIN
        # in a pair (two senders, this peer and another, both of non-zero weight) each average implies the other's
        # part. Only then: a third sender that this peer banned (weight 0 here) may still count at an honest reducer
        senders = list(self.sender_peer_ids)
        other = next((p for p in senders if p != self.peer_id), None)
        self._pair = (weights[self.peer_id], weights[other]) if len(senders) == 2 and self.peer_id in senders and \
            weights.get(self.peer_id, 0.0) > 0 and weights.get(other, 0.0) > 0 else None  # (own, other) weight
        self.implausible: list[PeerID] = []  # reducers whose average an honest reducer cannot have returned
        self.flags: list[tuple[PeerID, str]] = []
        self.silent: list[PeerID] = []  # reducers that took this peer's parts and returned no average
        self.refused_by: list[PeerID] = []  # reducers that refused this peer's parts as of another view of the group
        self.absent: list[PeerID] = []  # reducers that are in no group: they gave up on its leader (guard.absent)
        self._part_digests: dict[PeerID, dict[int, bytes]] = {}  # reducer -> part index -> sha256 of its bytes
        container = self.tensor_part_container
        container.return_deltas = False  # a failed reducer's parts fall back to our own values, not zeros
        my_index = self.ordered_peer_ids.index(self.peer_id)
        self._my_part_infos = [info for _part, info in input_parts(container, my_index)]
        self.tensor_part_reducer.finished.set()  # hivemind's plain reducer is replaced before it ever ran
        self.tensor_part_reducer = RobustPartReducer(
            self.tensor_part_reducer.part_shapes, [weights.get(peer_id, 0.0) for peer_id in self.sender_peer_ids],
            rule, on_flag=lambda sender, reason: self.flags.append((self.sender_peer_ids[sender], reason)),
            claims=None if claims is None else [claims.get(peer_id, 0.0) for peer_id in self.sender_peer_ids])
        self.served = ServedAverages(self.sender_peer_ids, self.tensor_part_reducer.num_parts)

    def _encode_result(self, averaged_part: torch.Tensor, part_index: int):
        """The reducer encodes each averaged part once; every groupmate decodes the same bytes."""
        return self._result_compression.compress(averaged_part, self._my_part_infos[part_index], allow_inplace=False)

    async def _communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            return await self._reduce_own_parts(peer_index)
        stream = None
        expected = len(input_parts(self.tensor_part_container, peer_index))
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            received, broken = 0, None
            try:
                received = await self._take_averages(peer_id, peer_index, stream, start=0)
            except (ConnectionError, P2PDaemonError, asyncio.IncompleteReadError) as e:  # the stream broke
                received, broken = outputs_registered(self.tensor_part_container, peer_index), e
            if received < expected:
                logger.info(f"The stream of reducer {peer_id}'s averages {f'broke ({broken!r})' if broken else 'ended'}"
                            f" after {received} of {expected} parts: asking it for them again")
                again = await asyncio.wait_for(  # a reducer that is gone may take a dial timeout to say so
                    super()._get_peer_stub(peer_id).rpc_fetch_averages(
                        averaging_pb2.AveragingData(group_id=self.group_id)), timeout=self.sender_timeout)
                received = await self._take_averages(peer_id, peer_index, _count_received(again, self._traffic),
                                                     start=received)
            if received != expected:
                raise AllreduceException(f"{peer_id} sent {received} parts, {expected} expected")
        except BaseException as e:
            if stream is not None and isinstance(e, asyncio.TimeoutError):  # the stream is open, and silent
                self.flags.append((peer_id, STALL))
            # gone or silent with this peer's parts (not an explicit refusal: a message code)
            if isinstance(e, GONE) and expected and not outputs_registered(self.tensor_part_container, peer_index):
                self.silent.append(peer_id)
            if isinstance(e, Exception):  # the round then fails here and is retried (the averager logs it too)
                logger.warning(f"The averages of reducer {peer_id} did not all arrive: {e!r}")
                logger.debug("The reducer's failure", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            out = peer_id in self.absent or isinstance(e, P2PHandlerError)  # in no group, or its handler failed
            if out and peer_id in self.sender_peer_ids and peer_id not in self.active_senders:
                # it has no all-reduce of this group (it is in no group, or it left this one and its handler said
                # so), so its parts of this peer's slice will not come: refused as a sender now, and the all-reduce
                # ends, and the round's retry begins, at once rather than after hivemind's sender timeout
                # (next_chunk_timeout_s: over an emulated 10 Mbit/s link, 60 s, which a groupmate whose p2p daemon
                # client failed cost the other)
                await ban_sender(self, peer_id)
                if set(self.sender_peer_ids) <= self.active_senders | self.banned_senders:
                    self.all_senders_started.set()  # hivemind's watch for senders that never start waits for it
            raise

    async def _take_averages(self, peer_id: PeerID, peer_index: int, messages: AsyncIterator, start: int) -> int:
        """Check and register the averages ``peer_id`` sends for its slice, from part ``start`` on (the messages
        before it are skipped unread); returns how many parts of the slice are registered after."""
        parts = input_parts(self.tensor_part_container, peer_index)
        expected_shapes = [part.shape for part, _info in parts]
        largest = max((part.numel() for part, _info in parts), default=0)

        def decode(message):
            if message.code == averaging_pb2.BAD_GROUP_ID:  # it read the group differently, or has left it
                self.refused_by.append(peer_id)
            if message.code == NOT_IN_GROUP:  # it gave up on the group's leader, which counted it in
                self.absent.append(peer_id)
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            averaged = _decode_part(message, largest)
            rounding = average_rounding(message.tensor_part, averaged) if self._pair is not None and \
                not isinstance(averaged, Exception) else 0.0
            return averaged, _part_digest(message.tensor_part), rounding

        part_index, digests = start, self._part_digests.setdefault(peer_id, {})
        async for averaged_part, digest, rounding in amap_in_executor(
                decode, aiter_with_timeout(_skip(messages, start), self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch):
            if isinstance(averaged_part, Exception) or part_index >= len(expected_shapes) or \
                    averaged_part.shape != expected_shapes[part_index]:
                self.flags.append((peer_id, MALFORMED))
                raise AllreduceException(f"{peer_id} sent a malformed average: {averaged_part!r:.200}")
            sent = None
            if self._pair is not None:  # what the reducer combined of this peer's part: its codec's roundtrip
                sent = await asyncio.get_event_loop().run_in_executor(None, self._sent_part, *parts[part_index])
            problem, offence = self._implausible(averaged_part, parts[part_index][0], sent, rounding)
            if problem:
                self.flags.append((peer_id, BAD_AVERAGE if offence else IMPLAUSIBLE))
                self.implausible.append(peer_id)
                raise AllreduceException(f"{peer_id} returned {problem}")
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
            digests[part_index] = digest
            part_index += 1
        return part_index

    def slice_digests(self) -> dict[str, str]:
        """Reducer (base58) -> digest of every averaged part of its slice this peer holds (its own slice: as served),
        for the reducers whose slice this peer got whole (see :mod:`~p2p_diloco.swarm.averaging.digests`)."""
        found = {}
        for peer_index, peer_id in enumerate(self.ordered_peer_ids):
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]  # (the parts are cleared at the end)
            if peer_id == self.peer_id:
                parts = [_part_digest(part) for part in self.served.parts if part is not None]
            else:
                held = self._part_digests.get(peer_id, {})
                parts = [held[i] for i in range(expected) if i in held]
            if expected and len(parts) == expected:
                found[peer_id.to_base58()] = slice_digest(parts)
        return found

    async def _reduce_own_parts(self, peer_index: int) -> None:
        """Reduce the parts this peer is responsible for; its own contribution is what the codec would send. Each
        average is kept as the bytes sent (:attr:`served`) and used here decoded from them."""
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()

        def encode_and_decode(average: torch.Tensor, part_index: int):
            serialized = self._encode_result(average, part_index)
            return serialized, decode_tensor(serialized)

        try:
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                sent = await loop.run_in_executor(None, lambda i=part_index, p=tensor_part: self._roundtrip(p, i))
                averaged_part = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, sent,
                                                                               weight=self.weight)
                serialized, local_copy = await loop.run_in_executor(None, encode_and_decode, averaged_part,
                                                                    part_index)
                await self.served.add(part_index, serialized)
                self.tensor_part_container.register_processed_part(peer_index, part_index, local_copy)
        finally:
            await self.served.finish()

    def _implausible(self, average: torch.Tensor, own_part: torch.Tensor, sent: torch.Tensor | None = None,
                     rounding: float = 0.0) -> tuple[str, bool]:
        """(why an average returned by a reducer cannot be the robust combination of the group's parts, or "";
        whether that is an offence). ``sent``: in a pair, this peer's part as the reducer decoded it (None where it
        is not finite: the reducer left it out); ``rounding``: the most the reducer's codec moved the average."""
        if not torch.isfinite(average).all():
            return "a non-finite average", True
        if sent is not None:  # exact in a pair: no part of the other member gives such an average
            excess = pair_excess(average, sent, *self._pair, self._rule, rounding)
            if excess > PAIR_SLACK:
                return f"an average that implies the other member's part at {excess:.3g} times the most the robust " \
                       "combination leaves it", True
        own_norm = float(torch.linalg.vector_norm(own_part.float()))
        if own_norm <= 0:
            return "", False
        ratio = float(torch.linalg.vector_norm(average)) / own_norm
        if self._average_bound > 0 and ratio > self._average_bound:
            return f"an average {ratio:.3g} times the norm of this peer's part (at most {self._average_bound:g})", True
        if self._plausible_bound > 0 and ratio > self._plausible_bound:
            return f"an average {ratio:.3g} times the norm of this peer's part (an honest reducer's is at most " \
                   f"{self._plausible_bound:.3g})", False
        return "", False

    def _sent_part(self, part: torch.Tensor, info) -> torch.Tensor | None:
        """``part`` of this peer's contribution as its reducer decodes it; None where it is not finite (the codec
        refuses it, or the reducer leaves it out)."""
        try:
            sent = decode_tensor(self.tensor_part_container.compression.compress(part, info))
        except ValueError:
            return None
        return sent if bool(torch.isfinite(sent).all()) else None

    def _roundtrip(self, part: torch.Tensor, part_index: int) -> torch.Tensor:
        try:
            return decode_tensor(self.tensor_part_container.compression.compress(part, self._my_part_infos[part_index]))
        except ValueError:  # a non-finite part that the codec cannot carry: the reducer leaves it out
            return part

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._traffic[BYTES_SENT] += message.ByteSize()
            yield message

    def _reply(self, averaged_part: torch.Tensor, sender_index: int) -> torch.Tensor:
        """The average this peer, as a reducer, returns to sender ``sender_index``: the group's, as it is (a seam)."""
        return averaged_part

    def _get_peer_stub(self, peer: PeerID):
        return _CountingStub(super()._get_peer_stub(peer), self._traffic)

    async def rpc_aggregate_part(  # typing's AsyncIterator: hivemind registers handlers from these annotations
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """Refuse peers that are not senders of this all-reduce (excluded groupmates, strangers) up front."""
        if context.remote_id not in self.sender_peer_ids:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        """As in hivemind, but the reply is the encoded average rather than ``average - sender's part``, and a part
        that cannot be decoded or has the wrong shape flags its sender and is left out of the average."""
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            largest = max((math.prod(shape) for shape in self.tensor_part_reducer.part_shapes), default=0)
            async for tensor_part in amap_in_executor(
                functools.partial(_decode_part, max_values=largest), _count_received(stream, self._traffic),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index >= self.tensor_part_reducer.num_parts:
                    self.flags.append((self.sender_peer_ids[sender_index], MALFORMED))
                    raise AllreduceException(f"sender {sender_index} sent more parts than this peer reduces")
                if isinstance(tensor_part, Exception) or \
                        tensor_part.shape != self.tensor_part_reducer.part_shapes[part_index]:
                    logger.debug(f"Sender {sender_index} sent a malformed part: {tensor_part!r:.200}")
                    self.flags.append((self.sender_peer_ids[sender_index], MALFORMED))
                    tensor_part = None  # left out of this part; the exchange goes on, so a peer that sent an
                    # undecodable part (e.g. NaN scales) still serves its own slice to the group
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(sender_index, part_index,
                                                                                   tensor_part)
                except BannedException:
                    break  # the sender was banned in the meantime: it gets nothing more
                averaged_part = self._reply(averaged_part, sender_index)
                serialized = await loop.run_in_executor(
                    None, lambda i=part_index, avg=averaged_part: self._encode_result(avg, i)
                )
                part_index += 1
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self._traffic[BYTES_SENT] += reply.ByteSize()
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                logger.warning(f"Sender {self.sender_peer_ids[sender_index]} got {part_index} of "
                               f"{self.tensor_part_reducer.num_parts} averaged parts from this reducer")
                await ban_sender(self, self.sender_peer_ids[sender_index])


def _part_digest(serialized) -> bytes:
    """sha256 of an averaged part as sent (a hivemind ``runtime_pb2.Tensor``; deterministic serialization)."""
    return hashlib.sha256(serialized.SerializeToString(deterministic=True)).digest()


def _decode_part(message: averaging_pb2.AveragingData, max_values: int):
    """The tensor of a message, or the exception that decoding it raised (a malformed part flags its sender); a part
    declaring more values than the largest this exchange expects (``max_values``) is refused before decoding."""
    try:
        return decode_tensor(message.tensor_part, max_values=max_values)
    except Exception as e:
        return e


class _CountingStub:
    """Wraps a groupmate's stub so that the averaged parts it returns are counted as received bytes."""

    def __init__(self, stub, traffic: torch.Tensor):
        self._wrapped, self._traffic = stub, traffic

    async def rpc_aggregate_part(self, inputs):
        return _count_received(await self._wrapped.rpc_aggregate_part(inputs), self._traffic)


async def _skip(messages: AsyncIterator, count: int) -> AsyncIterator:
    """``messages`` after the first ``count``."""
    async for message in messages:
        if count > 0:
            count -= 1
            continue
        yield message


async def _count_received(stream: AsyncIterator, traffic: torch.Tensor) -> AsyncIterator:
    async for message in stream:
        traffic[BYTES_RECEIVED] += message.ByteSize()
        yield message
