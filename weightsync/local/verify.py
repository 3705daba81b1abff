"""Checking that a folder holds a version byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

from weightsync.errors import ChecksumError, UsageError
from weightsync.format.manifest import Manifest
from weightsync.local.install import interrupted, target_hint
from weightsync.local.state import hash_file, list_files, stray_entries


def verify_folder(folder: str | os.PathLike[str], manifest: Manifest) -> None:
    """Raise unless ``folder`` holds exactly ``manifest``'s files with their checksums (read-only)."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"not a directory: {root}")
    if interrupted(root):
        raise UsageError(f"{root}: an install was interrupted and is not finished; pull again to finish it")
    expected = {f.path for f in manifest.files}
    if missing := sorted(expected - list_files(root)[0]):
        names = _some(missing)
        raise ChecksumError(
            f"{root}: missing files",
            "present",
            names,
            f"{root} lacks files of version {manifest.version}: {names}{target_hint(root)}",
        )
    if extra := stray_entries(root, expected):
        names = _some(extra)
        raise ChecksumError(
            f"{root}: unexpected entries",
            "absent",
            names,
            f"{root} holds entries version {manifest.version} lacks: {names}",
        )
    for f in manifest.files:
        size, digest = hash_file(root / f.path)
        if size != f.size:
            raise ChecksumError(
                str(root / f.path),
                str(f.size),
                str(size),
                f"size mismatch for {root / f.path}: expected {f.size} bytes, got {size}",
            )
        if digest != f.xxh3:
            raise ChecksumError(str(root / f.path), f.xxh3, digest)


def _some(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
