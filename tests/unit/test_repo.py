"""``Repo.commit``'s compare-and-swap of the head on a memory store: the head never moves backwards.

Two publishers that race for the same version number are covered by the daemons' tests; here a
slow publisher commits a *lower* version after another one moved the head past it.
"""

from __future__ import annotations

import pytest

from weightsync.errors import StoreError, VersionError
from weightsync.format.keys import version_key
from weightsync.format.manifest import Manifest
from weightsync.store import MemoryStore
from weightsync.store.repo import Repo


def _manifest(version: int, parent: int | None) -> Manifest:
    """An empty version (no files): what the head compare-and-swap needs, nothing more."""
    if parent is None:
        return Manifest(version, None, True, 0, (), ())
    return Manifest(version, parent, False, 1, (), ())


class RacingStore(MemoryStore):
    """A memory store that runs ``between`` once, right after the manifest of ``version`` is
    written: another publisher acting while this one moves on to the head."""

    def __init__(self):
        super().__init__()
        self.version, self.between = None, None

    def put(self, key, data, *, mode="overwrite"):
        super().put(key, data, mode=mode)
        if self.version is not None and key == version_key(self.version):
            self.version, between = None, self.between
            between()


@pytest.fixture
def repo() -> Repo:
    r = Repo(RacingStore())
    r.init()
    r.commit(_manifest(0, None), None)
    r.commit(_manifest(2, 0), r.head()[1])
    return r


def test_a_slow_publisher_cannot_move_the_head_back(repo):
    """The slow one read the head at 2 and commits 3; between its manifest and its head write,
    another commits 5 (sparse step numbers): the commit fails with a one-line error naming both
    versions, the head stays at 5, and the lost manifest is removed (readers trust every manifest
    at or below the head)."""
    _, seen = repo.head()  # what the slow publisher read before encoding
    fast = Repo(repo.store)
    repo.store.version, repo.store.between = 3, lambda: fast.commit(_manifest(5, 2), fast.head()[1])
    with pytest.raises(VersionError) as info:
        repo.commit(_manifest(3, 2), seen)
    msg = str(info.value)
    assert "version 3" in msg and "5" in msg and "\n" not in msg, msg
    assert repo.head_version() == 5
    assert Repo(repo.store).head_version() == 5  # as a fresh reader sees it
    assert repo.versions() == [0, 2, 5]
    assert repo.store.head(version_key(3)) is None


@pytest.mark.parametrize("tag", ["current", "stale", "none"])
def test_a_version_below_the_head_is_refused_before_anything_is_written(repo, tag):
    """Whatever head tag the caller holds (even the current one, which a compare-and-swap alone
    would accept), a version below the head is not committed and leaves no manifest."""
    _, seen = repo.head()
    repo.commit(_manifest(5, 2), seen)
    expected = {"current": repo.head()[1], "stale": seen, "none": None}[tag]
    with pytest.raises(VersionError, match="below the head 5"):
        repo.commit(_manifest(3, 2), expected)
    assert repo.head_version() == 5
    assert repo.store.head(version_key(3)) is None


def test_a_newer_version_moves_the_head_past_a_stale_tag(repo):
    """The guard only refuses going back: a newer version with a stale tag still lands."""
    _, seen = repo.head()
    repo.commit(_manifest(3, 2), seen)
    repo.commit(_manifest(4, 3), seen)  # stale tag: the head is 3 now, and 4 is above it
    assert repo.head_version() == 4
    assert repo.versions() == [0, 2, 3, 4]


class FailingStore(MemoryStore):
    """A memory store whose writes of ``key`` fail ``times`` times (a full disk: not retryable, it
    did not land; or ``retryable``: a timeout, which may have)."""

    def __init__(self):
        super().__init__()
        self.key, self.times, self.retryable, self.attempts = None, 0, False, 0

    def _fail(self, key):
        if key == self.key and self.times > 0:
            self.times -= 1
            err = StoreError(f"memory: {key}: No space left on device", key=key)
            err.retryable = self.retryable
            if self.attempts:  # as RetryingStore gives up: no longer retryable, but it may have landed
                err.attempts = self.attempts
            raise err

    def put(self, key, data, *, mode="overwrite"):
        self._fail(key)
        super().put(key, data, mode=mode)

    def put_if_match(self, key, data, etag):
        self._fail(key)
        super().put_if_match(key, data, etag)


@pytest.mark.parametrize("at", ["head", "signature"])
def test_a_commit_whose_head_or_signature_write_failed_outright_leaves_no_manifest(at):
    """The head (or signature) write refused for space: the manifest stayed above the head, every
    later publish of another checkpoint failed ("already exists above its head") until gc's grace
    ran out, and one published past it as the error advised listed the failed version (unsigned,
    refused by trusted readers). It is removed now; after a timeout (the write may have landed) it
    stays, for the same publish to finish."""
    from weightsync.format.keys import HEAD_KEY, signature_key
    from weightsync.store.signing import SigningKey

    r = Repo(FailingStore())
    r.init()
    r.commit(_manifest(0, None), None)
    key = SigningKey.generate() if at == "signature" else None
    r.store.key, r.store.times = (HEAD_KEY if at == "head" else signature_key(1)), 1
    with pytest.raises(StoreError, match="No space"):
        r.commit(_manifest(1, 0), r.head()[1], key)
    assert r.head_version() == 0 and r.store.head(version_key(1)) is None and r.store.head(signature_key(1)) is None
    other = Manifest(1, 0, False, 1, (), (), stats={"changed": 1})  # another checkpoint, same number
    r.commit(other, r.head()[1], key)
    assert r.head_version() == 1 and r.versions() == [0, 1]
    for retryable, attempts in ((True, 0), (False, 5)):  # a timeout; retries given up (a review found it dropped)
        r.store.key, r.store.times, r.store.retryable, r.store.attempts = HEAD_KEY, 1, retryable, attempts
        with pytest.raises(StoreError):
            r.commit(_manifest(2, 1), r.head()[1], key)
        assert r.store.head(version_key(2)) is not None  # kept: the same publish again finishes it
    r.commit(_manifest(2, 1), r.head()[1], key)
    assert r.head_version() == 2
