"""prepare-data streams its inputs: the peak memory of a process preparing 100 MB of gzipped JSON Lines is that of
one preparing 10 MB (benchmarks/prepare_memory.py compares 10 MB with 200 MB, too slow for the suite)."""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path

import pytest

from p2p_diloco.data import ByteTokenizer, ShardDataset, prepare_data

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "prepare_memory.py"
MARGIN_BYTES = 25 * 2**20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("prepare_memory_bench", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def peak_rss_of_prepare(inputs: Path, out: Path) -> int:
    """Prepare ``inputs`` in a forked child (no second interpreter start-up to pay) and return its peak RSS.

    A forked child's peak counts the pages it shares with this process, the same for every size: only the growth
    between two sizes is compared."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            prepare_data([inputs], out, ByteTokenizer(), eval_fraction=0.01, progress=False)
            code = 0
        except BaseException:  # noqa: BLE001 - reported to the parent through the exit code and stderr
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "prepare_data failed in the child (its traceback is above)"
    return usage.ru_maxrss * 1024  # KiB on Linux


@pytest.mark.timeout(240)
def test_peak_memory_does_not_grow_with_the_input(tmp_path: Path, bench) -> None:
    peaks = {}
    for size_mb in (10, 100):
        path = tmp_path / f"input_{size_mb}.jsonl.gz"
        num_records = bench.write_jsonl(path, size_mb * 10**6)
        peaks[size_mb] = peak_rss_of_prepare(path, tmp_path / f"shards_{size_mb}")
        dataset = ShardDataset(tmp_path / f"shards_{size_mb}", "train")
        assert dataset.num_tokens > 0.95 * size_mb * 10**6  # the whole input was read (byte tokens ~ bytes)
        assert num_records > size_mb * 300
        path.unlink()
    assert peaks[100] <= peaks[10] + MARGIN_BYTES, {size: f"{peak / 2**20:.1f} MiB" for size, peak in peaks.items()}
