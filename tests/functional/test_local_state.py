"""A target folder's private state (``.weightsync``) as hostile input, and one writer per folder.

What lies under ``.weightsync`` was written by weightsync, but anyone who can write the folder can
plant, truncate or link anything there. Every entry is checked before it is used: a planted or
damaged entry is a one-line error (or, where it is only a cache, dropped), never a path followed
out of the folder, and never a folder that records a version its files do not hold. The whole
temporary tree is compared before and after each refused command. See docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_daemons import Daemon, wait_for

import weightsync
from weightsync.errors import UsageError, WeightsyncError
from weightsync.local.install import TornInstallError
from weightsync.local.lock import FolderBusyError, FolderLock
from weightsync.local.state import read_state
from weightsync.sync.pull import PullConfig

NOFSYNC = PullConfig(fsync=False, decode_threads=2)


@pytest.fixture
def pulled(published, ok_cli, tmp_path):
    """(store URL, checkpoints, a folder holding version 1, a file outside it that must survive)."""
    store, ckpts = published
    url = f"file://{store}"
    out = tmp_path / "out"
    ok_cli("pull", "--store", url, out, "--version", 1)
    victim = tmp_path / "victim.txt"
    victim.write_text("not weightsync's")
    return url, ckpts, out, victim


def _refused(run_cli, ws, tmp_path, args, match: str) -> str:
    """Run a command that must fail with one line matching ``match`` and change nothing at all."""
    before = ws.snapshot(tmp_path)
    rc, _, err = run_cli(*args)
    line = ws.error_line(err)
    assert rc != 0 and match in line, line
    assert ws.snapshot(tmp_path) == before, "a refused command changed the tree"
    return line


JOURNALS = {
    "escape": {"version": 2, "store": "x", "install": [], "remove": ["../victim.txt"], "files": {}},
    "absolute": {"version": 2, "store": "x", "install": [], "remove": ["/etc/hostname"], "files": {}},
    "install-escape": {
        "version": 2,
        "store": "x",
        "install": ["../victim.txt"],
        "remove": [],
        "files": {"../victim.txt": [1, "0" * 32]},
    },
    "installs-what-it-lacks": {"version": 2, "store": "x", "install": ["a"], "remove": [], "files": {}},
    "version-out-of-range": {"version": 10**19, "store": "x", "install": [], "remove": [], "files": {}},
    "garbage": b"garbage",
    "empty-object": {},
    "list": [],
    "truncated": b'{"version": 2, "store": "x", "install": [',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "wrong-types": {"version": "2", "store": "x", "install": "model.safetensors", "remove": [], "files": {}},
}


@pytest.mark.parametrize("name", JOURNALS)
def test_a_planted_or_damaged_journal_is_refused_in_one_line(pulled, run_cli, ws, tmp_path, name):
    url, _, out, victim = pulled
    doc = JOURNALS[name]
    (out / ".weightsync" / "journal.json").write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    _refused(run_cli, ws, tmp_path, ["pull", "--store", url, out, "--version", 2], "journal")
    assert victim.read_text() == "not weightsync's"


def test_a_journal_path_through_a_linked_folder_is_not_followed(pulled, run_cli, ws, tmp_path):
    """A path that is fine as text but leads through a symlink planted in the folder."""
    url, _, out, victim = pulled
    (out / "sub").symlink_to(tmp_path)
    journal = {"version": 2, "store": url, "install": [], "remove": ["sub/victim.txt"], "files": {}}
    (out / ".weightsync" / "journal.json").write_text(json.dumps(journal))
    _refused(run_cli, ws, tmp_path, ["pull", "--store", url, out, "--version", 2], "refusing to go through it")
    assert victim.exists()


STATES = {
    "garbage": b"garbage",
    "list": b"[]",
    "escape": json.dumps({"version": 1, "store": "x", "files": {"../victim.txt": [1, "0" * 32, 0]}}).encode(),
    "deep": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "files-not-an-object": json.dumps({"version": 1, "store": "x", "files": []}).encode(),
}


@pytest.mark.parametrize("name", STATES)
def test_a_planted_or_damaged_state_is_refused_in_one_line(pulled, run_cli, ws, tmp_path, name):
    url, _, out, victim = pulled
    (out / ".weightsync" / "state.json").write_bytes(STATES[name])
    _refused(run_cli, ws, tmp_path, ["pull", "--store", url, out, "--version", 2], "state")
    assert victim.exists()


@pytest.mark.parametrize("entry", ["spool", "staging", "state.json", "journal.json", "lock"])
def test_private_entries_that_are_links_are_never_followed(pulled, run_cli, ws, tmp_path, entry):
    """``.weightsync/<entry>`` as a symlink to a folder (or file) of someone else's: refused before
    anything is written through it or removed from behind it."""
    url, _, out, _ = pulled
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.bin").write_bytes(b"keep me")
    link = out / ".weightsync" / entry
    if link.exists():
        link.unlink()
    link.symlink_to(theirs if entry in ("spool", "staging") else theirs / "keep.bin")
    _refused(run_cli, ws, tmp_path, ["pull", "--store", url, out, "--version", 2], "")
    assert (theirs / "keep.bin").read_bytes() == b"keep me"


def test_the_state_folder_itself_as_a_link_is_refused(pulled, run_cli, ws, tmp_path):
    url, _, out, _ = pulled
    shutil.move(out / ".weightsync", tmp_path / "elsewhere")
    (out / ".weightsync").symlink_to(tmp_path / "elsewhere")
    _refused(run_cli, ws, tmp_path, ["pull", "--store", url, out, "--version", 2], "refusing to use it")


def _planted_spool(published, tmp_path, name: str):
    """A ``memory://`` store (no local files: chunks are spooled) holding versions 0 and 1, a folder
    holding version 0, and a zeroed copy of each chunk of version 1 planted in its spool under the
    chunk's id, with the right size: (store URL, folder, manifest of version 1)."""
    _, ckpts = published
    mem = f"memory://{name}"
    for ckpt in ckpts[:2]:
        weightsync.publish(ckpt, mem)
    out = tmp_path / "out"
    weightsync.pull(mem, out, 0, config=NOFSYNC)
    m = weightsync.open_repo(mem).manifest(1)
    spool = out / ".weightsync" / "spool"
    spool.mkdir()
    for ref in m.chunks:
        (spool / ref.id).write_bytes(b"\x00" * ref.size)
    return mem, out, m


def test_a_wrong_spooled_chunk_of_the_right_size_is_fetched_again(published, tmp_path):
    """Chunks of a store without local files (here ``memory://``) are spooled; one planted (or
    left damaged) under its id with the right size is checked by content, dropped and fetched
    again, so it neither blocks the pull nor blames the store."""
    mem, out, _ = _planted_spool(published, tmp_path, "spool-test")
    r = weightsync.pull(mem, out, 1, config=NOFSYNC)
    assert r.version == 1 and r.fetched_bytes > 0
    assert weightsync.verify(mem, out, 1) == 1
    assert not (out / ".weightsync" / "spool").exists()


def test_a_spool_damaged_after_its_check_is_dropped_and_fetched_once_more(published, tmp_path, monkeypatch):
    """A spooled chunk that goes bad between its check and its use (the disk, a hand in the
    folder): the payload's checksum fails, the spool is dropped and the pull fetches again once."""
    import weightsync.sync.transfer as transfer

    mem, out, m = _planted_spool(published, tmp_path, "spool-retry")
    checked = transfer._spooled
    trusting = lambda path, chunk_id, size: path.exists() and path.stat().st_size == size  # noqa: E731
    calls = []
    monkeypatch.setattr(
        transfer,
        "_spooled",
        lambda *a: calls.append(a) or (trusting(*a) if len(calls) <= len(m.chunks) else checked(*a)),
    )
    assert weightsync.pull(mem, out, 1, config=NOFSYNC).version == 1
    assert weightsync.verify(mem, out, 1) == 1


def test_a_staged_file_gone_before_its_install_fails_and_the_next_pull_rebuilds(pulled, run_cli, ws, tmp_path):
    """A journal whose staged file vanished (another process emptied staging, the old bug): the
    install fails in one line, the folder claims no version, and the next pull rebuilds it whole."""
    url, ckpts, out, _ = pulled
    m = weightsync.open_repo(url).manifest(2)
    changed = [f.path for f in m.files if f.xxh3 != read_state(out).files[f.path][1]]
    assert changed
    journal = {
        "version": 2,
        "store": url,
        "install": changed,
        "remove": [],
        "files": {f.path: [f.size, f.xxh3] for f in m.files},
    }
    (out / ".weightsync" / "journal.json").write_text(json.dumps(journal))
    rc, _, err = run_cli("pull", "--store", url, out, "--version", 2)
    assert rc != 0 and "vanished before its install" in ws.error_line(err)
    assert read_state(out) is None
    with pytest.raises(WeightsyncError):
        weightsync.verify(url, out, 2)  # its bytes are still version 1's
    rc, _, err = run_cli("pull", "--store", url, out, "--version", 2)
    assert rc == 0, err
    assert weightsync.verify(url, out, 2) == 2
    ws.assert_replica(out, ckpts[2])


def test_an_install_killed_after_its_renames_is_finished_by_its_checksums(pulled, tmp_path):
    """The legitimate case of a staged file that is gone: it was renamed into place before a kill.
    Recovery checks the file in place against the journal and finishes the install."""
    url, ckpts, out, _ = pulled
    m = weightsync.open_repo(url).manifest(2)
    tmp = tmp_path / "v2"
    weightsync.pull(url, tmp, 2, config=NOFSYNC)
    for f in m.files:  # the renames ran (each staged file is in place), then the process died
        os.replace(tmp / f.path, out / f.path)
    journal = {
        "version": 2,
        "store": url,
        "install": [f.path for f in m.files],
        "remove": [],
        "files": {f.path: [f.size, f.xxh3] for f in m.files},
    }
    (out / ".weightsync" / "journal.json").write_text(json.dumps(journal))
    assert weightsync.pull(url, out, 2, config=NOFSYNC).version == 2
    assert weightsync.verify(url, out, 2) == 2


def test_recovering_a_journal_whose_file_in_place_is_wrong_marks_the_folder_torn(pulled):
    url, _, out, _ = pulled
    m = weightsync.open_repo(url).manifest(2)
    journal = {
        "version": 2,
        "store": url,
        "install": [f.path for f in m.files],
        "remove": [],
        "files": {f.path: [f.size, f.xxh3] for f in m.files},
    }
    (out / ".weightsync" / "journal.json").write_text(json.dumps(journal))
    from weightsync.local.install import recover

    with pytest.raises(TornInstallError):
        recover(out)
    assert read_state(out) is None and (out / ".weightsync" / "refill.json").exists()


def test_verify_is_read_only(pulled, run_cli, ws, tmp_path):
    """``verify`` finishes nothing and removes nothing: an interrupted install is reported as such
    (and a later pull finishes it), staging and the spool stay as they are."""
    url, _, out, _ = pulled
    (out / ".weightsync" / "staging").mkdir()
    (out / ".weightsync" / "staging" / "half.bin").write_bytes(b"half")
    before = ws.snapshot(tmp_path)
    rc, _, err = run_cli("verify", "--store", url, out, "--version", 1)
    assert rc == 0, err
    assert ws.snapshot(tmp_path) == before
    journal = {"version": 1, "store": url, "install": [], "remove": [], "files": read_state(out).files}
    journal["files"] = {p: [s, h] for p, (s, h, *_) in journal["files"].items()}
    (out / ".weightsync" / "journal.json").write_text(json.dumps(journal))
    _refused(run_cli, ws, tmp_path, ["verify", "--store", url, out, "--version", 1], "interrupted")


def test_a_file_of_another_size_is_named_a_size_mismatch(pulled, run_cli, ws):
    """Two shards swapped: ``verify`` says the sizes differ (it said "expected xxh3 1057168")."""
    url, _, out, _ = pulled
    a, b = sorted(p for p in out.glob("*.safetensors"))
    size_a = a.stat().st_size
    a.write_bytes(b.read_bytes())
    rc, _, err = run_cli("verify", "--store", url, out, "--version", 1)
    line = ws.error_line(err)
    assert rc == 1 and line == (
        f"weightsync: error: size mismatch for {a}: expected {size_a} bytes, got {b.stat().st_size}"
    ), line


def test_a_second_writer_fails_naming_the_holder_and_a_refused_one_leaves_no_trace(published, run_cli, ws, tmp_path):
    store, _ = published
    url = f"file://{store}"
    out = tmp_path / "out"
    with FolderLock(out, "test holder"):
        rc, _, err = run_cli("pull", "--store", url, out, "--version", 1)
        line = ws.error_line(err)
        assert rc == 2 and "in use by test holder (pid" in line and "one writer per folder" in line
        with pytest.raises(FolderBusyError):
            weightsync.pull(url, out, 1, config=NOFSYNC)
        assert read_state(out) is None
    assert not out.exists()  # the claim made the folder, and nothing else happened in it
    weightsync.pull(url, out, 1, config=NOFSYNC)
    assert sorted(p.name for p in (out / ".weightsync").iterdir()) == ["state.json"]  # no lock left behind


def test_a_lock_removed_while_held_never_lets_two_in(tmp_path):
    """Releasing removes the lock file. A claimant that opened the old file just before gets its
    flock once the holder lets go, but sees that the file it locked is no longer the one at the
    path, and locks that one instead (where the next holder already is)."""
    import fcntl

    from weightsync.local.lock import _same_file

    folder = tmp_path / "f"
    a = FolderLock(folder, "a").acquire()
    path = folder / ".weightsync" / "lock"
    fd = os.open(path, os.O_RDWR)  # the racing claimant's open
    a.release()
    b = FolderLock(folder, "b").acquire()
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds: the old inode is nobody's now
    assert not _same_file(fd, path)  # ... which is why FolderLock checks this before it trusts it
    with pytest.raises(FolderBusyError, match="in use by b"):
        FolderLock(folder, "c").acquire()
    os.close(fd)
    b.release()


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_lock_that_is_not_a_file_is_refused(tmp_path, kind):
    folder = tmp_path / "f"
    (folder / ".weightsync").mkdir(parents=True)
    lock = folder / ".weightsync" / "lock"
    lock.mkdir() if kind == "dir" else os.mkfifo(lock)
    with pytest.raises(UsageError):
        FolderLock(folder, "x").acquire()


def _subscriber(url: str, target: Path, tmp_path: Path, *extra) -> Daemon:
    return Daemon("subscriber", ["--store", url, "--target", target, "--no-fsync", *extra], tmp_path).start()


def _serving(published, tmp_path: Path, version: int, *extra) -> tuple[str, Path, Daemon]:
    """A subscriber daemon on ``tmp_path/sub`` serving ``version`` of the published store."""
    store, _ = published
    url, target = f"file://{store}", tmp_path / "sub"
    sub = _subscriber(url, target, tmp_path, "--version", version, *extra)
    try:
        sub.wait_version(version)
    except BaseException:
        sub.stop()
        raise
    return url, target, sub


def test_a_running_subscriber_owns_its_folder(published, run_cli, ws, tmp_path):
    """Pulls into its ``current``, its slots or the folder itself, and a second subscriber, are
    refused naming it; it keeps serving the version it claims, byte for byte."""
    url, target, sub = _serving(published, tmp_path, 2)
    try:
        for where in (target / "current", target / "slots" / "a", target / "slots" / "b", target):
            rc, _, err = run_cli("pull", "--store", url, where, "--version", 4)
            assert rc == 2 and "in use by weightsync subscriber" in ws.error_line(err), (where, err)
        rc, _, err = run_cli("subscriber", "--store", url, "--target", target, "--listen", "127.0.0.1:0")
        last = err.strip().splitlines()[-1]  # after the daemon's start-up log lines
        assert rc == 2 and last.startswith("weightsync: error:") and "in use by weightsync subscriber" in last, err
        assert "Traceback" not in err
        assert sub.status()["current_version"] == 2
        assert weightsync.verify(url, target / "current", 2) == 2
    finally:
        assert sub.stop() == 0


@pytest.mark.parametrize("change", ["rewrite", "rewrite-keeping-mtime", "replace", "add", "add-folder", "remove"])
def test_a_subscriber_notices_its_served_slot_changed_and_swaps_a_fresh_copy_in(published, ws, tmp_path, change):
    _, ckpts = published
    url, target, sub = _serving(published, tmp_path, 3)
    try:
        served = (target / "current").resolve()
        shard = sorted(served.glob("*.safetensors"))[0]
        st = shard.stat()
        if change.startswith("rewrite"):
            ws.flip_byte(shard, -1)
            if change == "rewrite-keeping-mtime":
                os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        elif change == "replace":
            tmp = shard.with_suffix(".tmp")
            shutil.copy2(shard, tmp)
            os.replace(tmp, shard)  # same bytes, same mtime, another inode: someone's hand all the same
        elif change == "add":
            (served / "extra.safetensors").write_bytes(b"\0" * 16)
        elif change == "add-folder":  # unseen before (files only were compared): it blocked that slot's next sync
            (served / "extra").mkdir()
        else:
            shard.unlink()
        wait_for(
            lambda: (target / "current").resolve() != served and sub.status()["state"] == "serving",
            30,
            f"a fresh copy swapped in\n{sub.log()}",
        )
        assert "changed behind weightsync's back" in sub.log()
        assert sub.status()["current_version"] == 3
        assert weightsync.verify(url, target / "current", 3) == 3
        ws.assert_replica(target / "current", ckpts[3])
    finally:
        assert sub.stop() == 0


@pytest.mark.parametrize("removed", ["current", "folder"])
def test_a_subscriber_whose_current_link_or_folder_was_removed_serves_again(published, ws, tmp_path, removed):
    """Without ``current`` nothing is served: the subscriber says so and syncs a fresh copy in,
    instead of reporting the version it served as if it were still there."""
    _, ckpts = published
    url, target, sub = _serving(published, tmp_path, 3)
    try:
        if removed == "current":
            (target / "current").unlink()
        else:
            shutil.rmtree(target)
        wait_for(
            lambda: (
                "the current link is gone" in sub.log()
                and (target / "current").exists()
                and sub.status()["state"] == "serving"
            ),
            30,
            f"a fresh copy swapped in\n{sub.log()}",
        )
        assert sub.status()["current_version"] == 3
        assert weightsync.verify(url, target / "current", 3) == 3
        ws.assert_replica(target / "current", ckpts[3])
    finally:
        assert sub.stop() == 0


def _rewrite_keeping_mtime(path: Path) -> None:
    """Change one byte in place and set the mtime back: only the ctime tells."""
    st = path.stat()
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_file_rewritten_with_its_mtime_set_back_is_not_kept(pulled, ws):
    """A kept file must be untouched since its install: size and mtime are not enough (a tool can
    set the mtime back), the ctime is recorded too, and a file whose ctime moved is hashed."""
    url, ckpts, out, _ = pulled
    _rewrite_keeping_mtime(out / "config.json")
    assert weightsync.pull(url, out, 1, config=NOFSYNC).written_files >= 1  # rebuilt, not trusted
    assert weightsync.verify(url, out, 1) == 1
    _rewrite_keeping_mtime(out / "config.json")
    assert weightsync.pull(url, out, 2, config=NOFSYNC).version == 2
    ws.assert_replica(out, ckpts[2])
    os.link(out / "config.json", out.parent / "backup.json")  # a hard link moves the ctime, not the bytes
    assert weightsync.pull(url, out, 2, config=NOFSYNC).written_files == 0  # hashed, and kept


@pytest.mark.parametrize("where", ["standby", "served-while-stopped"])
def test_a_subscriber_never_serves_a_slot_rewritten_with_its_mtime_set_back(published, ws, tmp_path, where):
    """In the standby slot (refilled in place at the next version, its unchanged files kept), or in
    the served slot while no subscriber ran: the rewrite is seen by its ctime."""
    store, ckpts = published
    url = f"file://{store}"
    target = tmp_path / "sub"
    sub = _subscriber(url, target, tmp_path, "--version", 2, "--standby-hold", "0")
    sub.wait_version(2)
    sub.put_target(3)
    sub.wait_version(3)
    slot = (target / "current").resolve()
    if where == "standby":
        slot = target / "slots" / ("a" if slot.name == "b" else "b")  # holds version 2
    else:
        assert sub.stop() == 0
    _rewrite_keeping_mtime(slot / "config.json")  # config.json is the same in every version
    if where == "standby":
        sub.put_target(4)
        sub.wait_version(4)
    else:
        sub.start()
        wait_for(
            lambda: sub.status()["state"] == "serving" and (target / "current").resolve() != slot,
            30,
            f"a fresh copy swapped in\n{sub.log()}",
        )
    try:
        v = sub.status()["current_version"]
        assert weightsync.verify(url, target / "current", v) == v
    finally:
        assert sub.stop() == 0


def test_a_hard_link_elsewhere_does_not_alarm_the_subscriber(published, tmp_path):
    """A backup's ``cp -al`` of the served slot moves the ctimes of its files, with their link count:
    no change of bytes, no resync."""
    url, target, sub = _serving(published, tmp_path, 1, "--standby-hold", "never")
    try:
        served = (target / "current").resolve()
        shutil.copytree(
            served, tmp_path / "backup", copy_function=os.link, ignore=shutil.ignore_patterns(".weightsync")
        )
        sub.put_target(2)  # polls go on until the next version is served ...
        sub.wait_version(2)
        assert "changed behind" not in sub.log()  # ... and none of them took the link for a change
    finally:
        assert sub.stop() == 0


def test_a_lock_hard_linked_to_a_file_elsewhere_is_refused(pulled, run_cli, ws, tmp_path):
    url, _, out, victim = pulled
    os.link(victim, out / ".weightsync" / "lock")
    _refused(run_cli, ws, tmp_path, ["pull", "--store", url, out, "--version", 2], "hard link")
    assert victim.read_text() == "not weightsync's"


@pytest.mark.parametrize("command", ["verify", "pull"])
def test_a_fifo_where_a_file_should_be_is_an_error_not_a_hang(pulled, run_cli, ws, command):
    url, _, out, _ = pulled
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    rc, _, err = run_cli(command, "--store", url, out, "--version", 2, timeout=60)
    if command == "verify":
        assert rc != 0 and "not a regular file" in ws.error_line(err)
    else:  # the FIFO is no base to read: the pull rebuilds that file and replaces it
        assert rc == 0, err
        assert weightsync.verify(url, out, 2) == 2


def test_a_subscriber_takes_its_lock_again_when_a_slot_is_removed_by_hand(published, run_cli, ws, tmp_path):
    url, target, sub = _serving(published, tmp_path, 1, "--standby-hold", "never")
    try:
        standby = target / "slots" / ("a" if (target / "current").resolve().name == "b" else "b")
        shutil.rmtree(standby)
        wait_for(lambda: (standby / ".weightsync" / "lock").exists(), 20, "the lock taken again")
        rc, _, err = run_cli("pull", "--store", url, standby, "--version", 2)
        assert rc == 2 and "in use by weightsync subscriber" in ws.error_line(err)
    finally:
        assert sub.stop() == 0


PARTIAL_STATES = {
    "escape": lambda doc: {**doc, "files": {"../victim.txt": {"size": 1, "xxh3": "0" * 32, "tensors": {}}}},
    "garbage": lambda doc: "garbage",
    "list": lambda doc: [],
    "version-out-of-range": lambda doc: {**doc, "version": -1},
    "files-not-records": lambda doc: {**doc, "files": {"config.json": 7}},
}


@pytest.mark.parametrize("name", PARTIAL_STATES)
def test_a_planted_or_damaged_partial_state_is_refused(published, ws, tmp_path, name):
    """The partial path (``--include``/``--exclude`` subscribers): ``partial.json`` is checked like
    ``state.json``; nothing outside the folder is touched, nothing in it changes."""
    from weightsync.sync.selection import Selection, materialize

    store, _ = published
    url = f"file://{store}"
    repo = weightsync.open_repo(url)
    out = tmp_path / "part"
    materialize(repo, out, 1, Selection(include=("*embed*",)), config=PullConfig(fsync=False))
    (tmp_path / "victim.txt").write_text("not weightsync's")
    doc = json.loads((out / ".weightsync" / "partial.json").read_text())
    (out / ".weightsync" / "partial.json").write_text(json.dumps(PARTIAL_STATES[name](doc)))
    before = ws.snapshot(tmp_path)
    with pytest.raises(UsageError, match="partial.json"):
        materialize(repo, out, 2, Selection(include=("*embed*",)), config=PullConfig(fsync=False))
    assert ws.snapshot(tmp_path) == before


@pytest.mark.parametrize("plant", ["foreign-file", "spool-link", "state-dir-link"])
def test_the_partial_path_refuses_foreign_folders_and_links(published, ws, tmp_path, plant):
    from weightsync.sync.selection import Selection, materialize

    store, _ = published
    repo = weightsync.open_repo(f"file://{store}")
    out, theirs = tmp_path / "part", tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.bin").write_bytes(b"keep me")
    if plant == "foreign-file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        materialize(repo, out, 1, Selection(include=("*embed*",)), config=PullConfig(fsync=False))
        if plant == "spool-link":
            (out / ".weightsync" / "spool").symlink_to(theirs)
        else:
            shutil.move(out / ".weightsync", tmp_path / "moved")
            (out / ".weightsync").symlink_to(tmp_path / "moved")
    before = ws.snapshot(tmp_path)
    with pytest.raises(UsageError):
        materialize(repo, out, 2, Selection(include=("*embed*",)), config=PullConfig(fsync=False))
    assert ws.snapshot(tmp_path) == before
    assert (theirs / "keep.bin").read_bytes() == b"keep me"


def test_a_partial_file_changed_in_staging_before_its_install_is_not_recorded(published, ws, tmp_path, monkeypatch):
    """The partial path hashes what it writes; a staged file changed afterwards (same size; another
    process in .weightsync) was renamed in and recorded as the version. Now the update fails, the
    folder claims no version, and the next one rebuilds it."""
    import weightsync.sync.selection as selection
    from weightsync.local.install import TornInstallError
    from weightsync.sync.selection import Selection, materialize, verify_partial

    store, _ = published
    repo = weightsync.open_repo(f"file://{store}")
    out, sel, cfg = tmp_path / "part", Selection(include=("*embed*", "*layers.0.*")), PullConfig(fsync=False)
    materialize(repo, out, 1, sel, config=cfg)
    real, staged = selection._write_file, []

    def write_file(dest, *args):
        record = real(dest, *args)
        staged.append(dest)
        if len(staged) == 2:
            ws.flip_byte(staged[0], -2)
        return record

    monkeypatch.setattr(selection, "_write_file", write_file)
    with pytest.raises(TornInstallError, match="changed before its install"):
        materialize(repo, out, 2, sel, config=cfg)
    assert len(staged) >= 2 and selection.read_partial_state(out) is None
    monkeypatch.undo()
    materialize(repo, out, 2, sel, config=cfg)
    assert verify_partial(repo, out, 2) == 2


def test_the_partial_path_removes_a_folder_a_dropped_file_leaves_empty(tmp_path):
    """A version that drops ``sub/x.safetensors``: the partial path removed the file and left ``sub/``,
    which it then took for a foreign entry; a subscriber with ``--exclude`` failed every later sync of
    that slot. The folder goes, as in a full install, and the next versions install."""
    import torch
    from safetensors.torch import save_file

    from weightsync.sync.selection import Selection, materialize, verify_partial

    store = tmp_path / "store"
    for v in range(3):
        ck = tmp_path / f"ck{v}"
        (ck / "sub").mkdir(parents=True)
        save_file({"w": torch.full((64,), float(v)).to(torch.bfloat16)}, str(ck / "m.safetensors"))
        if v == 0:
            save_file({"x": torch.ones(64).to(torch.bfloat16)}, str(ck / "sub" / "x.safetensors"))
        weightsync.publish(ck, store, v)
    repo, out = weightsync.open_repo(f"file://{store}"), tmp_path / "part"
    sel, cfg = Selection(exclude=("unused.*",)), PullConfig(fsync=False)
    materialize(repo, out, 0, sel, config=cfg)
    assert (out / "sub" / "x.safetensors").is_file()
    materialize(repo, out, 1, sel, config=cfg)
    assert not (out / "sub").exists()
    materialize(repo, out, 2, sel, config=cfg)
    assert verify_partial(repo, out, 2) == 2 and sorted(p.name for p in out.iterdir()) == [
        ".weightsync",
        "m.safetensors",
    ]


def _bf16_versions(tmp_path: Path, layouts: list[dict[str, float]]) -> weightsync.Repo:
    """A store whose version v holds one tensor per file of ``layouts[v]`` (relative path -> value)."""
    import torch
    from safetensors.torch import save_file

    store = tmp_path / "store"
    for v, files in enumerate(layouts):
        ck = tmp_path / f"ck{v}"
        for rel, value in files.items():
            (ck / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file({f"t{Path(rel).stem}": torch.full((64,), value).to(torch.bfloat16)}, str(ck / rel))
        weightsync.publish(ck, store, v)
    return weightsync.open_repo(f"file://{store}")


def test_the_partial_path_removes_what_another_selection_put_there(tmp_path, ws):
    """A folder updated with another selection (a subscriber restarted with another ``--include``) kept
    the files only the old one named: the folder claimed the version with a stale file in it (exit 0,
    its verify passed), and every later update refused that file as foreign."""
    from weightsync.sync.selection import Selection, materialize, verify_partial

    repo = _bf16_versions(tmp_path, [{"a.safetensors": v, "b.safetensors": -v} for v in range(3)])
    out, cfg = tmp_path / "part", PullConfig(fsync=False)
    materialize(repo, out, 0, Selection(include=("ta",)), config=cfg)
    materialize(repo, out, 1, Selection(include=("tb",)), config=cfg)
    assert sorted(p.name for p in out.iterdir()) == [".weightsync", "b.safetensors"]
    materialize(repo, out, 2, Selection(include=("tb",)), config=cfg)
    assert verify_partial(repo, out, 2) == 2


def test_the_partial_path_turns_a_file_into_a_folder_and_back(tmp_path):
    """``x`` a file, then a folder holding ``x/y``, then a file again: a full pull does it; the partial
    path installed before it removed, and failed ("is not a directory", then an IsADirectoryError)."""
    from weightsync.sync.selection import Selection, materialize, verify_partial

    layouts = [{"x": 0.0, "m.safetensors": 0.0}, {"x/y.safetensors": 1.0, "m.safetensors": 1.0}]
    repo = _bf16_versions(tmp_path, [*layouts, {"x": 2.0, "m.safetensors": 2.0}])
    out, sel, cfg = tmp_path / "part", Selection(exclude=("unused",)), PullConfig(fsync=False)
    for v in range(3):
        materialize(repo, out, v, sel, config=cfg)
        assert verify_partial(repo, out, v) == v
    assert (out / "x").is_file()


def test_a_publish_cache_that_cannot_take_the_committed_version_is_a_warning_and_emptied(
    published, ws, tmp_path, monkeypatch, caplog
):
    """The publish cache on a full disk (its install fails after the files are staged): the version
    is committed and the publish returns it (it raised after the commit, so callers published it
    again), the cache is emptied with a warning naming it, and the next publish pulls its base there."""
    import errno
    import logging

    import weightsync.local.base as base_module

    _, ckpts = published
    store, cache = tmp_path / "own-store", tmp_path / "cache"
    weightsync.publish(ckpts[0], store, cache_dir=cache)
    real = base_module.install

    def full_disk(folder, *args, **kwargs):
        assert any((folder / ".weightsync" / "staging").iterdir())  # (the copies are staged by now)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(ckpts[1] / "model-00001-of-00002.safetensors"))

    monkeypatch.setattr(base_module, "install", full_disk)
    with caplog.at_level(logging.WARNING, "weightsync.publish"):
        r = weightsync.publish(ckpts[1], store, cache_dir=cache)
    assert r.version == 1 and weightsync.open_repo(store).head_version() == 1
    assert f"version 1 is committed, but the delta-base cache {cache} could not take it (No space left" in caplog.text
    assert read_state(cache) is None and not (cache / ".weightsync" / "staging").exists()
    monkeypatch.setattr(base_module, "install", real)
    r = weightsync.publish(ckpts[2], store, cache_dir=cache)  # its base: version 1, pulled into the cache
    assert r.parent == 1 and read_state(cache).version == 2
    for v in range(3):
        weightsync.pull(store, tmp_path / f"v{v}", v, config=NOFSYNC)
        ws.assert_replica(tmp_path / f"v{v}", ckpts[v])


def test_temporary_files_a_killed_state_write_left_are_removed_by_the_next_pull(pulled, run_cli):
    """A kill between a state or journal write and its rename leaves ``.weightsync/.tmp-*``: the next
    pull removes them (they piled up, one per such kill); a folder of that name is left alone."""
    url, _, out, _ = pulled
    litter = [out / ".weightsync" / f".tmp-{n}" for n in ("abc123", "def456")]
    for p in litter:
        p.write_text('{"format"')
    (out / ".weightsync" / ".tmp-dir").mkdir()
    rc, _, err = run_cli("pull", "--store", url, out, "--version", 2)
    assert rc == 0, err
    assert not any(p.exists() for p in litter) and (out / ".weightsync" / ".tmp-dir").is_dir()
    assert run_cli("verify", "--store", url, out, "--version", 2)[0] == 0


def test_a_write_that_fails_for_space_names_the_folder(pulled, ws):
    """A file size limit (as a full disk or a quota: the error names no file) stops an update with
    one line naming the folder it fills, and the folder keeps version 1."""
    import subprocess
    import sys

    url, ckpts, out, _ = pulled
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192)); "
        "from weightsync.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "pull", "--store", url, str(out), "--version", "3", "--no-progress"],
        capture_output=True,
        text=True,
    )
    line = ws.error_line(r.stderr)
    assert r.returncode == 1 and line == f"weightsync: error: {out}: File too large while writing a version into it"
    assert weightsync.verify(url, out, 1) == 1
    ws.assert_replica(out, ckpts[1])


def test_a_publish_cache_that_is_not_weightsyncs_is_left_as_it_is(published, tmp_path, caplog):
    """A ``cache_dir`` holding someone's files, with a ``base_dir`` (so nothing reads the cache before
    the commit): the version is committed, the folder refused with a warning, and not one file of it
    removed (the commit before emptied it)."""
    import logging

    _, ckpts = published
    store, cache = tmp_path / "own-store", tmp_path / "notes"
    (cache / "sub").mkdir(parents=True)
    (cache / "results.csv").write_text("a,b\n")
    (cache / "sub" / "a.txt").write_text("mine")
    before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    weightsync.publish(ckpts[0], store)
    with caplog.at_level(logging.WARNING, "weightsync.publish"):
        r = weightsync.publish(ckpts[1], store, base_dir=ckpts[0], cache_dir=cache)
    assert r.version == 1 and f"the delta-base cache {cache} was left as it is" in caplog.text
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) == before


def test_a_full_disk_under_a_claim_or_a_state_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """A full disk: the lock's holder name could not be written, which failed every claim (so every
    publish with a cache or state folder there) with a line naming no folder, and left the lock file
    and the folders the claim made; a state write left its temporary file (one per API call on a full
    subscriber). The claim now holds without the name, and the write removes its temporary file.
    A file store's own lock that cannot be made is a store error naming it (the mirror's loop ended
    on the raw OSError)."""
    import errno

    import weightsync.local.lock as lock_module
    import weightsync.local.state as state_module
    from weightsync.errors import StoreError
    from weightsync.local.lock import FolderBusyError, FolderLock
    from weightsync.local.state import write_json_atomic
    from weightsync.store import FileStore

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    folder = tmp_path / "a" / "cache"
    with monkeypatch.context() as m:
        m.setattr(lock_module.os, "pwrite", full)
        with FolderLock(folder, "weightsync publish"):
            with pytest.raises(FolderBusyError, match="in use by another process"):
                FolderLock(folder, "another").acquire()
    assert not (tmp_path / "a").exists()  # the claim made both folders: both gone
    target = tmp_path / "state" / "target.json"
    target.parent.mkdir()
    with monkeypatch.context() as m:
        m.setattr(state_module.json, "dump", full)
        for _ in range(3):
            with pytest.raises(OSError):
                write_json_atomic(target, {"version": 1})
    assert list(target.parent.iterdir()) == []
    write_json_atomic(target, {"version": 1})
    assert json.loads(target.read_text()) == {"version": 1}
    store = FileStore(tmp_path / "store")
    (tmp_path / "store" / ".lock").mkdir(parents=True)  # (a file that cannot be opened, as on a full disk)
    with pytest.raises(StoreError, match=r"store: \.lock: Is a directory"):
        store.put_if_match("HEAD", b"{}", None)


def test_a_subscriber_refuses_a_target_that_is_a_checkpoint_or_another_weightsync_folder(
    published, run_cli, ws, tmp_path
):
    """A subscriber given a checkpoint folder as ``--target`` (a watched step) wrote its slots and
    ``current`` into it, and they were published with it; given a pulled folder or a publish cache,
    every later publish failed. Each start is refused with one line and the folder left as it was (new
    folders, and a subscriber's own target at a restart, start as before: the daemon tests)."""
    store, traj = published
    url = f"file://{store}"
    pulled = tmp_path / "pulled"
    weightsync.pull(url, pulled, 1, config=NOFSYNC)
    for folder, says in ((traj[2], "is not empty (config.json"), (pulled, "holds a version of its own")):
        before = ws.snapshot(folder)
        rc, _, err = run_cli("subscriber", "--store", url, "--target", folder, "--listen", "127.0.0.1:0", "--id", "t")
        assert rc == 2 and says in err.splitlines()[-1], err
        assert ws.snapshot(folder) == before and not (folder / "slots").exists()
    from weightsync.service.subscriber import _check_target_root

    volume = tmp_path / "volume"  # a fresh file system's root, and hidden files: a review found them refused
    for name in ("lost+found", ".snapshot"):
        (volume / name).mkdir(parents=True)
    (volume / ".gitkeep").write_text("")
    _check_target_root(volume)
