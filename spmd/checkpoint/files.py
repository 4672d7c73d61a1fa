"""A checkpoint's files on disk: each written and synced, the directory's manifest (each
file's size and CRC-32), and the check that a directory is a complete checkpoint
(:func:`check_checkpoint`), which :class:`~spmd.checkpoint.CheckpointManager` runs
before it reads one."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch

__all__ = ["CheckpointError", "MANIFEST", "check_checkpoint"]

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory."""


def _crc(path: str) -> tuple[int, int]:
    """(size, CRC-32) of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def check_checkpoint(path: str, verify: bool = True) -> dict:
    """The manifest of the complete checkpoint at ``path``; raises
    :class:`CheckpointError` naming what is wrong where it is partial or corrupt (no
    manifest, a file missing, of another size, or with another CRC-32 when ``verify``).
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: not found")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (a partial write: never "
                              f"completed on every rank)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({e})") from None
    for name, (size, crc) in sorted(files.items()):
        where = os.path.join(path, name)
        if not os.path.isfile(where):
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        found = os.path.getsize(where)
        if found != size:
            raise CheckpointError(f"checkpoint {path}: {name} has {found} bytes, the "
                                  f"manifest says {size}")
        if verify and _crc(where)[1] != crc:
            raise CheckpointError(f"checkpoint {path}: {name} is corrupt (its CRC-32 "
                                  f"differs from the manifest's)")
    return manifest
