"""The subscriber's stored target (``DIR/.weightsync/target.json``): the version an operator pinned
through the API, or ``latest``, kept across restarts."""

from __future__ import annotations

import json
from pathlib import Path

from weightsync.errors import UsageError
from weightsync.local.state import STATE_DIR, fsync_dir, write_json_atomic
from weightsync.store import same_store

LATEST = "latest"
Target = int | str  # a version, or "latest"


_TARGET_FORMAT = "weightsync.subscriber-target"
_REPAIR = "start with --version N to pin a version, or remove the file to follow the head"


def target_path(target_dir: Path) -> Path:
    """``DIR/.weightsync/target.json``; refuses a ``.weightsync`` that is not a plain directory."""
    d = Path(target_dir) / STATE_DIR
    if d.is_symlink() or (d.exists() and not d.is_dir()):
        raise UsageError(f"{d} is not a directory; refusing to keep the subscriber's target there")
    return d / "target.json"


class ForeignTargetError(UsageError):
    """The stored target was set while the subscriber followed another store."""


def read_target(target_dir: Path, store: str | None = None) -> Target | None:
    """The stored target, None if none. A file that cannot be read or holds no valid target raises
    :class:`UsageError`: it was written on purpose (a pin, a rollback), so following the head instead
    could serve the very weights an operator rolled back from; a subscriber that does not start
    leaves ``current`` as it is. A target stored for another store than ``store`` raises
    :class:`ForeignTargetError` (version numbers of another store mean nothing here)."""
    path = target_path(target_dir)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
        raise UsageError(f"{path}: damaged stored target ({type(exc).__name__}: {exc}); {_REPAIR}") from None
    target = doc.get("target") if isinstance(doc, dict) and doc.get("format") == _TARGET_FORMAT else None
    if (target == LATEST or (type(target) is int and target >= 0)) and isinstance(doc.get("store", ""), str):
        if store is not None and not same_store(doc.get("store", store), store):
            raise ForeignTargetError(f"{path}: target {target} was set for {doc['store']}, not {store}")
        return target
    raise UsageError(f'{path}: damaged stored target (no version or "latest" in it); {_REPAIR}')


def write_target(target_dir: Path, target: Target, fsync: bool = True, store: str | None = None) -> None:
    """Store ``target`` (for ``store``) atomically (temporary file, fsync, rename, fsync of the folder)."""
    path = target_path(target_dir)
    doc = {"format": _TARGET_FORMAT, "target": target} | ({} if store is None else {"store": store})
    write_json_atomic(path, doc, fsync)
    if fsync:
        fsync_dir(path.parent)


def startup_target(pin: Target | None, stored: Target | None) -> tuple[Target, str]:
    """The target to start with and its source: a command-line pin, else the stored target, else the head."""
    if pin is not None:
        return pin, "command line"
    return (stored, "stored") if stored is not None else (LATEST, "default")
