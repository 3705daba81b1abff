"""One contract, every backend: memory, file, and S3 on a real SeaweedFS (marked integration).

Every backend must behave the same for the operations weightsync relies on; a backend-specific
quirk belongs in that backend, not in its callers.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from weightsync.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError, StoreError
from weightsync.store import FileStore, MemoryStore, ObjectMeta, open_store
from weightsync.store.retry import RetryingStore, RetryPolicy

MiB = 1 << 20
# S3 parts must be >= 5 MiB; a small threshold makes BIG a 3-part multipart upload.
S3_OPTIONS = {"multipart_threshold": 6 * MiB, "part_size": 5 * MiB, "max_parts_in_flight": 3}
BIG = 11 * MiB + 123

BACKENDS = ["memory", "file", "retry", pytest.param("s3", marks=pytest.mark.integration)]


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    if request.param == "memory":
        backend = MemoryStore("contract")
    elif request.param == "file":
        backend = FileStore(tmp_path / "store", fsync=False)
    elif request.param == "retry":  # wrappers implement the same protocol
        backend = RetryingStore(MemoryStore("contract"), RetryPolicy(attempts=2, base_delay=0.0))
    else:
        backend = open_store(request.getfixturevalue("s3_url"), **S3_OPTIONS)
    with backend:
        yield backend


def pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic binary data with every byte value, cheap to build even for many MiB."""
    block = bytes((i * 131 + seed) % 256 for i in range(65_521))  # prime length: no 2**k period
    return (block * (size // len(block) + 1))[:size]


# -- get / put -------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"\x00", b"hello", bytes(range(256)) * 3, b"\x00" * 1000])
def test_round_trip(store, data):
    store.put("obj", data)
    assert store.get("obj") == data
    assert store.head("obj") == len(data)


def test_put_accepts_memoryview_and_overwrites(store):
    store.put("a/b", memoryview(b"first"))
    store.put("a/b", memoryview(bytearray(b"second!"))[1:])
    assert store.get("a/b") == b"econd!"


def test_missing_key(store):
    with pytest.raises(NotFoundError) as info:
        store.get("nope")
    assert info.value.key == "nope"
    with pytest.raises(NotFoundError):
        store.get_with_etag("nope")
    with pytest.raises(NotFoundError):
        store.get_range("nope", 0, 10)
    assert store.head("nope") is None


@pytest.mark.parametrize(
    "start, length, expected",
    [
        (0, 10, b"0123456789"),
        (0, 100, b"0123456789"),  # longer than the object: truncated
        (3, 4, b"3456"),
        (9, 1, b"9"),
        (9, 5, b"9"),
        (10, 5, b""),  # at the end
        (50, 5, b""),  # past the end
        (4, 0, b""),  # empty range
    ],
)
def test_get_range(store, start, length, expected):
    store.put("r", b"0123456789")
    assert store.get_range("r", start, length) == expected


def test_get_range_of_empty_object(store):
    store.put("empty", b"")
    assert store.get_range("empty", 0, 10) == b""
    assert store.get_range("empty", 0, 0) == b""


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "./a", "a//b", "a/", "a b", "a\\b", "a/./b", "é"])
def test_invalid_keys_rejected(store, key):
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.get(key),
        lambda: store.get_range(key, 0, 1),
        lambda: store.head(key),
        lambda: store.head_meta(key),
        lambda: store.delete(key),
        lambda: store.put_if_match(key, b"x", None),
        lambda: store.get_if_changed(key, None),
        lambda: store.get_if_changed(key, "tag"),
    ):
        with pytest.raises(StoreError) as info:
            call()
        assert not isinstance(info.value, NotFoundError)
    assert list(store.list()) == []


def test_big_object(store):
    data = pattern(BIG, seed=7)
    store.put("big/blob", data)
    assert store.head("big/blob") == BIG
    assert store.get("big/blob") == data
    assert store.get_range("big/blob", 5 * MiB - 3, 10) == data[5 * MiB - 3 : 5 * MiB + 7]
    with pytest.raises(AlreadyExistsError):
        store.put("big/blob", data, mode="create")
    assert list(store.list("big/")) == ["big/blob"]


def test_get_at_most_reads_no_more_than_one_byte_past_its_limit(store):
    data = pattern(10_000, seed=9)
    store.put("c/obj", data)
    assert store.get_at_most("c/obj", 10_000) == data and store.get_at_most("c/obj", 20_000) == data
    assert store.get_at_most("c/obj", 99) == data[:100]  # a chunk key holding a far larger object
    with pytest.raises(NotFoundError):
        store.get_at_most("c/missing", 10)


def test_compare_tells_other_bytes_of_the_same_size(store):
    """What a publish asks of a chunk already stored (``Repo.store_chunk``), in one request: absent,
    other bytes (another size, or the same size: damaged or planted), the same, or only the same size
    (S3 tells by the ETag of one PUT; a multipart object's is no MD5)."""
    data = pattern(4096, seed=3)
    store.put("c/one", data)
    assert store.compare("c/one", data) == "same" and store.compare("c/one", memoryview(data)) == "same"
    assert store.compare("c/one", pattern(4096, seed=4)) == "other"
    assert store.compare("c/one", data[:-1]) == "other"
    assert store.compare("c/missing", data) == "absent"
    big = pattern(BIG, seed=5)
    store.put("c/big", big)
    assert store.compare("c/big", big) == ("same-size" if "s3" in type(store).__name__.lower() else "same")


# -- create mode and conditional updates ----------------------------------------------------


def test_create_mode(store):
    store.put("c", b"one", mode="create")
    with pytest.raises(AlreadyExistsError) as info:
        store.put("c", b"two", mode="create")
    assert info.value.key == "c"
    assert store.get("c") == b"one"
    store.put("c", b"three", mode="overwrite")
    assert store.get("c") == b"three"


def test_put_if_match(store):
    store.put_if_match("head", b"v1", None)  # None: only if absent
    with pytest.raises(PreconditionFailedError):
        store.put_if_match("head", b"v1-again", None)
    data, tag1 = store.get_with_etag("head")
    assert data == b"v1"
    store.put_if_match("head", b"v2", tag1)
    data, tag2 = store.get_with_etag("head")
    assert data == b"v2" and tag2 != tag1
    with pytest.raises(PreconditionFailedError) as info:
        store.put_if_match("head", b"stale", tag1)
    assert info.value.key == "head"
    assert store.get("head") == b"v2"
    store.delete("head")
    with pytest.raises(PreconditionFailedError):
        store.put_if_match("head", b"gone", tag2)  # a tag cannot resurrect a deleted object
    assert store.head("head") is None


def test_get_if_changed(store):
    store.put("head", b"v1")
    data, tag1 = store.get_with_etag("head")
    assert store.get_if_changed("head", None) == (b"v1", tag1)  # no tag: always read
    assert store.get_if_changed("head", tag1) is None  # unchanged
    assert store.get_if_changed("head", "not-a-tag-it-ever-had") == (b"v1", tag1)
    store.put_if_match("head", b"v2", tag1)
    got = store.get_if_changed("head", tag1)
    assert got is not None and got[0] == b"v2"
    tag2 = got[1]
    assert tag2 != tag1 and store.get_with_etag("head") == (b"v2", tag2)  # the same tags as get_with_etag
    assert store.get_if_changed("head", tag2) is None
    store.put_if_match("head", b"v3", tag2)  # the tag it answered guards conditional writes
    store.put("head", b"v3")  # the same bytes again: unchanged, or read again, never other bytes
    got = store.get_if_changed("head", store.get_with_etag("head")[1])
    assert got is None or got[0] == b"v3"
    store.delete("head")
    for tag in (tag2, None):
        with pytest.raises(NotFoundError) as info:
            store.get_if_changed("head", tag)  # gone: never "unchanged"
        assert info.value.key == "head"


def test_get_if_changed_sees_every_write(store):
    """A poller holding a tag notices each of many writes of small, same-size objects in a row."""
    tag = None
    for i in range(20):
        store.put("head", b'{"version": %02d}' % i)
        got = store.get_if_changed("head", tag)
        assert got is not None and got[0] == b'{"version": %02d}' % i
        tag = got[1]
        assert store.get_if_changed("head", tag) is None


# SeaweedFS queues contending conditional writes on one key behind a lock it retries in ~1 s
# steps, so each extra writer can add a second; a few writers still race for real.
WRITERS = 4


def _race(workers: int, attempt) -> list[int]:
    """Run ``attempt(i)`` in ``workers`` threads released together; indices that succeeded."""
    barrier = threading.Barrier(workers)
    winners: list[int] = []
    failures: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            attempt(i)
            winners.append(i)
        except (AlreadyExistsError, PreconditionFailedError):
            pass
        except BaseException as exc:  # anything else fails the test below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    return winners


def test_concurrent_create_has_one_winner(store):
    for round_ in range(2):
        key = f"race/create-{round_}"
        winners = _race(WRITERS, lambda i, key=key: store.put(key, b"writer-%d" % i, mode="create"))
        assert len(winners) == 1
        assert store.get(key) == b"writer-%d" % winners[0]


def test_concurrent_put_if_match_has_one_winner(store):
    # Payloads differ between rounds: tags may be content hashes, and rewriting the current
    # bytes would legitimately keep the tag valid for the next writer.
    store.put("race/head", b"base")
    for round_ in range(2):
        _, tag = store.get_with_etag("race/head")
        payload = [b"round-%d-writer-%d" % (round_, i) for i in range(WRITERS)]

        def attempt(i, payload=payload, tag=tag):
            store.put_if_match("race/head", payload[i], tag)

        winners = _race(WRITERS, attempt)
        assert len(winners) == 1
        assert store.get("race/head") == payload[winners[0]]


# -- list and delete -------------------------------------------------------------------------


def test_list(store):
    keys = ["a/b/c", "a/bc", "a-b", "a.b", "ab", "B", "chunks/ab/ab12", "chunks/ab/ab13", "z"]
    for key in reversed(keys):
        store.put(key, b"k")
    assert list(store.list()) == sorted(keys)
    assert list(store.list("a")) == ["a-b", "a.b", "a/b/c", "a/bc", "ab"]
    assert list(store.list("a/")) == ["a/b/c", "a/bc"]
    assert list(store.list("a/b")) == ["a/b/c", "a/bc"]
    assert list(store.list("a/b/")) == ["a/b/c"]
    assert list(store.list("chunks/ab/ab1")) == ["chunks/ab/ab12", "chunks/ab/ab13"]
    assert list(store.list("nothing")) == []


def test_list_empty_store(store):
    assert list(store.list()) == []
    assert list(store.list("x/")) == []


def test_touch_keeps_the_object(store):
    store.put("t/x", b"payload")
    store.touch("t/x")
    assert store.get("t/x") == b"payload" and store.head("t/x") == 7
    assert list(store.list("t/")) == ["t/x"]


def test_delete_is_idempotent(store):
    store.put("d/x", b"1")
    store.put("d/y", b"2")
    store.delete("d/x")
    store.delete("d/x")
    store.delete("never/was")
    assert store.head("d/x") is None
    with pytest.raises(NotFoundError):
        store.get("d/x")
    assert list(store.list("d/")) == ["d/y"]


# -- object metadata, the store's clock, incomplete writes (what retention needs) ----------------

# How far apart the store's clock and the timestamps it writes may read: S3 has whole seconds.
CLOCK_SLACK = 5.0


def test_list_meta(store):
    # no empty object here: on SeaweedFS 4.48 a PUT after an empty PUT on one connection times out
    sizes = {"a/b/c": 3, "a/bc": 4, "a-b": 1, "ab": 7, "chunks/ab/ab12": 12, "z": 2}
    for key, size in sizes.items():
        store.put(key, b"x" * size)
    before = store.now()
    metas = list(store.list_meta())  # the store's order: lexicographic but on some S3 servers
    assert all(isinstance(m, ObjectMeta) for m in metas)
    assert sorted((m.key, m.size) for m in metas) == sorted(sizes.items())
    assert sorted(m.key for m in metas) == list(store.list())
    assert sorted(m.key for m in store.list_meta("a/")) == ["a/b/c", "a/bc"]
    assert list(store.list_meta("nothing")) == []
    # offset: what comes after a key the listing gave, in the same order (how a listing resumes)
    keys = [m.key for m in metas]
    for i, key in enumerate(keys):
        assert [m.key for m in store.list_meta(offset=key)] == keys[i + 1 :]
    assert [m.key for m in store.list_meta("a/", offset="a/b/c")] == ["a/bc"]
    # last_modified: by the store's clock, close to now(), or None where the backend keeps no times
    kept = {m.last_modified is None for m in metas}
    assert len(kept) == 1
    if kept == {False}:
        assert all(-CLOCK_SLACK < before - m.last_modified < 60 for m in metas)


def test_list_meta_of_an_empty_store(store):
    assert list(store.list_meta()) == []
    assert list(store.list_meta("x/", offset="x/a")) == []


def test_head_meta(store):
    store.put("h/x", b"12345")
    meta = store.head_meta("h/x")
    assert meta is not None and (meta.key, meta.size) == ("h/x", 5)
    assert meta == next(iter(store.list_meta("h/")))
    assert store.head_meta("h/nope") is None
    store.delete("h/x")
    assert store.head_meta("h/x") is None


def test_now_is_a_clock(store):
    first = store.now()
    assert isinstance(first, float)
    assert abs(first - time.time()) < CLOCK_SLACK  # the test's server runs on this host
    assert store.now() >= first - 1.0  # whole seconds on S3


def test_touch_refreshes_last_modified(store):
    store.put("t/old", b"payload")
    before = store.head_meta("t/old").last_modified
    store.touch("t/old")
    after = store.head_meta("t/old").last_modified
    assert (before is None) == (after is None)
    if after is not None:
        assert after >= before and abs(store.now() - after) < CLOCK_SLACK


def test_sweep_incomplete_never_touches_objects(store):
    for key in ("chunks/ab/ab12", "versions/x", "parts/1/p"):
        store.put(key, b"complete")
    assert store.sweep_incomplete(3600.0) == []
    assert store.sweep_incomplete(0.0) == []
    assert list(store.list()) == ["chunks/ab/ab12", "parts/1/p", "versions/x"]


def test_file_store_sweeps_old_temporary_files(tmp_path):
    store = FileStore(tmp_path / "store", fsync=False)
    store.put("chunks/00/00ab", b"chunk")
    old = time.time() - 7200
    leftovers = {"chunks/00/.tmp-old": old, ".tmp-root": old, "chunks/00/.tmp-young": time.time()}
    for rel, mtime in leftovers.items():
        path = tmp_path / "store" / rel
        path.write_bytes(b"half a chunk")
        os.utime(path, (mtime, mtime))
    assert list(store.list()) == ["chunks/00/00ab"]  # temporary files are not objects
    assert store.sweep_incomplete(3600.0) == [".tmp-root", "chunks/00/.tmp-old"]
    assert not (tmp_path / "store" / "chunks/00/.tmp-old").exists()
    assert (tmp_path / "store" / "chunks/00/.tmp-young").exists()  # maybe a write in flight
    assert store.sweep_incomplete(3600.0) == []
    assert store.sweep_incomplete(0.0) == ["chunks/00/.tmp-young"]
    assert store.get("chunks/00/00ab") == b"chunk"


def test_file_store_delete_removes_the_folders_it_empties(tmp_path):
    root = tmp_path / "store"
    store = FileStore(root, fsync=False)
    store.put("parts/1/a", b"1")
    store.put("parts/1/b", b"2")
    store.put("parts/2/a", b"3")
    store.delete("parts/1/a")
    assert (root / "parts" / "1").is_dir()  # not empty yet
    store.delete("parts/1/b")
    assert not (root / "parts" / "1").exists() and (root / "parts" / "2").is_dir()
    store.delete("parts/2/a")
    assert not (root / "parts").exists() and root.is_dir()  # never the root
    store.put("parts/2/a", b"again")  # the folders come back with the next write
    assert store.get("parts/2/a") == b"again"


def test_file_store_write_survives_a_delete_emptying_its_folder_at_mkdir(tmp_path, monkeypatch):
    """Another process's delete emptied and removed the folder after ``mkdir`` found it there and
    before it looked again (two mirrors writing and clearing ``lazy/`` notes): the write makes the
    folder again."""
    store = FileStore(tmp_path / "store", fsync=False)
    store.put("lazy/00000000000000000001.json", b"old note")
    real_mkdir, raced = os.mkdir, []

    def mkdir(path, *args, **kw):
        try:
            return real_mkdir(path, *args, **kw)
        except FileExistsError:
            if not raced and os.fspath(path).endswith("lazy"):
                raced.append(path)
                store.delete("lazy/00000000000000000001.json")  # removes the emptied folder
            raise

    monkeypatch.setattr(os, "mkdir", mkdir)
    store.put("lazy/00000000000000000002.json", b"note")
    assert raced and store.get("lazy/00000000000000000002.json") == b"note"


def test_pattern_is_binary():
    data = pattern(70_000)
    assert set(data) == set(range(256)) and data != pattern(70_000, seed=1)
