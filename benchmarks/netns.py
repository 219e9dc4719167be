"""An emulated WAN on one machine: hosts in their own network namespaces, joined by a bridge, every link
rate-limited with ``tc ... tbf`` in both directions.

    with EmulatedWAN(num_hosts=3, rate_mbit=100) as wan:
        proc = wan.popen(0, ["python", "-m", "p2p_diloco", "peer", "--host-maddrs", f"/ip4/{wan.ip(0)}/tcp/0"])
        wan.set_rate(10)          # reshape every link between runs

Needs root (ip netns, veth, bridge, tc). Only the namespaces it creates are touched; they are removed on
exit, on SIGINT/SIGTERM and at interpreter exit, and `python benchmarks/netns.py --cleanup` removes any that a
killed run left behind. netem is not available here: links have a rate, not an added delay.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "p2pw"
SUBNET = "10.88.0"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def run_prefix(letter: str = "t") -> str:
    """A prefix of this process's own (``p2p<letter><pid in hex>``) for an :class:`EmulatedWAN` that may run beside
    another: the default ``p2pw`` one's cleanup never matches it."""
    return f"p2p{letter}{os.getpid():x}"


def orphaned_prefixes() -> set[str]:
    """The :func:`run_prefix` prefixes of namespaces whose process is gone (a test or benchmark killed mid-run)."""
    out = _run("ip", "netns", "list", check=False).stdout
    found = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"^(p2p[a-z]([0-9a-f]+))-", out, re.M)}
    return {prefix for prefix, pid in found.items() if not Path(f"/proc/{pid}").exists()}


def existing_namespaces(prefix: str = PREFIX) -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def cleanup(prefix: str = PREFIX) -> None:
    for namespace in existing_namespaces(prefix):
        _run("ip", "netns", "pids", namespace, check=False)
        pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", namespace, check=False)


class EmulatedWAN:
    """``num_hosts`` namespaces ``<prefix>-h<i>`` with address 10.88.0.<i+1>, links shaped to ``rate_mbit``.

    ``prefix`` names its namespaces and links (at most 11 characters: a link's name is ``<prefix>v<i>``); on entry it
    removes whatever a killed run of the same prefix left behind, so two runs that share a machine (a test beside a
    benchmark) each need their own: :func:`run_prefix`."""

    def __init__(self, num_hosts: int, rate_mbit: float | None, prefix: str = PREFIX):
        if os.geteuid() != 0:
            raise SystemExit("the emulated WAN needs root (network namespaces and tc)")
        assert len(prefix) <= 11 and num_hosts <= 100, "interface names have at most 15 characters"
        self.num_hosts, self.rate_mbit, self.prefix = num_hosts, rate_mbit, prefix
        self.core = f"{prefix}-core"
        self.processes: list[subprocess.Popen] = []

    def host(self, index: int) -> str:
        return f"{self.prefix}-h{index}"

    def ip(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def __enter__(self) -> EmulatedWAN:
        cleanup(self.prefix)
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        _run("ip", "netns", "add", self.core)
        _run("ip", "-n", self.core, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.core, "link", "set", "br0", "up")
        for i in range(self.num_hosts):
            self._add_host(i)
        self.set_rate(self.rate_mbit)
        return self

    def _add_host(self, i: int) -> None:
        ns, inner, outer = self.host(i), f"{self.prefix}v{i}", f"{self.prefix}b{i}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        _run("ip", "link", "set", inner, "netns", ns)
        _run("ip", "link", "set", outer, "netns", self.core)
        _run("ip", "-n", self.core, "link", "set", outer, "master", "br0")
        _run("ip", "-n", self.core, "link", "set", outer, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", inner)
        _run("ip", "-n", ns, "link", "set", inner, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape every host's link to ``rate_mbit`` in both directions (None: unshaped)."""
        self.rate_mbit = rate_mbit
        for i in range(self.num_hosts):
            for ns, dev in ((self.host(i), f"{self.prefix}v{i}"), (self.core, f"{self.prefix}b{i}")):
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                if rate_mbit is not None:
                    # burst: 10 ms at the rate (at least 32 KB); queue: 1 s of traffic before drops
                    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "1000ms")

    def interface(self, index: int) -> str:
        return f"{self.prefix}v{index}"

    def popen(self, index: int, command: list[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` inside host ``index``'s namespace (its own process group)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.host(index), *command], start_new_session=True,
                                   **kwargs)
        self.processes.append(process)
        return process

    def stop_processes(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
        self.processes.clear()

    def _on_signal(self, signum, _frame) -> None:
        self.close()
        sys.exit(128 + signum)

    def close(self) -> None:
        self.stop_processes()
        cleanup(self.prefix)

    def __exit__(self, *exc) -> None:
        self.close()


_SAMPLER = """
import sys, time
path, period, devs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
with open(path, "w") as out:
    while True:
        counts = []
        for dev in devs:
            with open(f"/sys/class/net/{dev}/statistics/rx_bytes") as counter:
                counts.append(counter.read().strip())
        out.write(f"{time.time():.4f} {' '.join(counts)}\\n")
        out.flush()
        time.sleep(period)
"""


class WireCounter:
    """The bytes each host sends on its link, sampled every ``period_s`` on the wire: the receive counter of the
    host's bridge-side veth (what left the host, after its tc shaping), read by a process in the bridge's
    namespace. ``samples()`` gives, per host, ``[(unix time, bytes so far), ...]``.

        with WireCounter(wan, hosts=[0, 1], path=out / "wire.txt"):
            ...  # run the swarm
    """

    def __init__(self, wan: EmulatedWAN, hosts: list[int], path, period_s: float = 0.02):
        self.wan, self.hosts, self.path, self.period_s = wan, list(hosts), path, period_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> WireCounter:
        devs = [f"{self.wan.prefix}b{i}" for i in self.hosts]
        self.process = subprocess.Popen(["ip", "netns", "exec", self.wan.core, sys.executable, "-c", _SAMPLER,
                                         str(self.path), str(self.period_s), *devs], start_new_session=True)
        self.wan.processes.append(self.process)
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def samples(self) -> dict[int, list[tuple[float, int]]]:
        series = {host: [] for host in self.hosts}
        for line in open(self.path).read().splitlines():
            fields = line.split()
            if len(fields) != len(self.hosts) + 1:  # the last line, cut by the kill
                continue
            for host, count in zip(self.hosts, fields[1:]):
                series[host].append((float(fields[0]), int(count)))
        return series


_BARE_AVERAGER = """
import sys, time, torch, hivemind
from hivemind.compression import NoCompression
first, host, maddrs, megabytes = sys.argv[1] == "first", sys.argv[2], sys.argv[3], float(sys.argv[4])
if first:
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
    open(maddrs, "w").write(" ".join(str(m) for m in dht.get_visible_maddrs()))
else:
    dht = hivemind.DHT(initial_peers=open(maddrs).read().split(), host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
averager = hivemind.averaging.DecentralizedAverager(
    [torch.randn(int(megabytes * 1e6 / 4))], dht, prefix="bare", target_group_size=2, min_matchmaking_time=5,
    request_timeout=3, compression=NoCompression(), start=True)
time.sleep(3)
assert averager.step(timeout=120) is not None, "the averaging failed"
time.sleep(3)
"""


def bare_averaging_bytes(wan: EmulatedWAN, megabytes: float, folder) -> dict[int, int]:
    """Two stock hivemind averagers (hosts 0 and 1) average one fp32 tensor of ``megabytes`` once; the bytes each
    host put on its link (DHT start and matchmaking included). Its parts and replies are ``megabytes`` per peer."""
    maddrs = Path(folder) / "bare.maddrs"
    maddrs.unlink(missing_ok=True)
    with WireCounter(wan, [0, 1], Path(folder) / "bare-wire.txt") as counter:
        first = wan.popen(0, [sys.executable, "-c", _BARE_AVERAGER, "first", wan.ip(0), str(maddrs), str(megabytes)])
        while not (maddrs.exists() and maddrs.read_text().strip()):
            if first.poll() is not None:
                raise RuntimeError("the first averager did not start")
            time.sleep(0.2)
        second = wan.popen(1, [sys.executable, "-c", _BARE_AVERAGER, "second", wan.ip(1), str(maddrs),
                               str(megabytes)])
        if first.wait(timeout=300) != 0 or second.wait(timeout=300) != 0:
            raise RuntimeError("a bare averager failed")
    return {host: samples[-1][1] - samples[0][1] for host, samples in counter.samples().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces a killed run left behind")
    parser.add_argument("--selftest", type=float, metavar="MBIT", help="shape two hosts and measure the rate")
    parser.add_argument("--bare-averaging", type=float, metavar="MB",
                        help="on two hosts at --rate Mbit/s, stock hivemind averagers average MB of fp32 once: the "
                             "bytes on each link against the MB of parts and replies (the wire's own overhead)")
    parser.add_argument("--rate", type=float, default=10.0, help="link rate for --bare-averaging, Mbit/s")
    args = parser.parse_args()
    if args.bare_averaging:
        with tempfile.TemporaryDirectory() as folder, EmulatedWAN(2, args.rate) as wan:
            sent = bare_averaging_bytes(wan, args.bare_averaging, folder)
        for host, count in sent.items():
            print(f"host {host}: {count / 1e6:.3f} MB on the wire for {args.bare_averaging:g} MB of parts and "
                  f"replies ({count / (args.bare_averaging * 1e6):.3f}x)")
    if args.cleanup:
        orphans = orphaned_prefixes()
        for prefix in [PREFIX, *orphans]:
            cleanup(prefix)
        print("removed", ", ".join([PREFIX, *sorted(orphans)]), "namespaces")
    if args.selftest:
        with EmulatedWAN(2, args.selftest) as wan:
            print(f"measured {measure_rate(wan, max(2.0, args.selftest * 0.2)):.1f} Mbit/s with tbf at "
                  f"{args.selftest} Mbit/s")


def measure_rate(wan: EmulatedWAN, megabytes: float = 2.0) -> float:
    """Throughput of one TCP stream from host 0 to host 1, in Mbit/s."""
    server = (f"import socket,time\ns=socket.socket();s.bind(('{wan.ip(1)}',5301));s.listen(1)\n"
              "c,_=s.accept();n=0;t=None\n"
              "while True:\n d=c.recv(1<<16)\n t=t or time.time()\n if not d: break\n n+=len(d)\n"
              "print(n*8/(time.time()-t)/1e6)")
    client = (f"import socket,time\ntime.sleep(0.5);s=socket.create_connection(('{wan.ip(1)}',5301))\n"
              f"s.sendall(b'x'*int({megabytes}*1e6));s.close()")
    receiver = wan.popen(1, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    wan.popen(0, [sys.executable, "-c", client]).wait(timeout=300)
    return float(receiver.communicate(timeout=300)[0].strip())


if __name__ == "__main__":
    main()
