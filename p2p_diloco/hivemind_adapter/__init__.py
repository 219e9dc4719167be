"""Everything of hivemind this project uses, in one package: the rest of p2p_diloco imports hivemind only from here.

- :mod:`.averaging`: the averaging classes our averager subclasses, the accessors of their private attributes,
  and the swaps of matchmaking methods on instances;
- :mod:`.dht`: the DHT node and its records, validators and stores (public names), the bound stores' class swap and
  the wrap of the node's store handler;
- :mod:`.p2p`: the P2P layer, peer ids and multiaddrs, the process-wide cap on a received message, the reachability
  mode of a node behind NAT;
- :mod:`.crypto`: RSA identities and their protobufs;
- :mod:`.compression`: the codec base classes and serialization of tensors;
- :mod:`.logs`: hivemind's log handler, and the filter on one traceback of the DHT's loop;
- :mod:`.registry`: the lists the contract test (``tests/unit/test_hivemind_contract.py``) iterates: every patch
  (:data:`~.registry.PATCHES`), every hivemind method replaced or called and every private attribute read or
  written, and the hivemind classes subclassed elsewhere.

Public hivemind names (``DHT``, ``PeerID``, ``get_dht_time``, ...) are re-exported as they are; a private name,
a class swap or a method replaced is reached through one named function of this package. hivemind's internals change
between versions, so the version is checked on import (:func:`check_version`).
"""

from __future__ import annotations

import hivemind

SUPPORTED_VERSION = "1.1.12"


def check_version(version: str) -> None:
    """ImportError unless ``version`` is the hivemind version these internals are known for."""
    if version != SUPPORTED_VERSION:
        raise ImportError(f"p2p_diloco is built on hivemind {SUPPORTED_VERSION} internals (see "
                          f"p2p_diloco/hivemind_adapter/), but hivemind {version} is installed: "
                          f"pip install hivemind=={SUPPORTED_VERSION}")


check_version(hivemind.__version__)

__all__ = ["SUPPORTED_VERSION", "check_version"]
