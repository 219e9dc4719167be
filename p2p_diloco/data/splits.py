"""Which split, train or eval, each document of ``prepare-data`` goes to, and writing it there.

Every machine makes the same split from the same inputs, and eval tokens never appear in train. Two rules:

- **Ranked** (two or more inputs, all plain text files): the files are known before any is read, so the eval split is
  the ``round(eval_fraction * n)`` with the smallest sha256 of their key (at least one, and at least one left for
  train); the pieces of a text file longer than a document go with their file.
- **Hashed** (any JSON Lines, CSV or Parquet input, or a single file): how many records there are is known only at
  the end, so a document goes to eval when the sha256 of its key (``path:line``, row or piece), read as a fraction,
  is below ``eval_fraction``. Nothing is read twice: to keep both splits non-empty, :class:`SplitRouter` holds back
  one document per split (the train one most like eval, the eval one most like train) and moves it across at the
  end if the other split would be empty. A single document in all is split by tokens: its last ``eval_fraction`` is
  held out.

Who calls this: :mod:`p2p_diloco.data.prepare`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from p2p_diloco.data.documents import Document, Record
from p2p_diloco.data.shards import ShardWriter

logger = logging.getLogger(__name__)


def choose_eval_documents(documents: Sequence[Document], eval_fraction: float) -> set[int]:
    """Return the indices of the eval documents: the ~``eval_fraction`` with the smallest hash of their key.

    At least one document is chosen, and at least one is left for train when there are two or more.
    """
    def rank(i: int) -> tuple[bytes, str, int]:
        return hashlib.sha256(documents[i].key.encode("utf-8", "surrogateescape")).digest(), documents[i].key, i

    num_eval = max(1, round(eval_fraction * len(documents)))
    if len(documents) > 1:
        num_eval = min(num_eval, len(documents) - 1)
    return set(sorted(range(len(documents)), key=rank)[:num_eval])


def key_fraction(key: str) -> float:
    """The sha256 of ``key`` read as a number in [0, 1): a document goes to eval when it is below eval_fraction."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()[:8], "big") / 2**64


@dataclass
class _Held:
    fraction: float
    location: str
    tokens: np.ndarray


class SplitRouter:
    """Appends each document's tokens to the train or eval :class:`ShardWriter`; call :meth:`finish` at the end."""

    def __init__(self, writers: dict[str, ShardWriter], eval_fraction: float,
                 eval_documents: set[Document] | None = None) -> None:
        """Args:
            writers: 'train' and 'eval' writers.
            eval_fraction: share of documents for eval (the hashed rule).
            eval_documents: the ranked rule's eval documents; None for the hashed rule.
        """
        self.writers = writers
        self.eval_fraction = eval_fraction
        self.eval_documents = eval_documents
        self.num_documents = {"train": 0, "eval": 0}
        self._held: dict[str, _Held | None] = {"train": None, "eval": None}

    def add(self, record: Record, tokens: np.ndarray) -> None:
        """Route one document (its tokens end with the end-of-document token, if the tokenizer has one)."""
        if self.eval_documents is not None:
            split = "eval" if record.document in self.eval_documents else "train"
            self.num_documents[split] += 1
            self.writers[split].append(tokens)
            return
        fraction = key_fraction(record.key)
        split = "eval" if fraction < self.eval_fraction else "train"
        self.num_documents[split] += 1
        held = self._held[split]
        if held is not None and (fraction >= held.fraction if split == "train" else fraction <= held.fraction):
            self.writers[split].append(tokens)
            return
        self._held[split] = _Held(fraction, record.location, tokens)  # the new one is nearer the other split
        if held is not None:
            self.writers[split].append(held.tokens)

    def finish(self) -> dict[str, int]:
        """Write the held-back documents, moving one across if a split would be empty; return documents per split."""
        held = {split: h for split, h in self._held.items() if h is not None}
        if self.eval_documents is None and sum(self.num_documents.values()) == 1:
            (only,) = held.values()
            self._split_single_document(only)
            return {"train": 1, "eval": 1}
        for split, other in (("train", "eval"), ("eval", "train")):
            if self.num_documents[other] == 0 and split in held:
                logger.info("No document fell in the %s split by hash; moving %s there", other, held[split].location)
                self.num_documents[split] -= 1
                self.num_documents[other] += 1
                held[other] = held.pop(split)
        for split, document in held.items():
            self.writers[split].append(document.tokens)
        self._held = {"train": None, "eval": None}
        return dict(self.num_documents)

    def _split_single_document(self, document: _Held) -> None:
        tokens = document.tokens
        num_eval = max(1, round(self.eval_fraction * len(tokens)))
        logger.info("Only one input document (%s): holding out its last %d tokens for eval", document.location,
                    num_eval)
        self.writers["train"].append(tokens[:-num_eval])
        self.writers["eval"].append(tokens[-num_eval:])
