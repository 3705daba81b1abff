"""weightsync: cross-region, bit-exact weight delta sync for reinforcement-learning training.

The Python API mirrors the CLI::

    import weightsync
    weightsync.publish("ckpt/step_120", "s3://bucket/run1")   # -> PublishResult
    weightsync.pull("s3://bucket/run1", "/models/run1")        # -> PullResult
    weightsync.versions("s3://bucket/run1")                   # -> [VersionInfo, ...]
    weightsync.verify("s3://bucket/run1", "/models/run1")      # raises unless byte-identical

The other documented entry points are here too, imported on first use: ``publish_state_dict`` and
``StateDictPublisher`` (in-process publishing, :mod:`weightsync.publisher`), ``publish_part`` and
``commit_parts`` (multi-rank, :mod:`weightsync.parts`), and, with torch installed
(``pip install 'weightsync[torch]'``), ``TorchSink`` (:mod:`weightsync.torch`) and
``DeviceDiffPublisher`` (:mod:`weightsync.devicediff`). ``import weightsync`` never imports torch;
the torch ones are left out of ``__all__`` so that ``from weightsync import *`` does not either.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__ as __version__
from .codec import CodecConfig
from .errors import ChecksumError, StoreError, UsageError, VersionError, WeightsyncError
from .publishing import PublishConfig, PublishResult
from .pulling import PullConfig, PullResult
from .repo import Repo
from .store import Store, open_store
from .store.retry import RetryingStore, RetryPolicy

if TYPE_CHECKING:  # imported on first use, see __getattr__
    from .devicediff import DeviceDiffPublisher  # noqa: F401
    from .parts import CommitResult, PartResult, commit_parts, publish_part
    from .publisher import StateDictPublisher, publish_state_dict
    from .torch import ApplyError, CoverageError, TorchSink  # noqa: F401

# name -> module of the entry points imported on first use (torch, the daemons' modules)
_LAZY = {
    "StateDictPublisher": ".publisher", "publish_state_dict": ".publisher",
    "publish_part": ".parts", "commit_parts": ".parts", "PartResult": ".parts", "CommitResult": ".parts",
    "TorchSink": ".torch", "CoverageError": ".torch", "ApplyError": ".torch",
    "DeviceDiffPublisher": ".devicediff",
}
_NEEDS_TORCH = frozenset({".torch", ".devicediff"})

__all__ = [
    "ChecksumError", "CodecConfig", "CommitResult", "PartResult", "PublishConfig", "PublishResult", "PullConfig",
    "PullResult", "Repo", "RetryPolicy", "StateDictPublisher", "Store", "StoreError", "UsageError", "VersionError",
    "VersionInfo", "WeightsyncError", "commit_parts", "open_repo", "open_store", "publish", "publish_part",
    "publish_state_dict", "pull", "verify", "versions",
]

StoreLike = str | os.PathLike | Store | Repo


def open_repo(store: StoreLike, *, retry: RetryPolicy | None = RetryPolicy(), **options) -> Repo:
    """A :class:`Repo` for a URL (``file://``, plain path, ``s3://``, ``memory://``), Store or Repo.

    A remote (``s3://``) store opened from a URL retries throttling, 5xx, timeouts and resets with
    ``retry`` (None: no retries).
    """
    if isinstance(store, Repo):
        return store
    if isinstance(store, Store):
        return Repo(store)
    opened = open_store(store, **options)
    if retry is not None and str(store).startswith("s3://"):
        opened = RetryingStore(opened, retry)
    return Repo(opened)


def publish(checkpoint_dir: str | os.PathLike, store: StoreLike, version: int | None = None, *,
            config: PublishConfig | None = None, base_dir=None, cache_dir=None, progress=None, on_bytes=None) -> PublishResult:
    """Publish a checkpoint directory as a new version (see :func:`weightsync.publishing.publish`)."""
    from .publishing import publish as _publish

    return _publish(checkpoint_dir, open_repo(store), version, config or PublishConfig(), base_dir, cache_dir, progress, on_bytes)


def pull(store: StoreLike, out_dir: str | os.PathLike, version: int | str | None = "latest", *,
         config: PullConfig | None = None, progress=None, on_bytes=None, base_dir=None) -> PullResult:
    """Create or incrementally update ``out_dir`` to hold ``version`` byte for byte; with ``base_dir``,
    refill ``out_dir`` in place from the version ``base_dir`` holds (see :func:`weightsync.pulling.pull`)."""
    from .pulling import pull as _pull

    return _pull(open_repo(store), out_dir, version, config or PullConfig(), progress, on_bytes, base_dir)


@dataclass(frozen=True)
class VersionInfo:
    version: int
    parent: int | None
    keyframe: bool
    raw_bytes: int
    payload_bytes: int
    changed_fraction: float
    created: str


def versions(store: StoreLike) -> list[VersionInfo]:
    repo = open_repo(store)
    repo.require()
    out = []
    for v in repo.versions():
        m = repo.manifest(v)
        frac = m.stats.get("changed", 0) / max(1, m.stats.get("elements", 0) or 1)
        out.append(VersionInfo(v, m.parent, m.keyframe, m.raw_bytes, m.payload_bytes, frac, m.created))
    return out


def verify(store: StoreLike, directory: str | os.PathLike, version: int | str | None = "latest") -> int:
    """Raise unless ``directory`` holds ``version`` byte for byte; returns the version checked.
    Strictly read-only: a folder whose install was interrupted is reported, not finished.
    :class:`ChecksumError`: the folder does not hold the version (``weightsync verify`` exits 1);
    any other error: it could not be checked (exit 3)."""
    from .pulling import resolve_version
    from .integrity import verify_folder

    repo = open_repo(store)
    repo.require()
    v = resolve_version(repo, version)
    verify_folder(Path(directory), repo.manifest(v))
    return v


def __getattr__(name: str):
    """The entry points of ``_LAZY``, imported when first asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module, __name__), name)
    except ModuleNotFoundError as exc:
        if module in _NEEDS_TORCH and exc.name == "torch":
            raise ImportError(f"weightsync.{name} needs torch: pip install 'weightsync[torch]'", name="torch") from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
