"""Run one benchmark command and keep its output as a record: ``benchmarks/results/<name>/report.txt``.

The report starts with what makes it a record: the commit it ran at (and whether the tree had uncommitted changes),
the exact command, the date, the machine (CPU count, torch and Python versions) and the wall time; then the
command's own output, as it printed it (also shown live). The exit code is the command's.

    python benchmarks/record.py overhead -- python benchmarks/overhead.py --steps 200

Used by ``make bench-quick``; any benchmark can be recorded the same way.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the record's folder under --results")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    folder = args.results / args.name
    folder.mkdir(parents=True, exist_ok=True)
    import torch

    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    header = [f"commit: {git('rev-parse', 'HEAD')}{dirty}",
              f"command: {shlex.join(command)}",
              f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
              f"torch {torch.__version__}"]
    started = time.monotonic()
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    header.append(f"wall time: {time.monotonic() - started:.0f} s, exit code {proc.returncode}")
    (folder / "report.txt").write_text("\n".join(header) + "\n\n" + "".join(lines))
    print(f"recorded in {folder / 'report.txt'}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
