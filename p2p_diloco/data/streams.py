"""Decompressing an input file as a stream: gzip (the standard library) and zstd (``zstandard``).

zstandard's ``stream_reader`` ends silently at a truncated frame, so zstd goes through :class:`ZstdReader`, which
decodes frame after frame and raises :class:`CorruptStream` when the file ends inside one. Neither decompressor
makes more at once than a bounded piece: gzip's reads are bounded by what is asked for, and zstd, whose
decompressor returns all it can make of its input (4 bytes make a block of 128 KiB: 64 KiB of a bomb make 2 GiB),
is fed :data:`_ZSTD_FEED_BYTES` at a time.
Who calls this: :mod:`p2p_diloco.data.readers`.
"""

from __future__ import annotations

import gzip
import io
from typing import BinaryIO

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
_ZSTD_READ_BYTES = 1 << 16  # compressed bytes read from the file at once
_ZSTD_FEED_BYTES = 512  # compressed bytes decompressed at once: at most ~16 MiB out (128 KiB per 4-byte block)


class CorruptStream(OSError):
    """Compressed data that cannot be decompressed (corrupt, or cut short)."""


def open_decompressed(raw: BinaryIO, compression: str | None) -> BinaryIO:
    """Return a buffered binary stream of ``raw``'s decompressed bytes (``raw`` itself when ``compression`` is None).

    Reading it raises ``EOFError``, ``zlib.error`` or ``gzip.BadGzipFile`` (gzip) and :class:`CorruptStream` (zstd)
    on bad data.
    """
    if compression is None:
        return raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        return io.BufferedReader(ZstdReader(raw), buffer_size=_ZSTD_READ_BYTES)
    raise ValueError(f"unknown compression {compression!r}")


class ZstdReader(io.RawIOBase):
    """The decompressed bytes of a zstd stream of one or more frames; a stream cut inside a frame is an error."""

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard  # local import: only zstd inputs need it

        self._zstandard = zstandard
        self._raw = raw
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressobj of the frame being read; a new one per frame
        self._input = memoryview(b"")  # compressed bytes read and not fed yet
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            if not self._input:
                self._input = memoryview(self._raw.read(_ZSTD_READ_BYTES))
                if not self._input:
                    if self._frame is not None and not self._frame.eof:
                        raise CorruptStream("the file ends inside a zstd frame (truncated)")
                    return 0
            piece, self._input = self._input[:_ZSTD_FEED_BYTES], self._input[_ZSTD_FEED_BYTES:]
            self._pending = memoryview(self._decompress(bytes(piece)))
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def _decompress(self, chunk: bytes) -> bytes:
        parts = []
        try:
            while chunk:
                if self._frame is None or self._frame.eof:
                    self._frame = self._decompressor.decompressobj()
                parts.append(self._frame.decompress(chunk))
                chunk = self._frame.unused_data if self._frame.eof else b""
        except self._zstandard.ZstdError as exc:
            raise CorruptStream(str(exc)) from None
        return b"".join(parts)
