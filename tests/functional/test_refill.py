"""Refilling a folder in place from another folder's version (``pull(..., base_dir=...)``), the way a
subscriber updates its standby slot: files are overwritten where they are, the base folder is never
written, files shared with it by hard links are replaced instead of written through, and an
interrupted refill leaves a folder that claims no version and is finished by the next one."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

import weightsync
from weightsync.demo import make_trajectory
from weightsync.errors import UsageError, WeightsyncError
from weightsync.format.keys import version_key
from weightsync.format.manifest import manifest_checksum
from weightsync.local.base import clone
from weightsync.local.state import REFILL, read_state, state_dir

PULL = weightsync.PullConfig(fsync=False)


def _functional_conftest():
    """This folder's conftest.py by its path: ``from conftest import`` took the integration tests'
    one when both folders ran in one session (a module named ``conftest`` is whichever came first)."""
    spec = importlib.util.spec_from_file_location("functional_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _functional_conftest()
assert_replica, flip_byte, snapshot = _helpers.assert_replica, _helpers.flip_byte, _helpers.snapshot
tensor_data_offset = _helpers.tensor_data_offset


@pytest.fixture(scope="module")
def traj(tmp_path_factory) -> list[Path]:
    return make_trajectory(
        tmp_path_factory.mktemp("refill") / "traj", steps=3, shards=2, hidden=64, layers=1, experts=2, vocab=256
    )


@pytest.fixture(scope="module")
def store(traj, tmp_path_factory) -> str:
    url = f"file://{tmp_path_factory.mktemp('refill-store') / 'store'}"
    for ckpt in traj:
        weightsync.publish(ckpt, url)
    return url


def inodes(folder: Path) -> dict[str, int]:
    return {
        p.relative_to(folder).as_posix(): p.stat().st_ino
        for p in folder.rglob("*")
        if p.is_file() and STATE not in p.relative_to(folder).parts
    }


STATE = ".weightsync"


def test_refill_overwrites_its_own_files_in_place_and_never_writes_the_base(store, traj, tmp_path):
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 0, config=PULL)
    before_base, before_out = snapshot(base), inodes(out)
    r = weightsync.pull(store, out, 2, config=PULL, base_dir=base)
    assert (r.version, r.from_version, r.written_files) == (
        2,
        1,
        2,
    )  # from the base; the two shards (config files kept)
    assert_replica(out, traj[2])
    assert weightsync.verify(store, out, 2) == 2
    assert inodes(out) == before_out, "files were replaced, not overwritten in place"
    assert snapshot(base) == before_base
    assert read_state(out).version == 2 and not (state_dir(out) / REFILL).exists()
    # only the delta from the base's version was fetched, not the keyframe
    assert r.fetched_bytes <= weightsync.open_repo(store).manifest(2).payload_bytes


def test_refill_replaces_files_shared_with_the_base_by_hard_links(store, traj, tmp_path):
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    clone(base, out)  # what a subscriber's seed leaves: every file linked to the serving slot
    before = snapshot(base)
    weightsync.pull(store, out, 2, config=PULL, base_dir=base)
    assert snapshot(base) == before and weightsync.verify(store, base, 1) == 1
    assert_replica(out, traj[2])
    a, b = inodes(base), inodes(out)
    assert {p for p in a if a[p] == b[p]} == {"config.json", "model.safetensors.index.json"}  # kept, never written


def test_an_interrupted_refill_claims_no_version_and_the_next_one_finishes(store, traj, tmp_path):
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 0, config=PULL)
    before = snapshot(base)

    def stop(done, total):
        raise RuntimeError("killed after the first file")

    with pytest.raises(RuntimeError):
        weightsync.pull(store, out, 3, config=PULL, base_dir=base, progress=stop)
    assert read_state(out) is None and (state_dir(out) / REFILL).exists()
    with pytest.raises(WeightsyncError):
        weightsync.verify(store, out, 0)
    (out / "junk").mkdir()
    (out / "junk" / "x").write_text("left by someone")
    (out / "stray.bin").write_bytes(b"x")
    weightsync.pull(store, out, 3, config=PULL, base_dir=base)
    assert_replica(out, traj[3])  # the entries version 3 lacks are gone
    assert snapshot(base) == before
    assert not (state_dir(out) / REFILL).exists()


def test_a_plain_pull_empties_an_interrupted_refill_first(store, traj, tmp_path):
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 0, config=PULL)
    with pytest.raises(ZeroDivisionError):
        weightsync.pull(store, out, 2, config=PULL, base_dir=base, progress=lambda d, t: 1 / 0)
    weightsync.pull(store, out, 2, config=PULL)
    assert_replica(out, traj[2])
    assert not (state_dir(out) / REFILL).exists()


def test_refill_into_a_new_folder_and_a_marker_left_beside_a_whole_version(store, traj, tmp_path):
    base, out = tmp_path / "a", tmp_path / "new" / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 3, config=PULL, base_dir=base)
    assert_replica(out, traj[3])
    # a kill right after the marker was written, before the state went: the version is intact
    (state_dir(out) / REFILL).write_text("{}")
    assert weightsync.pull(store, out, 3, config=PULL).written_files == 0
    assert not (state_dir(out) / REFILL).exists()
    assert_replica(out, traj[3])


def test_refill_refuses_a_base_without_a_version_or_one_overlapping_the_folder(store, tmp_path, monkeypatch):
    out = tmp_path / "b"
    weightsync.pull(store, out, 1, config=PULL)
    before = snapshot(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no weightsync version"):
        weightsync.pull(store, tmp_path / "c", 2, config=PULL, base_dir=tmp_path / "empty")
    assert not (tmp_path / "c").exists()
    (tmp_path / "alias").symlink_to(out)
    with pytest.raises(UsageError, match="is inside .*, which holds a weightsync version"):
        weightsync.pull(store, out / "inner", 1, config=PULL)  # refused: out's next update would remove it
    weightsync.pull(store, tmp_path / "inner", 1, config=PULL)
    (tmp_path / "inner").rename(out / "inner")  # ... so planted there
    monkeypatch.chdir(tmp_path)
    # the folder itself under other spellings, a folder inside it, a folder it is inside
    for o, b in ((out, out), ("b", out), (out, tmp_path / "alias"), (out, out / "inner"), (out / "inner", out)):
        with pytest.raises(UsageError, match="overlap"):
            weightsync.pull(store, o, 2, config=PULL, base_dir=b)
    assert {k: v for k, v in snapshot(out).items() if not k.startswith("inner")} == before
    assert read_state(out).version == 1


def test_a_copy_clone_shares_no_inode_and_a_stopped_one_claims_no_version(store, traj, tmp_path):
    """``clone(copy=True)``, the subscriber's idle seed: copies of its own (same mtimes, so the state
    still vouches for them), refilled in place without touching the source; stopped between files,
    it leaves no state."""
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    before = snapshot(base)
    clone(base, out, copy=True, fsync=True)
    a, b = inodes(base), inodes(out)
    assert a.keys() == b.keys() and not set(a.values()) & set(b.values())
    assert weightsync.verify(store, out, 1) == 1
    r = weightsync.pull(store, out, 2, config=PULL, base_dir=base)
    assert r.written_files == 2 and inodes(out) == b and snapshot(base) == before
    assert weightsync.pull(store, out, 2, config=PULL).written_files == 0  # the mtimes of the copies hold

    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        clone(base, tmp_path / "c", copy=True, check=check)
    assert read_state(tmp_path / "c") is None and len([p for p in (tmp_path / "c").rglob("*") if p.is_file()]) == 1


def test_a_copy_falls_back_to_reads_and_writes_where_the_kernel_copy_fails(tmp_path, monkeypatch):
    """``copy_file_range`` refused after its first piece (another file system type, an old
    kernel): the rest goes through memory, byte for byte, with the source's mtime."""
    import os

    import weightsync.local.base as local

    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(os.urandom(5 * 1024 + 7))
    real, calls = os.copy_file_range, []

    def refusing(*args):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(18, "Invalid cross-device link")
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", refusing)
    local._copy_file(src, dst, True, None, piece=1024)
    assert dst.read_bytes() == src.read_bytes() and len(calls) == 2
    assert dst.stat().st_mtime_ns == src.stat().st_mtime_ns


def test_a_base_changed_behind_our_back_is_found_after_the_decode_and_the_refill_goes_around_it(store, traj, tmp_path):
    """The base is read unhashed; a wrong one gives a wrong result, which the result's hash catches;
    a second, hashed read then blames the base and the pull starts again without local bytes."""
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 0, config=PULL)
    shard = sorted(base.glob("*.safetensors"))[0]
    flip_byte(shard, tensor_data_offset(shard) + 1)  # a weight of version 1, same size
    before_base = snapshot(base)
    r = weightsync.pull(store, out, 2, config=PULL, base_dir=base)
    assert r.version == 2
    assert_replica(out, traj[2])
    assert snapshot(base) == before_base


def test_a_wrong_result_from_a_right_base_is_reported_as_it_is(traj, tmp_path, monkeypatch):
    """When the result is wrong but the base checks out, the error is the result's (not blamed on the
    base, which would send the pull round it). The wrong result is real: version 2's manifest is
    re-sealed with another checksum for one delta-coded tensor, as a buggy or hostile writer would
    leave it; the base (version 1) and every payload are intact."""
    import weightsync.sync.rebuild as pulling
    from weightsync.errors import ChecksumError

    url = f"file://{tmp_path / 'store'}"
    for ckpt in traj:
        weightsync.publish(ckpt, url)
    key = tmp_path / "store" / version_key(2)
    doc = json.loads(key.read_bytes())
    seg = next(
        s for f in doc["files"] for s in f["segments"] if s["role"] == "tensor" and s["codec"] not in ("same", "full")
    )
    wrong_xxh3 = "0" * 32 if seg["xxh3"] != "0" * 32 else "1" * 32
    seg["xxh3"] = wrong_xxh3
    key.write_bytes(json.dumps({**doc, "checksum": manifest_checksum(doc)}).encode())

    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(url, base, 1, config=PULL)
    weightsync.pull(url, out, 0, config=PULL)
    before_base = snapshot(base)
    real, bases = pulling.rebuild, []

    def watched(dtype, nbytes, xxh3, base, steps, what, in_place=False):  # the real rebuild, watched
        if xxh3 == wrong_xxh3:
            bases.append(base)
        return real(dtype, nbytes, xxh3, base, steps, what, in_place=in_place)

    monkeypatch.setattr(pulling, "rebuild", watched)
    with pytest.raises(ChecksumError) as info:
        weightsync.pull(url, out, 2, config=PULL, base_dir=base)
    assert info.value.expected == wrong_xxh3 and seg["name"] in info.value.what
    assert bases and all(b is not None for b in bases)  # never retried without the base
    assert snapshot(base) == before_base


@pytest.mark.parametrize("changed", ["kept", "written"])
def test_a_file_changed_while_the_folder_is_refilled_is_not_recorded_as_the_version(
    changed, store, traj, tmp_path, monkeypatch
):
    """Keeping its size: a file the refill keeps (config.json) edited while the refill writes the
    others, or a shard rewritten by another writer after the refill wrote it. Neither is recorded as
    version 2 (before, each ended with wrong bytes and no error, and later refills kept them): the
    refill fails, the folder claims no version, and the next refill rebuilds it."""
    import weightsync.sync.pull as pulling
    from weightsync.local.install import TornInstallError

    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 0, config=PULL)
    real, done = pulling._write_one, []

    def write_one(fp, results, root, cfg, in_place):
        times = real(fp, results, root, cfg, in_place)
        if not done:
            flip_byte(out / "config.json" if changed == "kept" else root / fp.entry.path, -2)
            done.append(fp.entry.path)
        return times

    monkeypatch.setattr(pulling, "_write_one", write_one)
    with pytest.raises(TornInstallError, match="changed while version 2 was written"):
        weightsync.pull(store, out, 2, config=PULL, base_dir=base)
    assert done and read_state(out) is None and (state_dir(out) / REFILL).exists()
    monkeypatch.undo()
    weightsync.pull(store, out, 2, config=PULL, base_dir=base)
    assert_replica(out, traj[2])
    assert weightsync.verify(store, out, 2) == 2


@pytest.mark.parametrize("in_place", [False, True])
def test_a_kept_file_whose_ctime_moved_is_hashed_once(in_place, store, traj, tmp_path, monkeypatch):
    """A hard link made to a kept file elsewhere (a backup, ``adopt``) moves its ctime: the pull
    hashes it to keep it, and the install or the refill's end compares against the times it saw
    then instead of hashing it a second time; nor is a file the pull wrote hashed again."""
    import weightsync.local.state as local_state

    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    weightsync.pull(store, out, 1, config=PULL)
    os.link(out / "config.json", tmp_path / "backup.json")
    real, hashed = local_state.hash_file, []
    monkeypatch.setattr(local_state, "hash_file", lambda path, *a: (hashed.append(Path(path).name), real(path, *a))[1])
    r = weightsync.pull(store, out, 2, config=PULL, base_dir=base if in_place else None)
    assert r.kept_files >= 1 and r.written_files >= 1 and hashed == ["config.json"], hashed  # nothing written
    assert_replica(out, traj[2])
    monkeypatch.undo()
    assert weightsync.verify(store, out, 2) == 2


@pytest.mark.parametrize("copy", [True, False])
def test_a_clone_whose_copy_changed_before_its_state_was_written_records_no_version(copy, store, traj, tmp_path):
    """The subscriber's seed: a file already copied (or linked) rewritten with its size kept while
    the others are copied. Before, the clone recorded the times it found at the end, so every later
    refill kept the wrong bytes; now it claims no version (the folder is cleared and seeded again)."""
    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    first, calls = [], []

    def check():
        calls.append(1)
        done = [p for p in out.rglob("*") if p.is_file() and p.stat().st_size and STATE not in p.relative_to(out).parts]
        if done and not first:
            first.append(done[0])
            flip_byte(done[0], -2)

    with pytest.raises(UsageError, match="changed while version 1 was copied"):
        clone(base, out, copy=copy, check=check)
    assert first and read_state(out) is None


def test_adopting_a_published_checkpoint_reads_none_of_its_bytes(store, traj, tmp_path, monkeypatch):
    """A publish's cache links the checkpoint it just published (its reads verify later): the
    install checks the links' times, and hashes nothing (a whole model's read per publish)."""
    import weightsync.local.state as local_state
    from weightsync.local.base import adopt

    real, hashed = local_state.hash_file, []
    monkeypatch.setattr(local_state, "hash_file", lambda path, *a: (hashed.append(Path(path).name), real(path, *a))[1])
    adopt(tmp_path / "cache", weightsync.open_repo(store).manifest(2), traj[2], store)
    assert hashed == [] and read_state(tmp_path / "cache").version == 2
    monkeypatch.undo()
    assert_replica(tmp_path / "cache", traj[2])


def test_a_clone_refuses_a_source_file_written_while_it_was_copied(store, traj, tmp_path, monkeypatch):
    """``clone(copy=True)`` in pieces: the source's largest file is rewritten (same size) once its
    copy has begun. Before, the copy (half old, half new bytes) was recorded as the version."""
    import functools

    import weightsync.local.base as local

    base, out = tmp_path / "a", tmp_path / "b"
    weightsync.pull(store, base, 1, config=PULL)
    monkeypatch.setattr(local, "_copy_file", functools.partial(local._copy_file, piece=1024))
    big = max((p for p in base.iterdir() if p.is_file()), key=lambda p: p.stat().st_size).name
    flipped = []

    def check():
        if (out / big).exists() and not flipped:
            flipped.append(big)
            flip_byte(base / big, -2)

    with pytest.raises(UsageError, match=f"{big} changed while it was copied"):
        clone(base, out, copy=True, check=check)
    assert flipped and read_state(out) is None
