"""RetryingStore and RetryPolicy, against a fault-injecting wrapper around a real MemoryStore."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from weightsync.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError, StoreError, UsageError
from weightsync.store import MemoryStore, Store
from weightsync.store.retry import RetryingStore, RetryPolicy, is_retryable

BEFORE = "before"  # a retryable failure before the operation happens (request never arrived)
AFTER = "after"  # the operation happens, then a retryable failure (the response was lost)
FATAL = "fatal"  # a non-retryable failure


class FaultyStore(Store):
    """Delegates to ``inner``; ``fail(op, *faults)`` scripts the next calls of ``op``."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url
        self.calls: Counter[str] = Counter()
        self.raised: list[StoreError] = []
        self._plan: dict[str, list[str]] = {}

    def fail(self, op: str, *faults: str) -> FaultyStore:
        self._plan.setdefault(op, []).extend(faults)
        return self

    def _fault(self, op: str, key: str, fault: str) -> StoreError:
        err = StoreError(f"{self.url}: {op} {key}: injected {fault} #{self.calls[op]}", key=key)
        err.retryable = fault != FATAL
        self.raised.append(err)
        return err

    def _do(self, op: str, key: str, fn):
        self.calls[op] += 1
        plan = self._plan.get(op)
        fault = plan.pop(0) if plan else None
        if fault in (BEFORE, FATAL):
            raise self._fault(op, key, fault)
        result = fn()
        if fault == AFTER:
            raise self._fault(op, key, fault)
        return result

    def get(self, key):
        return self._do("get", key, lambda: self.inner.get(key))

    def get_range(self, key, start, length):
        return self._do("get_range", key, lambda: self.inner.get_range(key, start, length))

    def put(self, key, data, *, mode="overwrite"):
        return self._do("put", key, lambda: self.inner.put(key, data, mode=mode))

    def get_with_etag(self, key):
        return self._do("get_with_etag", key, lambda: self.inner.get_with_etag(key))

    def put_if_match(self, key, data, etag):
        return self._do("put_if_match", key, lambda: self.inner.put_if_match(key, data, etag))

    def head(self, key):
        return self._do("head", key, lambda: self.inner.head(key))

    def list(self, prefix=""):
        return self._do("list", prefix, lambda: self.inner.list(prefix))

    def delete(self, key):
        return self._do("delete", key, lambda: self.inner.delete(key))

    def list_meta(self, prefix="", *, offset=None):
        """Lazy, so that a scripted fault can strike mid-listing: ``fail("list_meta_item", ...)``
        scripts the items (a fault before an item loses it, as a lost page would)."""
        yield from self._do("list_meta", prefix, lambda: iter(()))
        for meta in self.inner.list_meta(prefix, offset=offset):
            yield self._do("list_meta_item", meta.key, lambda meta=meta: meta)

    def head_meta(self, key):
        return self._do("head_meta", key, lambda: self.inner.head_meta(key))

    def now(self):
        return self._do("now", "", self.inner.now)

    def sweep_incomplete(self, older_than):
        return self._do("sweep_incomplete", "", lambda: self.inner.sweep_incomplete(older_than))


class Recorder:
    """Collects sleeps and on_retry calls instead of waiting."""

    def __init__(self):
        self.sleeps: list[float] = []
        self.retries: list[tuple[str, str, StoreError]] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    def on_retry(self, op: str, key: str, exc: StoreError) -> None:
        self.retries.append((op, key, exc))


@pytest.fixture
def faulty():
    store = FaultyStore(MemoryStore("retry-test"))
    store.inner.put("k", b"value")
    return store


@pytest.fixture
def rec():
    return Recorder()


def retrying(faulty, rec, **policy) -> RetryingStore:
    return RetryingStore(faulty, RetryPolicy(**policy), on_retry=rec.on_retry, sleep=rec.sleep, rng=random.Random(1))


def test_transient_failures_are_retried(faulty, rec):
    store = retrying(faulty, rec, attempts=5, base_delay=0.1, max_delay=1.0)
    faulty.fail("get", BEFORE, BEFORE)
    assert store.get("k") == b"value"
    assert faulty.calls["get"] == 3
    assert [(op, key) for op, key, _ in rec.retries] == [("GET", "k"), ("GET", "k")]
    assert [exc for _, _, exc in rec.retries] == faulty.raised
    assert len(rec.sleeps) == 2
    assert 0 <= rec.sleeps[0] <= 0.1 and 0 <= rec.sleeps[1] <= 0.2


@pytest.mark.parametrize(
    "op, call, expected",
    [
        ("get_range", lambda s: s.get_range("k", 1, 3), b"alu"),
        ("get_with_etag", lambda s: s.get_with_etag("k")[0], b"value"),
        ("head", lambda s: s.head("k"), 5),
        ("list", lambda s: list(s.list("")), ["k"]),
        ("put", lambda s: s.put("k2", b"x"), None),
        ("delete", lambda s: s.delete("k"), None),
        ("list_meta", lambda s: [m.key for m in s.list_meta()], ["k"]),
        ("head_meta", lambda s: s.head_meta("k").size, 5),
        ("now", lambda s: type(s.now()), float),
        ("sweep_incomplete", lambda s: s.sweep_incomplete(0.0), []),
    ],
)
def test_every_operation_retries(faulty, rec, op, call, expected):
    store = retrying(faulty, rec)
    faulty.fail(op, BEFORE)
    assert call(store) == expected
    assert faulty.calls[op] == 2 and len(rec.retries) == 1


def test_list_failure_while_paging_is_retried(faulty, rec):
    store = retrying(faulty, rec)
    faulty.fail("list", AFTER)  # the inner call ran, then its results were lost
    assert list(store.list()) == ["k"]


def test_list_meta_failure_mid_listing_resumes_after_the_last_key(faulty, rec):
    for key in ("a", "b", "c", "d"):  # and the fixture's "k"
        faulty.inner.put(key, b"x")
    store = retrying(faulty, rec, attempts=2)
    listing = store.list_meta()
    assert next(listing).key == "a"
    faulty.fail("list_meta_item", None, BEFORE, None, BEFORE)  # b, c lost; resumed: c, d lost; resumed
    assert [m.key for m in listing] == ["b", "c", "d", "k"]  # every key once, in order
    assert len(rec.retries) == 2  # attempts count afresh after each key: 2 attempts were enough
    assert faulty.calls["list_meta"] == 3  # resumed twice (offset: the last key given)


def test_list_meta_gives_up_without_progress(faulty, rec):
    store = retrying(faulty, rec, attempts=3)
    faulty.fail("list_meta", BEFORE, BEFORE, BEFORE)
    with pytest.raises(StoreError, match="^memory://retry-test: LIST gave up after 3 attempts") as info:
        list(store.list_meta())
    assert not is_retryable(info.value) and len(rec.retries) == 2


@pytest.mark.parametrize(
    "make",
    [lambda f: f.fail("get", FATAL), lambda f: f.inner.delete("k")],
    ids=["fatal", "missing"],
)
def test_non_retryable_errors_pass_through_at_once(faulty, rec, make):
    make(faulty)
    with pytest.raises(StoreError) as info:
        retrying(faulty, rec).get("k")
    assert not is_retryable(info.value)
    assert faulty.calls["get"] == 1 and rec.sleeps == [] and rec.retries == []
    if isinstance(info.value, NotFoundError):
        assert info.value.key == "k"
    else:
        assert info.value is faulty.raised[0]


def test_final_error_names_key_attempts_and_cause(faulty, rec):
    store = retrying(faulty, rec, attempts=3)
    faulty.fail("get", BEFORE, BEFORE, BEFORE, BEFORE)
    with pytest.raises(StoreError) as info:
        store.get("k")
    err = info.value
    assert type(err) is StoreError
    assert err.key == "k" and err.attempts == 3 and not is_retryable(err)
    assert err.__cause__ is faulty.raised[-1]
    assert str(err) == "memory://retry-test/k: GET gave up after 3 attempts; last: get k: injected before #3"
    assert "\n" not in str(err)
    assert faulty.calls["get"] == 3 and len(rec.sleeps) == 2 and len(rec.retries) == 2


def test_single_attempt_policy_never_sleeps(faulty, rec):
    faulty.fail("head", BEFORE)
    with pytest.raises(StoreError, match="gave up after 1 attempts"):
        retrying(faulty, rec, attempts=1).head("k")
    assert rec.sleeps == []


def test_lost_create_response_surfaces_as_ambiguous_conflict(faulty, rec):
    store = retrying(faulty, rec)
    faulty.fail("put", AFTER)  # the create succeeded, but the client saw a timeout
    with pytest.raises(AlreadyExistsError) as info:
        store.put("chunk", b"ours", mode="create")
    assert info.value.ambiguous is True
    assert faulty.inner.get("chunk") == b"ours"


def test_lost_put_if_match_response_surfaces_as_ambiguous_conflict(faulty, rec):
    store = retrying(faulty, rec)
    _, tag = faulty.inner.get_with_etag("k")
    faulty.fail("put_if_match", AFTER)
    with pytest.raises(PreconditionFailedError) as info:
        store.put_if_match("k", b"new head", tag)
    assert info.value.ambiguous is True
    assert faulty.inner.get("k") == b"new head"  # the caller re-reads to learn it was its write


def test_first_attempt_conflict_is_not_ambiguous(faulty, rec):
    with pytest.raises(AlreadyExistsError) as info:
        retrying(faulty, rec).put("k", b"other", mode="create")
    assert getattr(info.value, "ambiguous", False) is False
    assert rec.retries == []


# -- RetryPolicy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"base_delay": -0.1},
        {"base_delay": 2.0, "max_delay": 1.0},
        {"jitter": "decorrelated"},
    ],
)
def test_policy_rejects_bad_values(kwargs):
    with pytest.raises(UsageError):
        RetryPolicy(**kwargs)


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RetryPolicy().attempts = 9  # type: ignore[misc]


def test_backoff_without_jitter_doubles_up_to_the_cap():
    policy = RetryPolicy(base_delay=0.05, max_delay=0.3, jitter="none")
    rng = random.Random(0)
    assert [policy.delay(n, rng) for n in range(1, 6)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert policy.delay(10_000, rng) == 0.3  # no overflow for absurd retry counts


def test_full_jitter_draws_below_the_exponential_cap():
    policy = RetryPolicy(base_delay=0.05, max_delay=5.0)
    rng = random.Random(42)
    for n in range(1, 12):
        cap = min(5.0, 0.05 * 2 ** (n - 1))
        draws = [policy.delay(n, rng) for _ in range(50)]
        assert all(0.0 <= d <= cap for d in draws)
        assert max(draws) > cap / 2  # spread over the interval, not stuck at zero


def test_on_retry_hears_the_delay_actually_slept_and_inflight_sees_the_request(faulty, rec):
    from weightsync.store.inflight import InFlight

    heard, seen = [], []
    inflight = InFlight()

    def sleep(seconds: float) -> None:
        rec.sleep(seconds)
        seen.append([(r.op, r.key, r.store) for r in inflight.older_than(-1)])

    store = RetryingStore(
        faulty,
        RetryPolicy(attempts=4, base_delay=0.1, max_delay=1.0),
        on_retry=lambda op, key, exc, delay: heard.append((op, key, delay)),
        sleep=sleep,
        rng=random.Random(1),
        inflight=inflight,
    )
    faulty.fail("get", BEFORE, BEFORE)
    assert store.get("k") == b"value"
    assert [d for _, _, d in heard] == rec.sleeps and len(heard) == 2 and heard[0][:2] == ("GET", "k")
    assert seen == [[("GET", "k", "memory://retry-test")]] * 2  # one request, its retries included
    assert len(inflight) == 0 and inflight.older_than(-1) == []
