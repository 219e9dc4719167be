"""Crash-safe checkpoints of one stage: safetensors data plus a JSON manifest with its checksum.

A checkpoint ``step-00000120`` (named by the inner step it holds) is two files: ``step-00000120.safetensors``
(every tensor, no pickle) and ``step-00000120.json`` (format, step, sha256 and size of the data file, the
non-tensor state, and a sha256 of the manifest itself). Both
are written to a temporary name, fsynced and renamed; the manifest goes last and is the commit mark,
so a crash at any point leaves the previous checkpoint intact. Loading verifies both checksums, so a
damaged file is refused rather than loaded as a different state, and falls back to the previous
checkpoint, with a warning, when the latest is truncated or corrupt; a failed load deletes nothing. The
last ``keep`` checkpoints are kept. Called by the trainer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from p2p_diloco.faults import fault_point

logger = logging.getLogger(__name__)

FORMAT = "p2p-diloco-checkpoint"
VERSION = 2  # 2: the manifest carries its own sha256
_MANIFEST_NAME = re.compile(r"^step-(\d{8,})\.json$")
_DATA_NAME = re.compile(r"^step-\d{8,}\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(folder: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                    keep: int) -> Path:
    """Write the checkpoint of inner step ``step`` atomically and prune old ones; returns the manifest path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    data_path, manifest_path = folder / f"{name}.safetensors", folder / f"{name}.json"
    tmp_data = folder / f".{name}.safetensors.tmp"
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp_data))
    _fsync_file(tmp_data)
    manifest = {
        "format": FORMAT, "version": VERSION, "step": step, "file": data_path.name,
        "sha256": _sha256(tmp_data), "size": tmp_data.stat().st_size, "meta": meta,
    }
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    os.replace(tmp_data, data_path)
    fault_point("checkpoint-data-written")
    tmp_manifest = folder / f".{name}.json.tmp"
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_manifest, manifest_path)
    _fsync_dir(folder)
    _prune(folder, keep)
    return manifest_path


def _prune(folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; remove what crashed writes left (temporary files, data files whose
    manifest was never written)."""
    manifests = list_checkpoints(folder)
    for manifest_path in manifests[keep:]:
        (folder / manifest_path.with_suffix(".safetensors").name).unlink(missing_ok=True)
        manifest_path.unlink(missing_ok=True)
    kept = {m.with_suffix(".safetensors").name for m in manifests[:keep]}
    for leftover in list(folder.glob(".step-*.tmp")) + list(folder.glob("step-*.safetensors")):
        if leftover.name not in kept:
            leftover.unlink(missing_ok=True)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest without its own digest, in one canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Manifests in ``folder``, newest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("step-*.json") if _MANIFEST_NAME.match(p.name)), reverse=True)


def read_checkpoint(manifest_path: str | Path) -> Checkpoint:
    """Load one checkpoint, verifying format, the manifest's own checksum, and the data file's size and checksum.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    from safetensors.torch import load_file

    manifest_path = Path(manifest_path)
    manifest = _read_manifest(manifest_path)
    data_path = manifest_path.parent / manifest["file"]
    if not data_path.is_file():
        raise CheckpointError(f"checkpoint data {data_path} is missing")
    if data_path.stat().st_size != manifest["size"] or _sha256(data_path) != manifest["sha256"]:
        raise CheckpointError(f"checkpoint data {data_path} is truncated or corrupt (checksum mismatch)")
    try:
        tensors = load_file(str(data_path))
    except Exception as e:  # safetensors raises several types; the checksum matched, so this is unexpected
        raise CheckpointError(f"checkpoint data {data_path} cannot be read: {e}") from None
    return Checkpoint(manifest_path, manifest["step"], tensors, manifest["meta"])


def _read_manifest(manifest_path: Path) -> dict[str, Any]:
    """The manifest, checked: our format and version, its own checksum, and well-typed fields."""
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a {FORMAT} v{VERSION} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{manifest_path} is a {FORMAT} of version {manifest.get('version')!r}; this build "
                              f"reads version {VERSION} (start fresh with --no-resume, or use the older build)")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(f"checkpoint manifest {manifest_path} is corrupt (its checksum does not match)")
    fields = {"step": int, "file": str, "sha256": str, "size": int, "meta": dict}
    wrong = [name for name, kind in fields.items() if type(manifest.get(name)) is not kind]  # noqa: E721 (no bools)
    if wrong or not _DATA_NAME.match(manifest["file"]):
        raise CheckpointError(f"checkpoint manifest {manifest_path} has malformed fields: {', '.join(wrong) or 'file'}")
    return manifest


def load_latest_checkpoint(folder: str | Path, at_most_step: Optional[int] = None) -> Optional[Checkpoint]:
    """The newest checkpoint that loads (of a step <= ``at_most_step`` if given); corrupt ones are skipped with a
    warning. None if there is none."""
    for manifest_path in list_checkpoints(folder):
        if at_most_step is not None and _step_of(manifest_path) > at_most_step:
            continue
        try:
            return read_checkpoint(manifest_path)
        except CheckpointError as e:
            logger.warning(f"{e}; falling back to the previous checkpoint")
    return None


def checkpoint_steps(folder: str | Path) -> list[int]:
    """Steps of the checkpoints in ``folder`` (by name; not verified), newest first."""
    return [_step_of(path) for path in list_checkpoints(folder)]


def _step_of(manifest_path: Path) -> int:
    return int(_MANIFEST_NAME.match(manifest_path.name)[1])
