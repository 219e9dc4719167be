"""Tokenizers that turn documents into token ids: a built-in byte-level one and local HF ``tokenizer.json`` files.

Both follow the :class:`Tokenizer` protocol. The byte tokenizer needs nothing but Python and is the default;
the HF tokenizer wraps the ``tokenizers`` package, which is imported only when one is loaded.
Who calls this: :mod:`p2p_diloco.data.prepare` (encoding a corpus) and the CLI (decoding samples).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from p2p_diloco.data.errors import DataError
from p2p_diloco.data.shards import META_FILE, TOKENIZER_FILE

# Special tokens that conventionally end a document, in order of preference.
EOT_TOKEN_NAMES = ("<|endoftext|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    """Recorded in meta.json: 'byte' or 'hf:<file name>'."""
    vocab_size: int
    """Number of token ids; every id is in [0, vocab_size)."""
    eot_id: int | None
    """Id appended after each document, or None when the tokenizer has no end-of-document token."""
    bos_id: int | None
    """Id put before each document (the model's beginning-of-sequence token), or None when the tokenizer has none."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token 256."""

    name = "byte"
    vocab_size = 257
    eot_id: int | None = 256
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as token ids (no end-of-document token)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``; the end-of-document token is dropped, invalid UTF-8 is replaced."""
        return bytes(i for i in ids if i != self.eot_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json`` (no download)."""

    def __init__(self, path: Path) -> None:
        """Load the tokenizer.

        Args:
            path: a ``tokenizer.json`` file as saved by ``tokenizers.Tokenizer.save``.

        Raises:
            DataError: the file is missing or invalid, or the ``tokenizers`` package is not installed.
        """
        path = Path(path).expanduser()
        self.path = path
        self._tokenizer = _load_hf_tokenizer(path)
        self.name = f"hf:{path.name}"
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id: int | None = None
        for token in EOT_TOKEN_NAMES:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eot_id = token_id
                break
        self.bos_id: int | None = _bos_id(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``, without special tokens added by a post-processor."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids`` (special tokens are kept, so document boundaries stay visible)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def _bos_id(tokenizer) -> int | None:
    """The special token the tokenizer's own post-processor puts before a text (Llama's ``<s>``, Llama 3's
    ``<|begin_of_text|>``), which ``transformers`` adds to every input: the model was pretrained with it. None when it
    adds none before the text (GPT-2, Qwen) or has no post-processor."""
    encoding = tokenizer.encode("a", add_special_tokens=True)
    if encoding.special_tokens_mask and encoding.special_tokens_mask[0] == 1:
        return encoding.ids[0]
    return None


def _load_hf_tokenizer(path: Path):
    try:
        import tokenizers  # local import: an optional dependency, only needed for HF tokenizers
    except ImportError as exc:
        raise DataError(
            f"{path}: loading a tokenizer.json needs the 'tokenizers' package; "
            "install it with `pip install 'p2p-diloco[tokenizers]'` or use the byte tokenizer"
        ) from exc
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return tokenizers.Tokenizer.from_file(str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable tokenizer.json ({exc})") from exc
    except Exception as exc:  # the Rust extension raises plain Exception on a malformed tokenizer
        raise DataError(f"{path}: not a valid HF tokenizer.json ({exc})") from exc


def load_tokenizer(spec: str) -> Tokenizer:
    """Return the tokenizer named by ``spec``.

    Args:
        spec: 'byte' for the built-in byte tokenizer, or the path of a ``tokenizer.json`` file
            (or of a folder that holds one).

    Raises:
        DataError: the path does not lead to a usable tokenizer.json.
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    return HFTokenizer(path)


def shards_tokenizer(data_path: str | Path) -> Tokenizer:
    """The tokenizer a shards folder was made with: the byte tokenizer, or the ``tokenizer.json`` that
    ``prepare-data`` copies into the folder.

    Raises:
        DataError: the folder has no readable meta.json, or its HF tokenizer file is not in it (a folder without
            the copy: give the tokenizer explicitly).
    """
    folder = Path(data_path).expanduser()
    try:
        name = json.loads((folder / META_FILE).read_text(encoding="utf-8"))["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{folder}: no readable {META_FILE} naming its tokenizer ({exc})") from None
    if name == "byte":
        return ByteTokenizer()
    if not (folder / TOKENIZER_FILE).is_file():
        raise DataError(f"{folder}: its shards were made with {name!r}, whose {TOKENIZER_FILE} is not in the folder")
    return HFTokenizer(folder / TOKENIZER_FILE)
