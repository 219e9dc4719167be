"""The ledger that bounds what a DHT node keeps for others (``swarm/discovery/storage_budget.py``), on hivemind's
own storage class with a clock of the test's: each class of key is held to its share, a refusal costs the other
classes nothing, expired and replaced entries free their bytes, each sender holds at most its part of a class and a
full class makes room for a sender under its fair part, an averager's declaration is taken only from the peer it
names, and nothing a writer sends makes it raise."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.swarm.discovery import storage_budget
from p2p_diloco.swarm.discovery.averager_keys import AveragerKeys, averager_prefixes
from p2p_diloco.swarm.discovery.records import swarm_validators
from p2p_diloco.swarm.discovery.storage_budget import (
    ENTRY_OVERHEAD,
    SENDER_SHARE,
    SHARES,
    BoundedStorage,
    Ledger,
    entry_cost,
    key_classifier,
)

RECORD, AVERAGER, OTHER = (DHTID.generate(source=s) for s in ("run_progress", "run_s0of1.all_averagers", "junk"))
KINDS = {RECORD.to_bytes(): "records", AVERAGER.to_bytes(): "averagers"}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bounded(limit: float, clock=None) -> BoundedStorage:
    store = DHTLocalStorage()
    storage_budget._bound(store, limit, lambda key: KINDS.get(key, "other"), clock or get_dht_time)
    assert isinstance(store, BoundedStorage)
    return store


def test_each_class_is_held_to_its_share_and_a_flood_of_one_costs_the_others_nothing():
    limit = 100 * (1000 + ENTRY_OVERHEAD)
    store, expires = bounded(limit), get_dht_time() + 60
    value = b"x" * 1000
    taken = [store.store(DHTID.generate(source=f"junk{i}"), value, expires) for i in range(100)]
    assert taken == [True] * int(SHARES["other"] * 100) + [False] * int((1 - SHARES["other"]) * 100)
    assert store.ledger.held["other"] <= store.ledger.share("other")
    assert store.ledger.refused["other"] == 75
    # subkeys of one key count one by one: a dictionary cannot hide entries
    owners = [f"owner{i}".encode() for i in range(100)]
    taken = [store.store_subkey(RECORD, owner, value, expires) for owner in owners]
    assert sum(taken) == int(SHARES["records"] * limit // entry_cost(value, owners[0]))
    assert store.ledger.held["records"] <= store.ledger.share("records")
    assert store.store_subkey(AVERAGER, b"\x12\x02ab", b"\xc3", expires)  # the third class still has room
    assert store.ledger.refused["averagers"] == 0
    # what the store holds is what the ledger charged
    held = sum(entry_cost(item.value) if not isinstance(item.value, DictionaryDHTValue) else
               sum(entry_cost(sub.value, subkey) for subkey, sub in item.value.items()) for _, item in store.items())
    assert held == sum(store.ledger.held.values())


def test_expired_entries_free_their_bytes_and_a_replaced_one_is_charged_once():
    clock = Clock()
    store = DHTLocalStorage()
    storage_budget._bound(store, 4 * (100 + ENTRY_OVERHEAD), lambda key: "other", clock)  # the share: 1 entry
    store.ledger.clock = clock
    first, second = DHTID.generate(source="a"), DHTID.generate(source="b")
    # hivemind's storage reads get_dht_time(): keep the test's times in its future
    base = get_dht_time() + 100
    clock.now = base
    assert store.store(first, b"x" * 100, base + 10)
    assert not store.store(second, b"y" * 100, base + 10)  # over the share
    assert store.store(first, b"z" * 100, base + 20)  # a newer value under the same key replaces the old one
    assert store.ledger.held["other"] == 100 + ENTRY_OVERHEAD
    clock.now = base + 21  # both the entry and its replaced version have expired
    assert store.ledger.admits("other", second, None, 100 + ENTRY_OVERHEAD)
    assert store.ledger.totals()["entries"] == 0 and store.ledger.held["other"] == 0


def test_what_a_node_already_holds_is_charged_when_it_is_bounded():
    store, expires = DHTLocalStorage(), get_dht_time() + 60
    store.store(OTHER, b"x" * 500, expires)
    store.store_subkey(RECORD, b"owner", b"y" * 300, expires)
    storage_budget._bound(store, 10**6, lambda key: KINDS.get(key, "other"), get_dht_time)
    assert store.ledger.held == {"records": 300 + 5 + ENTRY_OVERHEAD, "averagers": 0, "other": 500 + ENTRY_OVERHEAD}


def test_a_cached_dictionary_costs_all_of_its_entries():
    expires = get_dht_time() + 60
    found = DictionaryDHTValue()
    for i in range(10):
        found.store(f"s{i}".encode(), b"v" * 100, expires)
    assert entry_cost(found) == 10 * (100 + 2 + ENTRY_OVERHEAD) + ENTRY_OVERHEAD
    store = bounded(4 * entry_cost(found) - 1)  # the share of 'other' is just under the dictionary's cost
    assert not store.store(OTHER, found, expires)
    assert bounded(4 * entry_cost(found)).store(OTHER, found, expires)


@pytest.mark.parametrize("subkey", [[1, 2], {"a": 1}, bytearray(b"x"), None])
def test_a_subkey_no_dictionary_can_hold_is_refused_not_raised(subkey):
    store = bounded(10**6)
    assert store.store_subkey(OTHER, subkey, b"v", get_dht_time() + 60) is False
    assert store.ledger.held["other"] == 0 and store.ledger.refused["other"] == 1


def test_the_classes_come_from_the_nodes_own_validators():
    from hivemind.dht.validation import CompositeValidator

    validators = CompositeValidator(swarm_validators("run", num_stages=2) + swarm_validators("frag", fragments=2))
    classify = key_classifier(validators)
    for key in ("run_progress", "run_config", "frag_f1of2_progress", "frag_f0of2_config"):
        assert classify(DHTID.generate(source=key).to_bytes()) == "records", key
    group_key = f"{averager_prefixes('run', 2)[1]}.0b{5:016b}"
    for key in (group_key, "run_s0of2.all_averagers", "frag_f1of2.all_averagers"):
        assert classify(DHTID.generate(source=key).to_bytes()) == "averagers", key
    for key in ("other_progress", "run_s0of1.all_averagers", "run_s2of2.0b0000000000000101", "run"):
        assert classify(DHTID.generate(source=key).to_bytes()) == "other", key
    assert classify(b"short") == "other"
    assert any(isinstance(v, AveragerKeys) for v in validators._validators)


def test_a_key_the_classifier_cannot_read_is_charged_as_other():
    def broken(key):
        raise ValueError("unreadable")

    store = DHTLocalStorage()
    storage_budget._bound(store, 10_000.0, broken, get_dht_time)
    assert store.ledger.kind(OTHER) == "other"
    assert store.store(OTHER, b"x" * 100, get_dht_time() + 60)
    assert store.ledger.held["other"] == 100 + ENTRY_OVERHEAD


SUBKEYS = st.one_of(st.none(), st.binary(max_size=2), st.text(max_size=1), st.integers(-2, 2), st.floats(),
                    st.lists(st.integers(), max_size=3), st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([RECORD, AVERAGER, OTHER, DHTID.generate(source="x")]), SUBKEYS,
                          st.binary(max_size=3000), st.sampled_from([-5.0, 1.0, 1.0, 30.0, 600.0])), max_size=60))
def test_any_sequence_of_stores_never_raises_and_no_class_exceeds_its_share(stores):
    limit = 8 * (3000 + ENTRY_OVERHEAD)
    store, now = bounded(limit), get_dht_time()
    for key, subkey, value, ahead in stores:
        result = store.store(key, value, now + ahead, subkey=subkey)
        assert result in (True, False)
        for kind, held in store.ledger.held.items():
            assert 0 <= held <= store.ledger.share(kind)


def test_subkeys_python_cannot_order_among_themselves_never_share_a_dictionary():
    """hivemind orders a dictionary's subkeys in a heap: bytes beside text with the same expiration raised TypeError
    inside the store, and left the heap broken."""
    store, expires = bounded(10**6), get_dht_time() + 60
    assert store.store_subkey(OTHER, b"a", b"v", expires)
    assert not store.store_subkey(OTHER, "a", b"v", expires)
    assert not store.store_subkey(OTHER, 1, b"v", expires)
    assert store.store_subkey(OTHER, b"b", b"v", expires)
    assert store.store_subkey(DHTID.generate(source="numbers"), 1, b"v", expires)
    assert store.store_subkey(DHTID.generate(source="numbers"), 2.5, b"v", expires)
    assert sorted(store.get(OTHER).value.data) == [b"a", b"b"]


def peer(i: int) -> bytes:
    """A made-up peer id's bytes (a sha2-256 multihash), as a store request's sender and as a declaration's subkey."""
    return b"\x12\x20" + i.to_bytes(32, "big")


@contextmanager
def sending_as(sender):
    """Stores made meanwhile come from ``sender``, as inside the node's handler of a store request from it."""
    token = storage_budget._SENDER.set(sender)
    try:
        yield
    finally:
        storage_budget._SENDER.reset(token)


def held_in(store) -> int:
    """What ``store`` holds, in the ledger's bytes, counted from the store itself."""
    return sum(entry_cost(item.value) if not isinstance(item.value, DictionaryDHTValue) else
               sum(entry_cost(sub.value, subkey) for subkey, sub in item.value.items()) for _, item in store.items())


def test_a_sender_holds_at_most_its_part_of_a_class_the_node_itself_more():
    limit = 4 * 100 * (1000 + ENTRY_OVERHEAD)  # 'other' holds 100 entries of 1000 bytes
    store, expires, value = bounded(limit), get_dht_time() + 60, b"x" * 1000
    with sending_as(peer(1)):
        taken = [store.store(DHTID.generate(source=f"a{i}"), value, expires) for i in range(100)]
    assert sum(taken) == int(100 * SENDER_SHARE) and taken[:sum(taken)] == [True] * sum(taken)
    with sending_as(peer(2)):  # another sender has its own part
        assert store.store(DHTID.generate(source="b"), value, expires)
    assert sum(store.store(DHTID.generate(source=f"own{i}"), value, expires) for i in range(100)) == \
        100 - int(100 * SENDER_SHARE) - 1  # this node's own stores are not capped: they fill the rest
    assert store.ledger.senders["other"].bytes_of == {
        peer(1): int(100 * SENDER_SHARE) * (1000 + ENTRY_OVERHEAD), peer(2): 1000 + ENTRY_OVERHEAD,
        None: (100 - int(100 * SENDER_SHARE) - 1) * (1000 + ENTRY_OVERHEAD)}
    assert store.ledger.evicted["other"] == 0 and held_in(store) == store.ledger.held["other"]


def test_a_full_class_drops_the_biggest_senders_oldest_entries_for_a_sender_under_its_fair_part():
    """The ledger alone: 30 identities fill the averagers' class, each to its fair part; a newcomer's entry is
    still taken, at the cost of the oldest entry of the sender holding the most, and a flooder over its fair part
    is refused."""
    cost, dropped = 300, []
    limit = 480 * cost / SHARES["averagers"]  # the class holds 480 entries: 30 flooders of 16
    ledger = Ledger(limit, lambda key: "averagers", lambda: 0.0, evict=lambda key, subkey: dropped.append(key))
    for round_ in range(40):  # each flooder sends in turn, more than the class holds
        for flooder in range(30):
            key = (flooder, round_)
            if ledger.admits("averagers", key, None, cost, peer(flooder)):
                ledger.add("averagers", key, None, cost, 100.0, peer(flooder))
    assert ledger.held["averagers"] == ledger.share("averagers")
    assert set(ledger.senders["averagers"].bytes_of.values()) == {16 * cost}  # each its fair part, none more
    assert not ledger.admits("averagers", (0, 99), None, cost, peer(0))  # a flooder at its fair part: refused
    # a newcomer under its fair part (480 / 31 entries): taken, the biggest sender's oldest entry dropped
    assert ledger.admits("averagers", "honest", None, cost, peer(99))
    ledger.add("averagers", "honest", None, cost, 100.0, peer(99))
    assert ledger.held["averagers"] == ledger.share("averagers") and ledger.evicted["averagers"] == 1
    (victim,) = dropped
    assert victim[1] < min(key[1] for key, _ in ledger.senders["averagers"].entries_of[peer(victim[0])])
    # the flood goes on: flooders under their fair part take each other's room, never the newcomer's
    for round_ in range(40, 60):
        for flooder in range(30):
            if ledger.admits("averagers", (flooder, round_), None, cost, peer(flooder)):
                ledger.add("averagers", (flooder, round_), None, cost, 100.0, peer(flooder))
    assert "honest" not in dropped and ledger.senders["averagers"].bytes_of[peer(99)] == cost
    assert ledger.held["averagers"] <= ledger.share("averagers")


def test_an_honest_declaration_lands_on_a_class_a_flood_of_30_identities_keeps_full():
    """On hivemind's store: made-up averagers, each from an identity of its own, fill the class; an honest
    averager's declaration (and this node's own) still land, and what the store holds is what the ledger charges."""
    per_entry = entry_cost(b"\xc3", peer(0))
    store, expires = DHTLocalStorage(), get_dht_time() + 60
    storage_budget._bound(store, 200 * per_entry / SHARES["averagers"], lambda key: "averagers", get_dht_time)
    keys = [DHTID.generate(source=f"run_s0of1.0b{bits:016b}") for bits in range(40)]  # 40 rounds' group keys
    for flooder in range(30):
        with sending_as(peer(flooder)):
            for key in keys:
                store.store_subkey(key, peer(flooder), b"\xc3", expires)
    assert store.ledger.held["averagers"] > store.ledger.share("averagers") - per_entry
    with sending_as(peer(1000)):
        assert store.store_subkey(keys[7], peer(1000), b"\xc3", expires)
    assert store.store_subkey(keys[7], peer(1001), b"\xc3", expires)  # this node's own averager
    assert {peer(1000), peer(1001)} <= set(store.get(keys[7]).value.data)
    assert store.ledger.evicted["averagers"] > 0
    assert held_in(store) == store.ledger.held["averagers"] <= store.ledger.share("averagers")


def test_an_averagers_declaration_is_taken_only_from_the_peer_it_names():
    """A stranger can neither declare a made-up averager nor withdraw another's declaration (False, expiring
    later); the node's own stores (its averagers', and what it caches from its lookups) pass."""
    store, expires = bounded(10**6), get_dht_time() + 60
    with sending_as(peer(1)):
        assert store.store_subkey(AVERAGER, peer(1), b"\xc3", expires)
        assert not store.store_subkey(AVERAGER, peer(2), b"\xc3", expires)
    with sending_as(peer(2)):
        assert not store.store_subkey(AVERAGER, peer(1), b"\xc2", expires + 10)
        assert store.store_subkey(OTHER, peer(1), b"\xc2", expires)  # other keys: any subkey
    assert store.store_subkey(AVERAGER, peer(3), b"\xc3", expires)  # this node itself
    assert store.get(AVERAGER).value.data.keys() == {peer(1), peer(3)}
    assert store.get(AVERAGER).value.get(peer(1)).value == b"\xc3"
    assert store.ledger.refused["averagers"] == 2


SENDERS = st.sampled_from([None, peer(1), peer(2), peer(3)])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(SENDERS, st.sampled_from([RECORD, AVERAGER, OTHER, DHTID.generate(source="x")]),
                          st.one_of(st.none(), SENDERS, st.binary(max_size=2)), st.binary(max_size=1500),
                          st.sampled_from([-5.0, 1.0, 1.0, 30.0])), max_size=60))
def test_no_sender_exceeds_its_part_no_class_its_share_and_the_store_holds_no_more_than_charged(stores):
    store, now = bounded(8 * (1500 + ENTRY_OVERHEAD)), get_dht_time()
    for sender, key, subkey, value, ahead in stores:
        with sending_as(sender):
            assert store.store(key, value, now + ahead, subkey=subkey) in (True, False)
        for kind, held in store.ledger.held.items():
            assert 0 <= held <= store.ledger.share(kind)
            for who, mine in store.ledger.senders[kind].bytes_of.items():
                assert 0 < mine and (who is None or mine <= store.ledger.share(kind) * SENDER_SHARE)
        assert held_in(store) <= sum(store.ledger.held.values())
