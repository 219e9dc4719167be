"""What every emulated network of the benchmarks is made of: network namespaces, veths to a bridge, and processes
inside them, all removed on close (:class:`Namespaces`), and the commands that find and delete namespaces.

Needs root and the ``ip`` command (``netns_available()`` says what is missing). Used by the emulated WAN of
``benchmarks/netns.py`` and the NAT router of ``benchmarks/nat.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def run_command(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``args``, its output captured as text; ``check``: raise if it fails."""
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def netns_available() -> str | None:
    """None if this process may create network namespaces (root, ``ip`` installed), else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs the ip command (apt-get install iproute2)"
    return None


def kill_namespace(namespace: str) -> None:
    """SIGKILL every process of ``namespace``, then delete it (nothing if it does not exist)."""
    for pid in run_command("ip", "netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    run_command("ip", "netns", "del", namespace, check=False)


def existing_namespaces(prefix: str) -> list[str]:
    """The namespaces on this machine named ``<prefix>-...``."""
    out = run_command("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def cleanup(prefix: str) -> None:
    """Remove every namespace named ``<prefix>-...``, its processes killed."""
    for namespace in existing_namespaces(prefix):
        kill_namespace(namespace)


class Namespaces:
    """The network namespaces, links and processes one emulated network is made of: whatever it created, and only
    that, is removed by ``close()`` (processes killed, namespaces deleted; their veths go with them). Links are made
    inside their namespaces, never in this machine's own, so that two networks' interface names never collide."""

    def __init__(self):
        if (reason := netns_available()) is not None:
            raise SystemExit(f"an emulated network {reason}")
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []

    def add_namespace(self, name: str, bridge: str | None = None) -> str:
        """A new namespace with its loopback up (and a bridge ``bridge``, up, if asked)."""
        run_command("ip", "netns", "add", name)
        self.namespaces.append(name)
        run_command("ip", "-n", name, "link", "set", "lo", "up")
        if bridge is not None:
            run_command("ip", "-n", name, "link", "add", bridge, "type", "bridge")
            run_command("ip", "-n", name, "link", "set", bridge, "up")
        return name

    def link(self, namespace: str, device: str, switch: str, port: str, bridge: str = "br0",
             address: str | None = None) -> None:
        """A veth from ``device`` in ``namespace`` (with ``address``, CIDR, if given) to ``port`` of ``bridge`` in
        ``switch``; both ends up."""
        run_command("ip", "link", "add", device, "netns", namespace, "type", "veth", "peer", "name", port, "netns",
                    switch)
        run_command("ip", "-n", switch, "link", "set", port, "master", bridge)
        run_command("ip", "-n", switch, "link", "set", port, "up")
        if address is not None:
            run_command("ip", "-n", namespace, "addr", "add", address, "dev", device)
        run_command("ip", "-n", namespace, "link", "set", device, "up")

    def popen(self, namespace: str, command: list[str], **kwargs) -> subprocess.Popen:
        """Start ``command`` inside ``namespace`` (its own process group)."""
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *command], start_new_session=True, **kwargs)
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

    def close(self) -> None:
        self.stop_processes()
        for namespace in reversed(self.namespaces):
            kill_namespace(namespace)
        self.namespaces.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
