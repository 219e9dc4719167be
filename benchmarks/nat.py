"""Peers behind a NAT router, on one machine: an "internet" and a home network, each a bridge in its own network
namespace, joined by a router namespace that masquerades the home network's traffic (nftables) and lets nothing
in that the inside did not start, except one forwarded port.

    with NATNetwork() as net:
        ip = net.add_host("boot", public=True)          # on the internet: 11.77.0.<n>
        inside = net.add_host("home1")                   # behind the NAT: 192.168.77.<n>
        net.forward(4100, inside)                        # <router's public ip>:4100 -> inside:4100
        proc = net.popen("home1", ["python", "-m", "p2p_diloco", "peer", ...])

The "internet" uses 11.77.0.0/24, an address block no private-range check takes for a home network (libp2p treats
10/8, 172.16/12 and 192.168/16 as private, and the documentation blocks as unroutable); it exists only inside the
namespaces made here, which have no route out. Names carry a random suffix (two runs never collide); every namespace
is deleted on close. Needs root and nftables (``nat_unavailable()`` says what is missing).

:class:`NATSwarm` starts a bootstrap node on the internet and ``p2p-diloco peer`` processes of the :data:`KINDS` on
hosts of their own; :func:`run_benchmark` is the whole scenario (``python benchmarks/netns.py --nat``), and
tests/integration/test_nat.py its core.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from local_bootstrap import start_bootstrap  # noqa: E402
from namespaces import Namespaces, cleanup, kill_namespace, netns_available, run_command  # noqa: E402

from p2p_diloco.faults import HOLD_ENV  # noqa: E402
from p2p_diloco.training.metrics import read_metrics  # noqa: E402

PREFIX = "p2pn"
PUBLIC_SUBNET = "11.77.0"
PRIVATE_SUBNET = "192.168.77"
NAT_PACKAGE = "nftables"
FORWARDED_PORT = 4100
KINDS = {
    "public": "on the internet, no option",
    "client": "behind the NAT, --client-mode",
    "relay": "behind the NAT, --use-auto-relay",
    "forwarded": f"behind the NAT, port {FORWARDED_PORT} forwarded, --announce-maddrs",
    "unreachable": "behind the NAT, no option (nobody can dial it)",
}
"""The peers a NAT swarm is made of: where each is, and what it is told."""


def nat_unavailable() -> str | None:
    """None if a NAT router can be emulated here, else why not (naming what to install): tried for real, in a
    namespace of its own, removed after."""
    if (reason := netns_available()) is not None:
        return reason
    if shutil.which("nft") is None:
        return f"needs the nft command for the NAT router (apt-get install {NAT_PACKAGE})"
    probe = f"{PREFIX}-probe-{secrets.token_hex(3)}"
    try:
        made = run_command("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace here: {made.stderr.strip()}"
        table = run_command("ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe", check=False)
        if table.returncode != 0:
            return (f"nftables does not work here ({table.stderr.strip()}; needs the kernel's nf_tables and "
                    f"{NAT_PACKAGE})")
    finally:
        kill_namespace(probe)
    return None


def _ruleset(public_ip: str, forwards: dict[int, str]) -> str:
    """The router's nftables rules: masquerade the home network, drop what comes in unasked, DNAT each forwarded TCP
    port of ``public_ip`` to its inside address, from outside and (hairpin NAT, as most home routers do) from inside."""
    dnat = "\n".join(f"    ip daddr {public_ip} tcp dport {port} dnat to {inside}:{port}"
                     for port, inside in forwards.items())
    return f"""
flush ruleset
table ip nat {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
{dnat}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan0" masquerade
    iifname "lan0" oifname "lan0" ct status dnat masquerade
  }}
}}
table ip filter {{
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "lan0" oifname "wan0" accept
    ct state established,related accept
    ct status dnat accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
    ct state established,related accept
  }}
}}
"""


class NATNetwork(Namespaces):
    """An internet bridge, a home bridge and a masquerading router between them (public leg ``.1`` of the
    internet, inside leg ``.1`` of the home network); hosts are added on either side."""

    def __init__(self):
        super().__init__()
        if (reason := nat_unavailable()) is not None:
            raise SystemExit(f"the NAT network {reason}")
        self.prefix = f"{PREFIX}-{secrets.token_hex(3)}"
        self.internet, self.home, self.router = (f"{self.prefix}-{n}" for n in ("net", "lan", "rt"))
        self.router_ip = f"{PUBLIC_SUBNET}.1"
        self.hosts: dict[str, str] = {}  # name -> address
        self.forwards: dict[int, str] = {}
        self._next = {True: 2, False: 2}

    def __enter__(self) -> NATNetwork:
        try:
            self.add_namespace(self.internet, bridge="br0")
            self.add_namespace(self.home, bridge="br0")
            self.add_namespace(self.router)
            self.link(self.router, "wan0", self.internet, "rt", address=f"{self.router_ip}/24")
            self.link(self.router, "lan0", self.home, "rt", address=f"{PRIVATE_SUBNET}.1/24")
            run_command("ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._apply_rules()
        except BaseException:
            self.close()
            raise
        return self

    def namespace(self, name: str) -> str:
        return f"{self.prefix}-h-{name}"

    def add_host(self, name: str, public: bool = False) -> str:
        """A host ``name`` on the internet or behind the NAT (its default route through the router); its address."""
        subnet = PUBLIC_SUBNET if public else PRIVATE_SUBNET
        address = f"{subnet}.{self._next[public]}"
        self._next[public] += 1
        namespace = self.add_namespace(self.namespace(name))
        port = f"h{len(self.hosts)}"
        self.link(namespace, "eth0", self.internet if public else self.home, port, address=f"{address}/24")
        # the home network's way out; on the internet, packets for a home address reach the router and are
        # dropped there (as on the internet: a dial into a home network times out, it is not refused)
        gateway = self.router_ip if public else f"{PRIVATE_SUBNET}.1"
        run_command("ip", "-n", namespace, "route", "add", "default", "via", gateway)
        self.hosts[name] = address
        return address

    def forward(self, port: int, inside: str) -> str:
        """Forward TCP ``port`` of the router's public address to the same port of ``inside``; the public address."""
        self.forwards[port] = inside
        self._apply_rules()
        return self.router_ip

    def _apply_rules(self) -> None:
        subprocess.run(["ip", "netns", "exec", self.router, "nft", "-f", "-"], check=True, capture_output=True,
                       text=True, input=_ruleset(self.router_ip, self.forwards))

    def popen(self, name: str, command: list[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` on host ``name`` (its own process group)."""
        return super().popen(self.namespace(name), command, **kwargs)


def cleanup_nat() -> None:
    """Remove every NAT network namespace on this machine (those a killed run left behind; and running ones)."""
    cleanup(PREFIX)




class NATSwarm:
    """A bootstrap node on the internet of ``net`` and ``p2p-diloco peer`` processes of :data:`KINDS`, each on a host
    of its own; their console output in ``folder/<name>.log``, their output folders ``folder/<name>``."""

    def __init__(self, net: NATNetwork, folder: Path, common: list[str], run_id: str = "nat"):
        self.net, self.folder, self.common, self.run_id = net, Path(folder), list(common), run_id
        self.maddrs: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.kinds: dict[str, str] = {}

    def start_bootstrap(self, timeout_s: float = 120.0) -> list[str]:
        ip = self.net.add_host("bootstrap", public=True)
        log = open(self.folder / "bootstrap.log", "w")
        proc, self.maddrs = start_bootstrap(self.folder, host=ip, log=log, timeout_s=timeout_s, cwd=ROOT,
                                            popen=lambda command, **kw: self.net.popen("bootstrap", command, **kw))
        self.procs["bootstrap"] = proc
        return self.maddrs

    def start_peer(self, name: str, kind: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
        """A peer of ``kind`` on a new host ``name``, joining through the bootstrap node (``env``: its environment)."""
        ip = self.net.add_host(name, public=kind == "public")
        listen = f"/ip4/{ip}/tcp/0"
        options = {"client": ["--client-mode"], "relay": ["--use-auto-relay"]}.get(kind, [])
        if kind == "forwarded":
            public_ip = self.net.forward(FORWARDED_PORT, ip)
            listen = f"/ip4/{ip}/tcp/{FORWARDED_PORT}"
            options = ["--announce-maddrs", f"/ip4/{public_ip}/tcp/{FORWARDED_PORT}"]
        command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *self.maddrs, "--host-maddrs",
                   listen, "--run-id", self.run_id, "--output-dir", str(self.folder / name), *self.common, *options,
                   *extra]
        log = open(self.folder / f"{name}.log", "w")
        self.procs[name] = self.net.popen(name, command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self.kinds[name] = kind
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            tail = self.log(name)[-3000:]
            raise AssertionError(f"{name} did not finish within {timeout_s} s; log:\n{tail}") from None

    def events(self, name: str, kind: str) -> list[dict]:
        return [e for e in read_metrics(self.folder / name / "metrics-stage0.jsonl") if e["kind"] == kind]

    def applied(self, name: str) -> list[dict]:
        """The round ends of ``name`` that applied an average or a fallback, in order."""
        return [e for e in self.events(name, "round") if e["applied_round"] is not None]


# the fastest settings of the swarm tests (tests/integration/conftest.py), no evaluation
TINY = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "32", "--data.eval_batches", "2",
        "--train.log_every", "5", "--train.progress", "false", "--run.num_threads", "1",
        "--averaging.matchmaking_time_s", "4", "--averaging.request_timeout_s", "3",
        "--averaging.round_timeout_s", "20", "--averaging.allreduce_timeout_s", "20",
        "--averaging.next_chunk_timeout_s", "10"]


def _row(swarm: NATSwarm, name: str, code: int | None) -> str:
    applied = swarm.applied(name)
    averaged = [e for e in applied if e["averaged"]]
    sizes = sorted({e["group_size"] for e in averaged})
    reloads = [e for e in swarm.events(name, "sync") if e["action"] == "reload"]
    reach = next((line.split("] ", 1)[1] for line in swarm.log(name).splitlines() if "] Reachable" in line), "")
    error = next((line for line in swarm.log(name).splitlines() if line.startswith("error:")), "")
    told = reach or error or ("not checked: client mode is never dialed" if swarm.kinds[name] == "client" else "")
    return (f"| {name} | {KINDS[swarm.kinds[name]]} | {code} | {len(averaged)}/{len(applied)} | "
            f"{','.join(map(str, sizes)) or '-'} | {reloads[0]['round'] if reloads else '-'} | {told[:110]} |")


FOUNDERS = ("public", "client", "relay", "forwarded")  # each founding peer is named after its kind


def run_scenario(swarm: NATSwarm, newcomer_after: int, timeout_s: float = 240.0) -> dict[str, int]:
    """The founders (a peer of each reachable kind) start together and train; an unreachable peer starts beside
    them; once the public peer has applied ``newcomer_after`` rounds, a client-mode newcomer behind the NAT joins.
    The newcomer's process starts with the founders and is held before it reads the swarm's records
    (:func:`p2p_diloco.faults.hold_point`), so that its start-up (imports, DHT) cannot make it arrive a busy
    machine's tens of seconds late, when the run is nearly over. Returns every peer's exit code, once all have
    exited."""
    swarm.start_bootstrap()
    for name in FOUNDERS:
        swarm.start_peer(name, name, "--train.wait_for_peers", str(len(FOUNDERS)))
    swarm.start_peer("unreachable", "unreachable")
    release = swarm.folder / "newcomer.go"
    swarm.start_peer("newcomer", "client", env=dict(os.environ, **{HOLD_ENV: f"start:{release}"}))
    deadline = time.monotonic() + timeout_s
    while len(swarm.applied("public")) < newcomer_after:
        if swarm.procs["public"].poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the public peer applied no round in time; log:\n{swarm.log('public')[-3000:]}")
        time.sleep(0.3)
    release.touch()
    return {name: swarm.wait(name, timeout_s) for name in [*FOUNDERS, "newcomer", "unreachable"]}


def run_benchmark(folder: Path, rounds: int, inner_steps: int, newcomer_after: int) -> None:
    """:func:`run_scenario` with ``rounds`` rounds of ``inner_steps``; one row per peer."""
    common = TINY + ["--train.num_rounds", str(rounds), "--diloco.inner_steps", str(inner_steps)]
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with NATNetwork() as net:
        swarm = NATSwarm(net, folder, common)
        codes = run_scenario(swarm, newcomer_after, timeout_s=600)
        wall_s = time.monotonic() - started
    anchors = [{e["applied_round"]: e["anchor_sha256"] for e in swarm.applied(name)} for name in FOUNDERS]
    identical = all(len({a.get(r) for a in anchors}) == 1 for r in range(rounds))
    first = swarm.events("newcomer", "round")[:1]
    joined = bool(first) and first[0]["anchor_sha256"] == anchors[0].get(first[0]["anchor_applied_round"])
    print(f"NAT swarm: {rounds} rounds of H = {inner_steps}, tiny model; newcomer started once the public peer had "
          f"applied {newcomer_after} round(s); {wall_s:.0f} s in all")
    print("| peer | where, options | exit | averaged rounds | group sizes | reloaded at round | start-up check |")
    print("|---|---|---|---|---|---|---|")
    for name, code in codes.items():
        print(_row(swarm, name, code))
    print(f"anchors of the four founders bit-identical after every round: {identical}; the newcomer's first round "
          f"ends on their anchor: {joined}")
