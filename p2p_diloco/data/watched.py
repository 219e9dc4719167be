"""Running a reader whose memory this process cannot bound beforehand in a child process with a memory limit.

pyarrow's Parquet reader decompresses a page of whatever size its header declares, and decodes a column in pieces of
its own choosing: a 6 KB file holding one zstd page of 200 MiB, or one whose dictionary repeats a 1 MiB value 200
times, grew the reading process by over 4 GB, whatever the batch size asked for. No option of pyarrow bounds that.
So the reader runs in a forked child whose data segment (``RLIMIT_DATA``: its heap and private writable mappings,
which Linux counts since 4.7) may grow by a budget past what it inherited: an allocation beyond it fails there, before
anything is touched, and the caller gets a :class:`~p2p_diloco.data.errors.DataError` naming the file and the budget.
The child may also fill what this process's allocator holds free at the fork (no more than this process itself
used). It sends its items back one at a time over a pipe, so this process never holds more than one. (An
address-space limit, ``RLIMIT_AS``, failed honest files too: the allocator reserves address space ahead; and a
watchdog polling the child's memory is late on a busy machine, where a decompressor outruns it.)
Who calls this: :func:`p2p_diloco.data.columnar.parquet_records`.
"""

from __future__ import annotations

import multiprocessing
import resource
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from p2p_diloco.data.errors import DataError

T = TypeVar("T")
_ITEM, _ERROR, _MEMORY, _END = "item", "error", "memory", "end"


def watched(items: Callable[[], Iterator[T]], path: Path, budget_bytes: int) -> Iterator[T]:
    """Yield what ``items()`` yields, computed in a forked child whose data segment may grow by ``budget_bytes``.

    Raises:
        DataError: the child ran out of its budget (the message names ``path`` and the budget), raised a DataError
            (its message), failed otherwise (naming ``path``), or died.
    """
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_produce, args=(items, sender, path, budget_bytes), daemon=True)
    child.start()
    sender.close()
    out_of_memory = False
    try:
        while True:
            try:
                kind, payload = receiver.recv()
            except EOFError:  # died without a word
                break
            if kind == _ITEM:
                yield payload
            elif kind == _ERROR:
                raise DataError(payload)
            elif kind == _MEMORY:
                out_of_memory = True
                break
            else:
                return
    finally:
        if child.exitcode is None:  # the caller stopped early, or the child reported its end or an error
            child.kill()
        child.join()
        receiver.close()
    budget = f"{budget_bytes / 2**20:.0f} MiB of memory, the most prepare-data gives its reader"
    if out_of_memory:
        raise DataError(f"{path}: reading it takes more than {budget} (a decompression bomb, or pages far larger "
                        "than any writer makes)")
    raise DataError(f"{path}: its reader died (exit code {child.exitcode}; it may have needed more than {budget})")


def _produce(items: Callable[[], Iterator[T]], sender, path: Path, budget_bytes: int) -> None:
    """The child: limit its data segment, then send every item and the end (or what stopped it)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = _data_bytes() + budget_bytes
        if soft != resource.RLIM_INFINITY:
            limit = min(limit, soft)
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        for item in items():
            sender.send((_ITEM, item))
        sender.send((_END, None))
    except MemoryError:  # pyarrow's ArrowMemoryError too
        sender.send((_MEMORY, None))
    except DataError as exc:
        sender.send((_ERROR, str(exc)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a one-line error naming the file
        sender.send((_ERROR, f"{path}: reading it failed ({type(exc).__name__}: {exc})"))
    finally:
        sender.close()


def _data_bytes() -> int:
    """This process's data segment (``VmData``), as the kernel counts it against ``RLIMIT_DATA``."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmData:")).split()[1]) * 1024
