"""An emulated WAN on one machine: hosts in their own network namespaces, joined by a bridge, every link
rate-limited with ``tc ... tbf`` in both directions.

    with EmulatedWAN(num_hosts=3, rate_mbit=100) as wan:
        proc = wan.popen(0, ["python", "-m", "p2p_diloco", "peer", "--host-maddrs", f"/ip4/{wan.ip(0)}/tcp/0"])
        wan.set_rate(10)          # reshape every link between runs

Needs root (ip netns, veth, bridge, tc). Only the namespaces it creates are touched; they are removed on
exit, on SIGINT/SIGTERM and at interpreter exit, and `python benchmarks/netns.py --cleanup` removes any that a
killed run left behind. netem is not available here: links have a rate, not an added delay.

This WAN is built of ``benchmarks/namespaces.py``'s :class:`Namespaces`, as is the NAT router of
``benchmarks/nat.py`` (run by ``--nat``).
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

from namespaces import Namespaces, cleanup, run_command

PREFIX = "p2pw"
SUBNET = "10.88.0"


def run_prefix(letter: str = "t") -> str:
    """A prefix of this process's own (``p2p<letter><pid in hex>``) for an :class:`EmulatedWAN` that may run beside
    another: the default ``p2pw`` one's cleanup never matches it."""
    return f"p2p{letter}{os.getpid():x}"


def orphaned_prefixes() -> set[str]:
    """The :func:`run_prefix` prefixes of namespaces whose process is gone (a test or benchmark killed mid-run)."""
    out = run_command("ip", "netns", "list", check=False).stdout
    found = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"^(p2p[a-z]([0-9a-f]+))-", out, re.M)}
    return {prefix for prefix, pid in found.items() if not Path(f"/proc/{pid}").exists()}


class EmulatedWAN(Namespaces):
    """``num_hosts`` namespaces ``<prefix>-h<i>`` with address 10.88.0.<i+1>, links shaped to ``rate_mbit``. With the
    default prefix (``p2pw``) one at a time on a machine: it removes any ``p2pw-`` namespace a killed run left behind;
    with a :func:`run_prefix` of its own it runs beside others (the addresses live inside its own namespaces)."""

    def __init__(self, num_hosts: int, rate_mbit: float | None, prefix: str = PREFIX):
        super().__init__()
        self.num_hosts, self.rate_mbit, self.prefix = num_hosts, rate_mbit, prefix
        self.core = f"{prefix}-core"

    def host(self, index: int) -> str:
        return f"{self.prefix}-h{index}"

    def ip(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def __enter__(self) -> EmulatedWAN:
        cleanup(self.prefix)
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.add_namespace(self.core, bridge="br0")
        for i in range(self.num_hosts):
            self.add_namespace(self.host(i))
            self.link(self.host(i), self.interface(i), self.core, self.bridge_port(i), address=f"{self.ip(i)}/24")
        self.set_rate(self.rate_mbit)
        return self

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape every host's link to ``rate_mbit`` in both directions (None: unshaped)."""
        self.rate_mbit = rate_mbit
        for i in range(self.num_hosts):
            for ns, dev in ((self.host(i), self.interface(i)), (self.core, self.bridge_port(i))):
                run_command("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                if rate_mbit is not None:
                    # burst: 10 ms at the rate (at least 32 KB); queue: 1 s of traffic before drops
                    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
                    run_command("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "1000ms")

    def interface(self, index: int) -> str:
        return f"{self.prefix}v{index}"

    def bridge_port(self, index: int) -> str:
        """The bridge-side end of host ``index``'s link (in the core namespace)."""
        return f"{self.prefix}b{index}"

    def popen(self, index: int, command: list[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` inside host ``index``'s namespace (its own process group)."""
        return super().popen(self.host(index), command, **kwargs)

    def _on_signal(self, signum, _frame) -> None:
        self.close()
        sys.exit(128 + signum)

    def close(self) -> None:
        super().close()
        cleanup(self.prefix)


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
        devs = [self.wan.bridge_port(i) for i in self.hosts]
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


def tcp_counters(wan: EmulatedWAN, host: int) -> dict[str, int]:
    """The kernel's TCP counters of host ``host``'s namespace (segments sent, retransmitted, received): what the
    bytes on its link are made of besides the payload (headers, acknowledgements, retransmissions)."""
    out = subprocess.run(["ip", "netns", "exec", wan.host(host), "nstat", "-az", "TcpOutSegs", "TcpRetransSegs",
                          "TcpInSegs", "TcpExtTCPLostRetransmit", "IpExtOutOctets", "IpExtInOctets"],
                         capture_output=True, text=True, check=True).stdout
    return {fields[0]: int(fields[1]) for fields in (line.split() for line in out.splitlines())
            if len(fields) >= 2 and fields[1].isdigit()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces a killed run left behind")
    parser.add_argument("--selftest", type=float, metavar="MBIT", help="shape two hosts and measure the rate")
    parser.add_argument("--bare-averaging", type=float, metavar="MB",
                        help="on two hosts at --rate Mbit/s, stock hivemind averagers average MB of fp32 once: the "
                             "bytes on each link against the MB of parts and replies (the wire's own overhead)")
    parser.add_argument("--rate", type=float, default=10.0, help="link rate for --bare-averaging, Mbit/s")
    parser.add_argument("--nat", action="store_true",
                        help="peers behind a NAT router (benchmarks/nat.py): a public, a client-mode, an auto-relay "
                        "and a port-forwarded peer train together, an unreachable one is refused at start, a "
                        "newcomer behind the NAT joins; one row per peer")
    parser.add_argument("--rounds", type=int, default=16, help="--nat: rounds of the run")
    parser.add_argument("--inner-steps", type=int, default=10, help="--nat: H")
    parser.add_argument("--newcomer-after", type=int, default=1, help="--nat: rounds applied before the newcomer")
    parser.add_argument("--out", type=Path, default=Path("runs/nat"), help="--nat: logs and output folders")
    args = parser.parse_args()
    if args.nat:
        from nat import run_benchmark  # (imported here: nat imports torch, which the other modes do not need)

        run_benchmark(args.out, args.rounds, args.inner_steps, args.newcomer_after)
    if args.bare_averaging:
        with tempfile.TemporaryDirectory() as folder, EmulatedWAN(2, args.rate) as wan:
            before = {host: tcp_counters(wan, host) for host in (0, 1)}
            sent = bare_averaging_bytes(wan, args.bare_averaging, folder)
            tcp = {host: {k: v - before[host].get(k, 0) for k, v in tcp_counters(wan, host).items()} for host in (0, 1)}
        for host, count in sent.items():
            c = tcp[host]
            print(f"host {host}: {count / 1e6:.3f} MB on the wire for {args.bare_averaging:g} MB of parts and "
                  f"replies ({count / (args.bare_averaging * 1e6):.3f}x); IP out {c.get('IpExtOutOctets', 0) / 1e6:.3f}"
                  f" MB, IP in {c.get('IpExtInOctets', 0) / 1e6:.3f} MB; TCP segments out {c.get('TcpOutSegs', 0)}, "
                  f"retransmitted {c.get('TcpRetransSegs', 0)}, in {c.get('TcpInSegs', 0)}")
    if args.cleanup:
        from nat import cleanup_nat

        cleanup(PREFIX)
        cleanup_nat()
        for prefix in orphaned_prefixes():
            cleanup(prefix)
        print("removed the emulated networks' namespaces")
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
