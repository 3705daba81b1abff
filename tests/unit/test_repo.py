"""``Repo.commit``'s compare-and-swap of the head on a memory store: the head never moves backwards.

Two publishers that race for the same version number are covered by the daemons' tests; here a
slow publisher commits a *lower* version after another one moved the head past it.
"""

from __future__ import annotations

import pytest

from weightsync.errors import VersionError
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
