"""Peak memory and speed of ``p2p-diloco prepare-data`` on a generated JSON Lines input of growing size.

Each size runs ``prepare-data`` (byte tokenizer) in a fresh process and reads that process's own peak RSS
(``os.wait4``), so the sizes do not share a high-water mark. Streaming means the peak is flat: the largest input's
peak stays within a small margin of the smallest's. ``tests/unit/test_data_formats.py`` checks the same with
smaller sizes; this is the full 10 MB vs 200 MB comparison.

    python benchmarks/prepare_memory.py                     # 10 MB and 200 MB of .jsonl
    python benchmarks/prepare_memory.py --sizes-mb 10 200 --gzip --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_WORDS = ("the of and to in is that for it as with was on be by this are or from at an which data peer round "
          "token model swarm average shard training gradient outer inner step loss network bandwidth").split()


def write_jsonl(path: Path, size_bytes: int) -> int:
    """Write JSON Lines records of ~1-3 KB of text each, all distinct, until ``size_bytes`` of JSON (gzipped, fast,
    when the name ends in .gz); return the number of records."""
    templates = [" ".join(_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(150 + (i * 37) % 350))
                 for i in range(97)]
    written = num_records = 0
    with (gzip.open(path, "wb", compresslevel=1) if path.suffix == ".gz" else open(path, "wb")) as f:
        while written < size_bytes:
            lines = []
            for _ in range(500):
                lines.append(json.dumps({"id": num_records, "text": f"{num_records}: {templates[num_records % 97]}"}))
                num_records += 1
            data = ("\n".join(lines) + "\n").encode()
            f.write(data)
            written += len(data)
    return num_records


def run_prepare(inputs: Path, out: Path, extra: list[str] | None = None) -> tuple[int, float, str]:
    """Run ``p2p-diloco prepare-data`` in a child process; return (its peak RSS in bytes, seconds, stdout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "prepare-data", str(inputs), "-o", str(out),
                                    *(extra or [])], stdout=stdout, stderr=stderr, env=env)
        _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage, which Popen.wait would not give
        process.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - started
        stdout.seek(0)
        stderr.seek(0)
        if process.returncode != 0:
            raise RuntimeError(f"prepare-data failed ({process.returncode}): {stderr.read().decode()[-2000:]}")
        return usage.ru_maxrss * 1024, seconds, stdout.read().decode()  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 200])
    parser.add_argument("--gzip", action="store_true", help="compress the inputs (.jsonl.gz)")
    parser.add_argument("--profile", action="store_true", help="also profile the smallest size in-process")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size_mb in args.sizes_mb:
            path = Path(tmp) / f"input_{size_mb}mb.jsonl{'.gz' if args.gzip else ''}"
            num_records = write_jsonl(path, size_mb * 10**6)
            peak, seconds, stdout = run_prepare(path, Path(tmp) / f"shards_{size_mb}")
            summary = json.loads(stdout.splitlines()[-1])
            rows.append({"input_mb": size_mb, "stored_mb": round(path.stat().st_size / 1e6, 1),
                         "records": num_records, "peak_rss_mb": round(peak / 2**20, 1),
                         "seconds": round(seconds, 1), "mb_per_s": round(size_mb / seconds, 1),
                         "tokens": sum(summary["splits"].values())})
            print(json.dumps(rows[-1]), flush=True)
            path.unlink()
        if args.profile:
            profile(Path(tmp), min(args.sizes_mb), args.gzip)
    growth = rows[-1]["peak_rss_mb"] - rows[0]["peak_rss_mb"]
    print(f"peak RSS {rows[0]['peak_rss_mb']} MB at {rows[0]['input_mb']} MB of input, {rows[-1]['peak_rss_mb']} MB "
          f"at {rows[-1]['input_mb']} MB: {growth:+.1f} MB ({growth / rows[0]['peak_rss_mb']:+.1%})")


def profile(tmp: Path, size_mb: int, compressed: bool) -> None:
    """Where the time goes: cProfile of one in-process prepare of ``size_mb``."""
    from p2p_diloco.data import ByteTokenizer, prepare_data

    path = tmp / f"profile.jsonl{'.gz' if compressed else ''}"
    write_jsonl(path, size_mb * 10**6)
    profiler = cProfile.Profile()
    profiler.runcall(prepare_data, [path], tmp / "profile_shards", ByteTokenizer(), progress=False)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
