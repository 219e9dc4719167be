"""Where the bytes on a peer's link go: inside its averaging windows (its parts and the averages it returns, plus
the protocol's framing) or outside them (DHT traffic: records read and written, state downloads), from the wire
samples and the averaging events that ``benchmarks/streaming.py --wan`` keeps in its ``results.json``.

    python benchmarks/wire_attribution.py benchmarks/results/streaming-wan10/results.json

Per peer and run: the bytes its link carried in all, those inside the union of its averaging windows (from each
averaging's start to its end, as the peer's metrics time them) against the payload its metrics count, and those
outside with their rate. A window's wire bytes include whatever else crossed the link meanwhile, so inside/payload is
an upper bound of the averaging's own overhead.
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path


def attribute(run: dict) -> list[dict]:
    rows = []
    for peer, samples in run["wire"].items():
        times, counts = [s[0] for s in samples], [s[1] for s in samples]

        def at(when: float, times=times, counts=counts) -> int:
            return counts[max(bisect.bisect_right(times, when) - 1, 0)]

        windows: list[list[float]] = []
        for a in sorted(run["peers"][peer]["averagings"], key=lambda a: a["start"]):
            if windows and a["start"] <= windows[-1][1]:
                windows[-1][1] = max(windows[-1][1], a["end"])
            else:
                windows.append([a["start"], a["end"]])
        inside = sum(at(end) - at(start) for start, end in windows)
        inside_s = sum(end - start for start, end in windows)
        total, total_s = counts[-1] - counts[0], times[-1] - times[0]
        payload = run["peers"][peer]["bytes_sent"]
        rows.append({"peer": peer, "wire_bytes": total, "payload_bytes": payload, "inside_bytes": inside,
                     "outside_bytes": total - inside, "inside_s": inside_s, "outside_s": total_s - inside_s,
                     "outside_rate_kB_s": (total - inside) / max(total_s - inside_s, 1e-9) / 1e3})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results.json of benchmarks/streaming.py --wan")
    args = parser.parse_args()
    runs = json.loads(args.results.read_text())
    for run in runs:
        label = "staggered" if run.get("streaming") else "all at once"
        for r in attribute(run):
            mb, payload = (lambda n: f"{n / 1e6:.3f} MB"), r["payload_bytes"]
            print(f"{label:>11} {r['peer']}: wire {mb(r['wire_bytes'])} = {r['wire_bytes'] / payload:.2f}x the "
                  f"payload ({mb(payload)}); inside averaging windows {mb(r['inside_bytes'])} "
                  f"({r['inside_bytes'] / payload:.2f}x the payload, {r['inside_s']:.1f} s); outside "
                  f"{mb(r['outside_bytes'])} in {r['outside_s']:.1f} s ({r['outside_rate_kB_s']:.1f} kB/s)")


if __name__ == "__main__":
    main()
