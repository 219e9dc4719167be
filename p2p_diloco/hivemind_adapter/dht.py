"""hivemind's DHT as this project uses it: the node, its records, validators and stores, and the three private ways
in that :mod:`~p2p_diloco.swarm.discovery.storage_budget` needs to bound what a node keeps for others.

- :func:`swap_store_class` turns a node's store (hivemind's ``DHTLocalStorage``: ``protocol.storage`` and
  ``protocol.cache``, made by the node at its start) into a subclass in place (``__class__``): the node holds the
  store objects, with no seam to hand it others;
- :func:`name_store_senders` wraps the node's handler of store requests in the daemon client's table of unary
  handlers (``P2P._client.control.unary_handlers``, entry :data:`STORE_HANDLER`): hivemind registers the node's
  ``rpc_store`` there, bound when the node starts, and the sender's peer id reaches it there only;
- :func:`validators_of` reads the validators a node's ``CompositeValidator`` holds (``_validators``).

The first two are listed in :data:`~p2p_diloco.hivemind_adapter.registry.PATCHES`, the third in its ``ATTRIBUTES``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

from hivemind.dht import DHT, DHTID, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import ValueWithExpiration, get_dht_time

STORE_HANDLER = "DHTProtocol.rpc_store"
"""The name hivemind's DHT node serves store requests under (``ServicerBase._get_handle_name``)."""


def validators_of(record_validator: RecordValidatorBase) -> list[RecordValidatorBase]:
    """The validators a node checks records with: those of hivemind's ``CompositeValidator`` (the node's
    ``protocol.record_validator``), or ``[record_validator]`` for a single one."""
    return list(getattr(record_validator, "_validators", [record_validator]))


def swap_store_class(store: DHTLocalStorage, cls: type) -> None:
    """Make ``store`` (a hivemind store holding entries already) an instance of ``cls``, a subclass of its class that
    adds no slots, in place."""
    if not issubclass(cls, type(store)):
        raise TypeError(f"{cls.__name__} is not a subclass of {type(store).__name__}")
    store.__class__ = cls


def name_store_senders(p2p, sender: ContextVar[Optional[bytes]]) -> None:
    """Wrap the node's handler of store requests so that ``sender`` holds the request's sender (its peer id's bytes,
    the libp2p connection's, from the p2p daemon) while the handler runs, and the stores it makes can be charged to
    it. The handler is hivemind's, taken from the daemon client's table of unary handlers, where hivemind put it when
    the node started, bound to the node's protocol; a node in client mode has none (it stores nothing for others).
    Idempotent."""
    handlers = p2p._client.control.unary_handlers
    handler = handlers.get(STORE_HANDLER)
    if handler is None or getattr(handler, "names_sender", False):
        return

    async def with_sender(request: bytes, remote_id) -> bytes:
        token = sender.set(remote_id.to_bytes())
        try:
            return await handler(request, remote_id)
        finally:
            sender.reset(token)

    with_sender.names_sender = True
    handlers[STORE_HANDLER] = with_sender


__all__ = [
    "DHT", "DHTID", "DHTLocalStorage", "DHTNode", "DHTProtocol", "DHTRecord", "BytesWithPublicKey",
    "CompositeValidator", "DictionaryDHTValue", "RSASignatureValidator", "RecordValidatorBase", "STORE_HANDLER",
    "SchemaValidator", "ValueWithExpiration", "get_dht_time", "name_store_senders", "swap_store_class",
    "validators_of",
]
