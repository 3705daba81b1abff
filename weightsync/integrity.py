"""Checking that a folder holds a version byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from .errors import ChecksumError, UsageError
from .format import Manifest
from .local import list_files, stray_entries


def _hash_file(path: Path, block: int = 16 << 20) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while buf := f.read(block):
            h.update(buf)
            size += len(buf)
    return size, h.hexdigest()


def verify_folder(folder: str | os.PathLike[str], manifest: Manifest) -> None:
    """Raise unless ``folder`` holds exactly ``manifest``'s files with their checksums."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"not a directory: {root}")
    expected = {f.path for f in manifest.files}
    if missing := sorted(expected - list_files(root)[0]):
        raise ChecksumError(f"{root}: missing files", "present", ", ".join(missing[:5]))
    if extra := stray_entries(root, expected):
        raise ChecksumError(f"{root}: unexpected entries", "absent", ", ".join(extra[:5]))
    for f in manifest.files:
        size, digest = _hash_file(root / f.path)
        if size != f.size:
            raise ChecksumError(f"{root / f.path} (size)", str(f.size), str(size))
        if digest != f.xxh3:
            raise ChecksumError(str(root / f.path), f.xxh3, digest)
