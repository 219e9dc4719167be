"""Signed, schema-checked DHT records with real hivemind DHTs on 127.0.0.1: nobody can overwrite another's
progress record, a forged or malformed record never reaches a reader, honest records round-trip."""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from functools import partial
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.config import DHTConfig
from p2p_diloco.swarm import SwarmError, fetch_progress, publish_progress, start_dht, visible_maddrs
from p2p_diloco.swarm.discovery.fingerprint import check_fingerprint, config_key, publish_fingerprint
from p2p_diloco.swarm.discovery.progress import ProgressRecord, progress_key, shown_facts
from p2p_diloco.swarm.discovery.records import MAX_RECORD_TTL_S, peer_id_of_owner, record_owner, run_record_validators

pytestmark = pytest.mark.timeout(120)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FINGERPRINT = {"version": 2, "model.dim": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
               "model.ffn_dim": 64, "model.vocab_size": 61, "model.max_seq_len": 16, "model.tie_embeddings": False,
               "model.init_seed": 0, "model.rope_theta": 10000.0, "model.norm_eps": 1e-5, "model.init_from": None,
               "pipeline.stages": 1, "pipeline.stage_layers": [2], "data.vocab_size": 61,
               "data.dtype": "uint16", "data.tokenizer": "byte", "diloco.fragments": None}


class Forger(RecordValidatorBase):
    """An attacker's DHT node: it stores whatever it is given, signs entries under its own two keys (``own``,
    ``other``), and signs entries under ``victim``'s key with its own private key (a wrong signature)."""

    def __init__(self, victim: bytes):
        key = RSAPrivateKey()
        self.own, self.other = RSASignatureValidator(key), RSASignatureValidator(RSAPrivateKey())
        self.impostor = RSASignatureValidator(key)
        self.impostor._local_public_key = victim  # signs as the victim, with the wrong private key
        self.victim = victim

    def validate(self, record) -> bool:
        return True

    def sign_value(self, record) -> bytes:
        signer = self.impostor if self.victim in record.subkey else \
            self.other if self.other.local_public_key in record.subkey else self.own
        return signer.sign_value(record)

    def strip_value(self, record) -> bytes:
        return self.own.strip_value(record)


def record(round_index: int = 1, **changes) -> ProgressRecord:
    return dataclasses.replace(ProgressRecord(peer="QmPeerA", stage=0, num_stages=1, round=round_index,
                                              inner_step=10 * round_index, tokens_per_s=100.0, loss=2.5,
                                              time=get_dht_time()), **changes)


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


def run_of(test: pytest.Item) -> str:
    """The run id of ``test``'s records: one of its own, so that its records are under keys no other test reads
    or writes (the three nodes of :func:`swarm` serve every test of the module)."""
    return "records-" + re.sub(r"[^A-Za-z0-9]+", "-", test.name).strip("-")


@pytest.fixture(scope="module")
def module_swarm(request):
    """Three honest nodes started as the peers start theirs (signatures and the run's schemas), shared by the tests
    of this module: each node has the schemas of every test's run (:func:`run_of`) from its start, as a peer has
    its run's. Returns the nodes and those runs."""
    runs = sorted({run_of(test) for test in request.session.items if test.module is request.module})

    def validators() -> list:
        return [validator for run in runs for validator in run_record_validators(run)]

    nodes = [start_dht(DHTConfig(host_maddrs=LOOPBACK), record_validators=validators())]
    try:
        initial = visible_maddrs(nodes[0])
        for _ in range(2):
            nodes.append(start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial),
                                   record_validators=validators()))
        yield nodes, frozenset(runs)
    finally:
        for node in nodes:
            node.shutdown()


@pytest.fixture
def run(request) -> str:
    """This test's run id (see :func:`run_of`)."""
    return run_of(request.node)


@pytest.fixture
def swarm(module_swarm, run):
    """The three shared honest nodes, started with this test's run's schemas; no test shuts one down."""
    nodes, runs = module_swarm
    assert run in runs, f"the shared nodes were started without the schemas of run {run}"
    assert all(node.is_alive() for node in nodes)
    return list(nodes)


@pytest.fixture
def attacker(swarm):
    """A node that checks nothing and forges as it pleases: ``attacker(victim)`` starts one that signs entries under
    ``victim``'s key with its own private key; returns the node and its :class:`Forger`."""
    started = []

    def start(victim: bytes) -> tuple[hivemind.DHT, Forger]:
        forger = Forger(victim)
        node = hivemind.DHT(start=True, initial_peers=visible_maddrs(swarm[0]), host_maddrs=LOOPBACK,
                            record_validators=[forger])
        started.append(node)
        return node, forger

    yield start
    for node in started:
        node.shutdown()


def progress_value(round_index: int, node: str, **changes) -> dict:
    """A progress record as it goes into the DHT."""
    value = {k: v for k, v in vars(record(round_index)).items() if k != "expiration"}
    return dict(value, node=node, **shown_facts(record(round_index)) | changes)


def store(node, subkey, value, key: str, ttl_s: float = 120) -> bool:
    """Store and wait; True if the first node that answered kept it."""
    return node.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + ttl_s)


def held(node, subkey, key: str) -> bool:
    """Whether ``node`` keeps an entry under ``subkey`` in its own storage (it will hand it to whoever asks)."""
    return subkey in node.run_coroutine(partial(_local_subkeys, key=key))


async def _local_subkeys(_dht, node, key: str) -> list:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return [] if found is None else [subkey for subkey, _ in found.value.items()]


def by_node(records: list[ProgressRecord]) -> dict[str, ProgressRecord]:
    return {r.node: r for r in records}


def test_honest_records_round_trip_and_refresh(swarm, run):
    a, b, reader = swarm
    publish_progress(a, run, record(1, loss=float("nan")), ttl_s=60)  # NaN: no loss yet, sent as None
    publish_progress(b, run, record(1, peer="QmPeerB", stage=0, applied_round=0, anchor="00ff",
                                     prior_anchor="0a"), ttl_s=60)
    seen = wait_for(lambda: len(fetch_progress(reader, run)) == 2 and fetch_progress(reader, run))
    got = by_node(seen)
    a_id, b_id = a.peer_id.to_base58(), b.peer_id.to_base58()
    assert set(got) == {a_id, b_id}
    assert got[a_id].peer == "QmPeerA" and got[a_id].round == 1 and got[a_id].loss != got[a_id].loss  # NaN
    assert (got[b_id].peer, got[b_id].applied_round, got[b_id].anchor, got[b_id].prior_anchor, got[b_id].loss) == \
        ("QmPeerB", 0, "00ff", "0a", 2.5)
    assert got[b_id].expiration > get_dht_time()
    publish_progress(a, run, record(2), ttl_s=60)  # the owner refreshes its own record
    assert wait_for(lambda: by_node(fetch_progress(reader, run)).get(a_id, record(0)).round == 2)
    assert len(fetch_progress(reader, run)) == 2


def test_nobody_overwrites_another_peers_record(swarm, attacker, run):
    a, b, reader = swarm
    publish_progress(a, run, record(1), ttl_s=60)
    a_id, a_subkey = a.peer_id.to_base58(), record_owner(a, run)
    assert wait_for(lambda: a_id in by_node(fetch_progress(reader, run)))
    forged = progress_value(99, a_id, loss=0.1)
    # an honest node's DHT cannot sign for A: the write goes out unsigned and every node refuses it
    assert not store(b, a_subkey, forged, key=progress_key(run))
    # an attacker signs it with its own key, as if it were A's, and keeps it in its own storage
    mallory, _ = attacker(a_subkey)
    store(mallory, a_subkey, forged, key=progress_key(run))
    assert held(mallory, a_subkey, key=progress_key(run))  # the attacker's node keeps it and hands it out
    for node in (a, b, reader):
        records = fetch_progress(node, run)
        assert [(r.node, r.round, r.loss) for r in records] == [(a_id, 1, 2.5)]


@pytest.mark.parametrize("damage", ["another writer's node id", "far-future expiration", "unsigned",
                                    "wrong signature", "missing field", "wrong type", "negative round",
                                    "nan loss", "unknown field", "stage out of range", "plain subkey"])
def test_forged_or_malformed_records_are_never_read(swarm, attacker, run, damage):
    a, _, honest_reader = swarm
    victim = RSASignatureValidator(RSAPrivateKey()).local_public_key
    mallory, forger = attacker(victim)
    subkey = forger.own.local_public_key
    mallory_id, other_id = peer_id_of_owner(subkey), peer_id_of_owner(forger.other.local_public_key)
    value = progress_value(3, mallory_id)
    ttl_s = 120
    if damage == "another writer's node id":  # signed by its own key, claims an honest peer's node id
        value["node"] = a.peer_id.to_base58()
    elif damage == "far-future expiration":  # published once, it would outlive its writer forever
        ttl_s = 10 * MAX_RECORD_TTL_S
    elif damage == "unsigned":  # names a key, carries no signature
        subkey = RSASignatureValidator(RSAPrivateKey()).local_public_key
    elif damage == "wrong signature":
        subkey = victim
    elif damage == "missing field":
        del value["round"]
    elif damage == "wrong type":
        value["stage"] = "0"
    elif damage == "negative round":
        value["round"] = -1
    elif damage == "nan loss":
        value["loss"] = float("nan")
    elif damage == "unknown field":
        value["admin"] = True
    elif damage == "stage out of range":
        value["stage"] = 1
    elif damage == "plain subkey":
        subkey = "QmNotAKey"
    key = progress_key(run)
    store(mallory, subkey, value, key, ttl_s=ttl_s)
    assert held(mallory, subkey, key)  # the attacker's node keeps it: it is in the DHT for others to find
    assert store(mallory, forger.other.local_public_key, progress_value(4, other_id), key)  # this one is fine
    status_reader = start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=visible_maddrs(a)))  # as `status` does
    try:
        for reader in (honest_reader, status_reader):  # status_reader gets the run's schemas on its first read
            records = wait_for(lambda r=reader: fetch_progress(r, run))
            assert [(r.node, r.round) for r in records] == [(other_id, 4)], damage
        found = honest_reader.get(progress_key(run), latest=True)  # its validators dropped it, not only our parse
        assert subkey not in found.value and forger.other.local_public_key in found.value
    finally:
        status_reader.shutdown()


def test_a_dht_node_that_does_not_check_signatures_is_refused(swarm, run):
    plain = hivemind.DHT(start=True, initial_peers=visible_maddrs(swarm[0]), host_maddrs=LOOPBACK)
    try:
        with pytest.raises(SwarmError, match="not started by p2p_diloco.swarm.start_dht"):
            fetch_progress(plain, run)
    finally:
        plain.shutdown()


def test_fingerprint_mismatch_is_refused_but_a_forged_one_is_ignored(swarm, attacker, run):
    a, b, newcomer = swarm
    mallory, forger = attacker(victim=record_owner(a, run))
    other_dim = dict(FINGERPRINT, **{"model.dim": 64})
    # forged: a wrong type under the attacker's own key, and a well-formed one under A's key, wrongly signed
    store(mallory, forger.own.local_public_key, dict(other_dim, **{"model.dim": "64"}), key=config_key(run))
    store(mallory, record_owner(a, run), other_dim, key=config_key(run))
    assert held(mallory, record_owner(a, run), key=config_key(run))
    publish_fingerprint(a, run, FINGERPRINT, ttl_s=60)
    assert wait_for(lambda: newcomer.get(config_key(run), latest=True))
    check_fingerprint(newcomer, run, FINGERPRINT)  # the forged ones are not read: no refusal
    publish_fingerprint(b, run, other_dim, ttl_s=60)  # one peer of two differs: no veto
    assert wait_for(lambda: len(newcomer.get(config_key(run), latest=True).value) >= 2)
    check_fingerprint(newcomer, run, FINGERPRINT)
    publish_fingerprint(a, run, other_dim, ttl_s=60)  # now the swarm's majority differs: refused
    with pytest.raises(SwarmError, match=r"model.dim is 32 here but 64 in the swarm \(2 of 2 live peers\)"):
        wait_for(lambda: check_fingerprint(newcomer, run, FINGERPRINT))
    # a private swarm counts its members only: two outsiders' records of another config are no majority there
    publish_fingerprint(a, run, FINGERPRINT, ttl_s=60)
    member = frozenset({a.peer_id.to_base58()})
    assert wait_for(lambda: newcomer.get(config_key(run), latest=True).value[record_owner(a, run)].value["model.dim"]
                    == 32)
    check_fingerprint(newcomer, run, FINGERPRINT, allowlist=member)
    with pytest.raises(SwarmError, match=r"\(1 of 1 live peers\)"):
        check_fingerprint(newcomer, run, other_dim, allowlist=member)


def test_records_are_signed_by_the_nodes_libp2p_identity(swarm, run, tmp_path):
    """The signing key is the node's identity key, so averaging.allowlist (peer ids) applies to records, and a
    node with a fixed identity signs with the same key after a restart."""
    a, _, _ = swarm
    assert peer_id_of_owner(record_owner(a, run)) == a.peer_id.to_base58()
    path = tmp_path / "identity.key"
    keys = []
    for _ in range(2):
        node = start_dht(DHTConfig(host_maddrs=LOOPBACK, identity_path=str(path)), run_record_validators(run))
        try:
            keys.append(record_owner(node, run))
            assert peer_id_of_owner(keys[-1]) == node.peer_id.to_base58()
        finally:
            node.shutdown()
    assert keys[0] == keys[1]


def test_a_peer_leaving_at_the_end_waits_for_its_last_groupmates(swarm, run):
    """``SwarmLink.wait_for_groupmates`` (a peer at the end of the run): it waits while a groupmate's record says it
    has not applied the last round, returns as soon as it has, and does not wait for a node without a record (gone)
    nor past its bound."""
    from p2p_diloco.swarm import SwarmLink

    a, b, _ = swarm
    link = SwarmLink(a, run, "QmPeerA")
    b_id = b.peer_id.to_base58()
    publish_progress(b, run, record(4, peer="QmPeerB", applied_round=2), ttl_s=60)
    assert wait_for(lambda: b_id in by_node(fetch_progress(a, run)))
    started = time.monotonic()
    assert link.wait_for_groupmates([b_id, link.node, "QmGone"], 3, timeout_s=1.5) == {b_id}
    assert time.monotonic() - started >= 1.5
    publish_progress(b, run, record(4, peer="QmPeerB", applied_round=3), ttl_s=60)
    started = time.monotonic()
    assert link.wait_for_groupmates([b_id, "QmGone"], 3, timeout_s=30) == set()
    assert time.monotonic() - started < 20


def test_a_node_without_an_identity_path_leaves_no_key_behind(swarm, run, monkeypatch):
    """The identity made for a node alone is in a private temporary folder only until its daemon has read it: a
    peer killed with SIGKILL used to leave the folder, key inside, in /tmp. The node signs all the same."""
    from p2p_diloco.swarm.discovery import dht as dht_module

    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(dht_module.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    node = start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=visible_maddrs(swarm[0])),
                     record_validators=run_record_validators(run))
    try:
        assert len(made) == 1 and not Path(made[0]).exists()
        publish_progress(node, run, record(3), ttl_s=60)
        assert wait_for(lambda: by_node(fetch_progress(swarm[1], run)).get(node.peer_id.to_base58()))
    finally:
        node.shutdown()


def test_a_round_end_uses_the_watchs_fresh_read_of_the_records(swarm, run, monkeypatch):
    """``SwarmLink.expected_group_size`` at a round end takes the records that the watch of ``others_ended_round``
    (a read every 0.5 s, asked at every inner step) read less than ``fresh_read_s`` ago, instead of a DHT search of
    its own (up to 2.7 s on a busy machine: the peer came late to its round's group); an older read is read again."""
    from p2p_diloco.swarm import SwarmLink
    from p2p_diloco.swarm.discovery import link as swarm_link

    a, b, _ = swarm
    link = SwarmLink(a, run, "QmPeerA")
    publish_progress(b, run, record(4, peer="QmPeerB", applied_round=2), ttl_s=60)
    assert wait_for(lambda: link.others_ended_round(3))  # the watch has read b's record (b is on round 4)
    searches = []
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda *args, **kwargs: searches.append(args) or [])
    link.fresh_read_s = 30.0
    assert link.expected_group_size(4) == 2 and searches == []  # b counted, from the watch's read
    link.fresh_read_s = 0.0
    assert link.expected_group_size(4) is None and len(searches) == 1  # a read of its own (here: nobody, unknown)


def test_a_never_met_identitys_record_does_not_end_a_round(swarm, run):
    """``diloco.round_end = swarm``, with real signed records: a record of an identity this stage never averaged with
    that names round 4 does not end its round 3 (one such record ended every round after one inner step); the same
    record of a groupmate does, and a stage that has met nobody yet follows any record (until its first group)."""
    from p2p_diloco.swarm import SwarmLink

    a, b, _ = swarm
    b_id = b.peer_id.to_base58()
    sybil = start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=visible_maddrs(a)), run_record_validators(run))
    try:
        sybil_id = sybil.peer_id.to_base58()
        publish_progress(sybil, run, record(4, peer="QmSybil"), ttl_s=60)
        publish_progress(b, run, record(3, peer="QmPeerB", applied_round=2), ttl_s=60)
        met_b, met_nobody = SwarmLink(a, run, "QmPeerA"), SwarmLink(a, run, "QmPeerA")
        met_b.peers_met = lambda: frozenset({b_id})

        def has_read(link: SwarmLink) -> bool:
            link.others_ended_round(3)
            return {b_id, sybil_id} <= {r.node for r in (link._last_read or (0.0, []))[1]}  # the watch's last read

        assert wait_for(lambda: has_read(met_b) and has_read(met_nobody))
        assert not met_b.others_ended_round(3)
        assert met_nobody.others_ended_round(3)
        publish_progress(b, run, record(4, peer="QmPeerB", applied_round=2), ttl_s=60)
        assert wait_for(lambda: met_b.others_ended_round(3))
    finally:
        sybil.shutdown()
