"""Errors raised by weightsync.

Every error derives from :class:`WeightsyncError`; the CLI prints ``str(err)`` as one line and
exits non-zero. Specific errors carry the facts (key, expected and actual checksum) as attributes.
"""

from __future__ import annotations


class WeightsyncError(Exception):
    """Base class of every error weightsync raises on purpose."""

    exit_code = 1


class UsageError(WeightsyncError):
    """Bad arguments or configuration from the user."""

    exit_code = 2


class CheckpointError(WeightsyncError):
    """A checkpoint directory or safetensors file that cannot be read as declared."""


class FormatError(WeightsyncError):
    """A manifest, head pointer, payload or chunk that does not follow docs/FORMAT.md."""


class ChecksumError(WeightsyncError):
    """Bytes whose xxh3 checksum differs from the one recorded in the manifest."""

    def __init__(self, what: str, expected: str, actual: str, message: str | None = None):
        super().__init__(message or f"checksum mismatch for {what}: expected xxh3 {expected}, got {actual}")
        self.what = what
        self.expected = expected
        self.actual = actual


class StoreError(WeightsyncError):
    """A store operation failed; ``key`` names the object, ``__cause__`` is the last cause."""

    retryable = False  # set per instance for throttling, 5xx, timeouts and resets

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class NotFoundError(StoreError):
    """The object does not exist."""


class AlreadyExistsError(StoreError):
    """A create-only put found the object already there."""


class PreconditionFailedError(StoreError):
    """A conditional put lost a race: the object changed since it was read."""


class NotAStoreError(StoreError):
    """The location holds objects but no weightsync store marker."""


class VersionError(WeightsyncError):
    """A version that does not exist, already exists, or is out of order."""


class BaseMismatchError(WeightsyncError):
    """Local bytes used as a delta base differ from the version they claim to be."""


class SignatureError(WeightsyncError):
    """A version a reader that trusts signing keys refuses (docs/FORMAT.md section 7): unsigned,
    signed by no trusted key, a signature that does not verify or is malformed, or one made for
    other bytes or another version. ``version`` names it, ``reason`` says why (one line)."""

    def __init__(self, where: str, version: int, reason: str):
        super().__init__(f"{where}: refused, {reason}")
        self.version = version
        self.reason = reason


class LazyChunksError(WeightsyncError):
    """A read needs chunks that its store notes as not copied yet (``lazy/<N>.json``, docs/FORMAT.md
    section 1: a regional mirror copies a keyframe's full payloads after moving the head, or never)
    and no configured way gets their bytes (a whole older keyframe to rebuild from, or a fallback
    store). ``version`` names the version read, ``chunks`` the noted chunks it would need."""

    def __init__(self, message: str, version: int, chunks: frozenset[str] = frozenset()):
        super().__init__(message)
        self.version = version
        self.chunks = chunks
