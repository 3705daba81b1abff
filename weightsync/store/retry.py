"""Retries as a store wrapper: :class:`RetryingStore` implements :class:`Store` around another and
retries the errors marked ``retryable``, with exponential backoff and full jitter; a conflict
after a failed attempt is raised with ``ambiguous = True`` (docs/DESIGN.md)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from weightsync.errors import AlreadyExistsError, PreconditionFailedError, StoreError, UsageError
from weightsync.store.base import Match, ObjectMeta, PutMode, Store
from weightsync.store.inflight import InFlight

T = TypeVar("T")
OnRetry = Callable[..., None]  # (op, key, exc, delay) or (op, key, exc)

# What a retry is counted by (the ``op`` and ``reason`` labels of ``weightsync_store_retries_total``):
# two small fixed sets, never a key or an error message.
RETRY_OPS = ("get", "put", "head", "list", "delete", "copy")  # RetryingStore's op names, lower case
RETRY_REASONS = ("throttled", "server_error", "timeout", "connection", "truncated", "other")


def retry_op(op: str) -> str:
    """``op`` (``GET``, ``PUT``...) as a label value of :data:`RETRY_OPS`, or ``other``."""
    op = op.lower()
    return op if op in RETRY_OPS else "other"


def retry_reason(exc: BaseException) -> str:
    """Why a retryable error happened, one of :data:`RETRY_REASONS`: its ``retry_reason`` attribute
    (set by the S3 backend) when that is one of them, else ``other``."""
    reason = getattr(exc, "retry_reason", None)
    return reason if reason in RETRY_REASONS else "other"


def is_retryable(exc: BaseException) -> bool:
    """Whether a store error says that trying again may help."""
    return isinstance(exc, StoreError) and bool(getattr(exc, "retryable", False))


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry: ``attempts`` counts the first try too.

    The wait before retry ``n`` (1-based) is ``min(max_delay, base_delay * 2**(n-1))``, drawn
    uniformly from ``[0, that]`` with ``jitter="full"`` or taken as is with ``jitter="none"``.
    """

    attempts: int = 5
    base_delay: float = 0.05
    max_delay: float = 5.0
    jitter: Literal["full", "none"] = "full"

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise UsageError(f"retry attempts must be >= 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise UsageError(
                f"retry delays need 0 <= base_delay <= max_delay, got {self.base_delay} and {self.max_delay}"
            )
        if self.jitter not in ("full", "none"):
            raise UsageError(f"retry jitter must be 'full' or 'none', got {self.jitter!r}")

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        cap = min(self.max_delay, self.base_delay * 2.0 ** min(retry - 1, 64))
        return rng.uniform(0.0, cap) if self.jitter == "full" else cap


class RetryingStore(Store):
    """``inner`` with retries of retryable errors; the final error names key and attempts.

    ``on_retry(op, key, exc, delay)`` is called before each wait of ``delay`` seconds (for metrics and
    logs; a callable of three arguments gets no delay). ``inflight`` (:class:`InFlight`) records each
    request, its retries included, while it runs. ``sleep`` and ``rng`` are injectable for tests.
    """

    def __init__(
        self,
        inner: Store,
        policy: RetryPolicy | None = None,
        *,
        on_retry: OnRetry | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        inflight: InFlight | None = None,
    ):
        self.inner = inner
        self.policy = policy or RetryPolicy()
        self.url = inner.url
        self._on_retry = on_retry
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._inflight = inflight
        self._retry_takes_delay = on_retry is not None and _takes_delay(on_retry)

    def call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()`` with this store's retries; ``op`` and ``key`` name it in errors and ``on_retry``."""
        rid = None if self._inflight is None else self._inflight.begin(op, key, self.url)
        try:
            return self._call(op, key, fn)
        finally:
            if rid is not None:
                self._inflight.end(rid)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        attempt = 1
        while True:
            try:
                return fn()
            except (AlreadyExistsError, PreconditionFailedError) as exc:
                if attempt > 1:
                    exc.ambiguous = True  # may be our own earlier attempt; see module docstring
                raise
            except StoreError as exc:
                if not is_retryable(exc):
                    if attempt > 1:
                        exc.attempts = attempt  # an earlier attempt may have landed (Repo.commit keeps its manifest)
                    raise
                if attempt >= self.policy.attempts:
                    raise self._gave_up(op, key, attempt, exc) from exc
                delay = self.policy.delay(attempt, self._rng)
                self._retried(op, key, exc, delay)
                self._sleep(delay)
                attempt += 1

    def _retried(self, op: str, key: str, exc: StoreError, delay: float) -> None:
        if self._on_retry is not None:
            if self._retry_takes_delay:
                self._on_retry(op, key, exc, delay)
            else:
                self._on_retry(op, key, exc)

    def _gave_up(self, op: str, key: str, attempts: int, exc: StoreError) -> StoreError:
        where = f"{self.url}/{key}" if key else self.url  # "s3://b/run/HEAD: GET ...", never "GET HEAD"
        last = str(exc).removeprefix(f"{where}: ").removeprefix(f"{self.url}: ")
        err = StoreError(f"{where}: {op} gave up after {attempts} attempts; last: {last}", key=key)
        err.attempts = attempts
        err.retryable = False  # retrying again at an outer level would multiply the attempts
        return err

    def get(self, key: str) -> bytes:
        return self.call("GET", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.call("GET", key, lambda: self.inner.get_range(key, start, length))

    def get_at_most(self, key: str, limit: int) -> bytes:
        return self.call("GET", key, lambda: self.inner.get_at_most(key, limit))

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        return self.call("PUT", key, lambda: self.inner.put(key, data, mode=mode))

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        return self.call("GET", key, lambda: self.inner.get_with_etag(key))

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        return self.call("GET", key, lambda: self.inner.get_if_changed(key, etag))

    def put_if_match(self, key: str, data: bytes, etag: str | None) -> None:
        return self.call("PUT", key, lambda: self.inner.put_if_match(key, data, etag))

    def head(self, key: str) -> int | None:
        return self.call("HEAD", key, lambda: self.inner.head(key))

    def compare(self, key: str, data: bytes | memoryview) -> Match:
        return self.call("HEAD", key, lambda: self.inner.compare(key, data))

    def list(self, prefix: str = "") -> Iterator[str]:
        # Materialise inside the retry, so that a failure while paging is retried too.
        return iter(self.call("LIST", prefix, lambda: list(self.inner.list(prefix))))

    def list_meta(self, prefix: str = "", *, offset: str | None = None) -> Iterator[ObjectMeta]:
        """The inner listing, lazily; a retryable failure while iterating resumes it after the
        last key given (every key once, in order)."""
        attempt, last = 1, offset
        while True:
            try:
                for meta in self.inner.list_meta(prefix, offset=last):
                    yield meta
                    last, attempt = meta.key, 1
                return
            except StoreError as exc:
                if not is_retryable(exc):
                    raise
                if attempt >= self.policy.attempts:
                    raise self._gave_up("LIST", prefix, attempt, exc) from exc
                delay = self.policy.delay(attempt, self._rng)
                self._retried("LIST", prefix, exc, delay)
                self._sleep(delay)
                attempt += 1

    def head_meta(self, key: str) -> ObjectMeta | None:
        return self.call("HEAD", key, lambda: self.inner.head_meta(key))

    def now(self) -> float:
        return self.call("HEAD", "", self.inner.now)

    def sweep_incomplete(self, older_than: float) -> list[str]:
        """Retried as a whole (a sweep is idempotent; what an attempt that failed removed is not
        in the answer)."""
        return self.call("DELETE", "", lambda: self.inner.sweep_incomplete(older_than))

    def delete(self, key: str) -> None:
        return self.call("DELETE", key, lambda: self.inner.delete(key))

    def touch(self, key: str) -> None:
        return self.call("COPY", key, lambda: self.inner.touch(key))

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"RetryingStore({self.inner!r}, {self.policy})"


def _takes_delay(fn: Callable) -> bool:
    """Whether an ``on_retry`` callback takes the delay as a fourth argument (older ones take three)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 4
