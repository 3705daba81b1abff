"""Checking that a folder holds a version byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from .errors import ChecksumError, UsageError
from .format import Manifest
from .local import STATE_DIR


def _hash_file(path: Path, block: int = 16 << 20) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while buf := f.read(block):
            h.update(buf)
            size += len(buf)
    return size, h.hexdigest()


def list_files(folder: Path) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        rel = os.path.relpath(dirpath, folder)
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d != STATE_DIR]
        for name in filenames:
            found.add(name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}")
    return found


def verify_folder(folder: str | os.PathLike[str], manifest: Manifest) -> None:
    """Raise unless ``folder`` holds exactly ``manifest``'s files with their checksums."""
    root = Path(folder)
    if not root.is_dir():
        raise UsageError(f"not a directory: {root}")
    expected = {f.path for f in manifest.files}
    present = list_files(root)
    if missing := sorted(expected - present):
        raise ChecksumError(f"{root}: missing files", "present", ", ".join(missing[:5]))
    if extra := sorted(present - expected):
        raise ChecksumError(f"{root}: unexpected files", "absent", ", ".join(extra[:5]))
    for f in manifest.files:
        size, digest = _hash_file(root / f.path)
        if size != f.size:
            raise ChecksumError(f"{root / f.path} (size)", str(f.size), str(size))
        if digest != f.xxh3:
            raise ChecksumError(str(root / f.path), f.xxh3, digest)
