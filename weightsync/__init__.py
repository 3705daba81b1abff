"""weightsync: cross-region, bit-exact weight delta sync for reinforcement-learning training.

The Python API mirrors the CLI::

    import weightsync
    weightsync.publish("ckpt/step_120", "s3://bucket/run1")   # -> PublishResult
    weightsync.pull("s3://bucket/run1", "/models/run1")        # -> PullResult
    weightsync.versions("s3://bucket/run1")                   # -> [VersionInfo, ...]
    weightsync.verify("s3://bucket/run1", "/models/run1")      # raises unless byte-identical

This module only re-exports (docs/ARCHITECTURE.md maps the layers); the torch and multi-rank
entry points import on first use, so ``import weightsync`` never imports torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

from weightsync._version import __version__ as __version__
from weightsync.codec import CodecConfig
from weightsync.errors import ChecksumError, SignatureError, StoreError, UsageError, VersionError, WeightsyncError
from weightsync.store import Store, open_store
from weightsync.store.repo import Repo, StoreLike, VersionInfo, open_repo, versions
from weightsync.store.retry import RetryingStore, RetryPolicy
from weightsync.store.signing import Keyring, SigningKey, TrustedKey, read_public_keys, read_signing_key, write_key_pair
from weightsync.sync.observer import Observer
from weightsync.sync.publish import PublishConfig, PublishResult, publish
from weightsync.sync.pull import PullConfig, PullResult, pull, verify

if TYPE_CHECKING:  # imported on first use, see __getattr__
    from weightsync.sync.parts import CommitResult, PartResult, commit_parts, publish_part
    from weightsync.torch import ApplyError, CoverageError, DeviceDiffPublisher, TorchSink  # noqa: F401
    from weightsync.torch.state_dict import StateDictPublisher, publish_state_dict

# name -> module of the entry points imported on first use (torch, multi-rank publishing)
_LAZY = {
    "StateDictPublisher": "weightsync.torch.state_dict",
    "publish_state_dict": "weightsync.torch.state_dict",
    "publish_part": "weightsync.sync.parts",
    "commit_parts": "weightsync.sync.parts",
    "PartResult": "weightsync.sync.parts",
    "CommitResult": "weightsync.sync.parts",
    "TorchSink": "weightsync.torch",
    "CoverageError": "weightsync.torch",
    "ApplyError": "weightsync.torch",
    "DeviceDiffPublisher": "weightsync.torch",
}
# module paths that the README documented before the package had layers -> where they live now
_MOVED = {"weightsync.parts": "weightsync.sync.parts", "weightsync.publisher": "weightsync.torch.state_dict"}

__all__ = [
    "ChecksumError",
    "CodecConfig",
    "CommitResult",
    "Keyring",
    "Observer",
    "PartResult",
    "PublishConfig",
    "PublishResult",
    "PullConfig",
    "PullResult",
    "Repo",
    "RetryPolicy",
    "RetryingStore",
    "SignatureError",
    "SigningKey",
    "StateDictPublisher",
    "Store",
    "StoreError",
    "StoreLike",
    "TrustedKey",
    "UsageError",
    "VersionError",
    "VersionInfo",
    "WeightsyncError",
    "commit_parts",
    "open_repo",
    "open_store",
    "publish",
    "publish_part",
    "publish_state_dict",
    "pull",
    "read_public_keys",
    "read_signing_key",
    "verify",
    "versions",
    "write_key_pair",
]


def __getattr__(name: str):
    """The entry points of ``_LAZY``, imported when first asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            raise ImportError(f"weightsync.{name} needs torch: pip install 'weightsync[torch]'", name="torch") from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes each old path of ``_MOVED`` import as the module that replaced it (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass


sys.meta_path.append(_MovedModules())
