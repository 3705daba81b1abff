"""Readers of a region whose mirror copies keyframe full payloads lazily (docs/FORMAT.md section 1,
lazy chunks), on file stores: followers read the keyframes' deltas only; fresh readers rebuild from
the region's newest whole keyframe or read the noted chunks from a fallback store; with neither, a
one-line error and nothing installed. The region is built directly (tests/lazy_region.py): keyframe
every 2 versions, 0 copied whole, 2, 4, 6 and 8 without their full payloads."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest
import torch
from lazy_region import copy_version, stored_bytes
from safetensors.torch import load_file

from weightsync.demo import make_trajectory
from weightsync.errors import ChecksumError, LazyChunksError
from weightsync.format.keys import LAZY_PREFIX, VERSIONS_PREFIX, chunk_key, lazy_key, version_key
from weightsync.format.manifest import lazy_candidates
from weightsync.local.verify import verify_folder
from weightsync.store.file import FileStore
from weightsync.store.repo import Repo, open_repo
from weightsync.sync.lazy import LazyReads
from weightsync.sync.publish import PublishConfig, publish
from weightsync.sync.pull import PullConfig, pull
from weightsync.sync.selection import Selection, materialize, verify_partial
from weightsync.torch.sink import TorchSink

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
LAST = 8
LAZY = (2, 4, 6, 8)  # keyframes every 2 versions; the region holds 0 whole


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    traj = make_trajectory(root / "traj", steps=LAST, shards=2, **TINY)
    src = open_repo(root / "src")
    for i, ckpt in enumerate(traj):
        publish(ckpt, src, config=PublishConfig(keyframe_interval=2), base_dir=traj[i - 1] if i else None)
    assert [v for v in src.versions() if src.manifest(v).keyframe] == [0, *LAZY]
    region = open_repo(root / "region")
    for v in src.versions():
        copy_version(src, region, v, lazy=v in LAZY)
    return root, traj


@pytest.fixture
def lazy(template, tmp_path):
    """Fresh copies of the source store and the region: ``src``, ``region`` (URLs), ``traj``."""
    root, traj = template
    for name in ("src", "region"):
        shutil.copytree(root / name, tmp_path / name)
    return types.SimpleNamespace(
        src=f"file://{tmp_path / 'src'}", region=f"file://{tmp_path / 'region'}", traj=traj, tmp=tmp_path
    )


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def assert_holds(folder: Path, ckpt: Path) -> None:
    assert files_of(folder) == files_of(ckpt)


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def lazy_chunk(url: str, version: int) -> str:
    (c,) = open_repo(url).lazy_chunks(version)
    return c


# --- the region --------------------------------------------------------------------------------------
def test_the_region_holds_under_half_the_sources_chunk_bytes_and_notes_each_lazy_keyframe(lazy):
    src, region = open_repo(lazy.src), open_repo(lazy.region)
    assert stored_bytes(region) <= stored_bytes(src) / 2, (stored_bytes(region), stored_bytes(src))
    for v in region.versions():
        assert bool(region.lazy_chunks(v)) == (v in LAZY), v
        for c in region.lazy_chunks(v):
            assert region.store.head(chunk_key(c)) is None


# --- followers ----------------------------------------------------------------------------------------
def test_a_follower_crosses_lazy_keyframes_reading_only_their_deltas(lazy):
    out = lazy.tmp / "out"
    pull(lazy.region, out, 1)
    snapshot = sum(c.size for c in open_repo(lazy.src).manifest(0).chunks)  # a full encoding's bytes
    for v in range(2, LAST + 1):
        r = pull(lazy.region, out, v)
        assert (r.from_version, r.rebuilt_from, r.fallback_bytes) == (v - 1, None, 0)
        assert r.fetched_bytes < snapshot / 4, (v, r.fetched_bytes, snapshot)
        assert_holds(out, lazy.traj[v])


def test_each_note_is_read_after_its_manifest(lazy):
    """The mirror writes a note before its manifest: read in the other order, a note not yet
    written would pass for a whole version."""
    reads: list[str] = []

    class Recording(FileStore):
        def get(self, key: str) -> bytes:
            reads.append(key)
            return super().get(key)

    repo = Repo(Recording(lazy.tmp / "region"))
    pull(repo, lazy.tmp / "fresh", LAST)
    pull(repo, lazy.tmp / "follower", 3)
    pull(repo, lazy.tmp / "follower", LAST)
    notes = [k for k in reads if k.startswith(LAZY_PREFIX)]
    assert {int(k[len(LAZY_PREFIX) : -5]) for k in notes} >= set(LAZY)
    for i, k in enumerate(reads):
        if k.startswith(LAZY_PREFIX):
            assert VERSIONS_PREFIX + k[len(LAZY_PREFIX) :] in reads[:i], k


def test_a_note_removed_while_a_pull_plans_is_harmless(lazy):
    """The mirror copies the chunks and removes its note right after the reader read it: the
    reader, looking for a whole keyframe, finds this one whole now and reads the chunks here."""
    src = open_repo(lazy.src)

    class MirrorFinishes(FileStore):
        def get(self, key: str) -> bytes:
            data = super().get(key)
            if key == lazy_key(LAST):
                region = Repo(FileStore(self.root))
                for c in region.lazy_chunks(LAST):
                    size = next(r.size for r in src.manifest(LAST).chunks if r.id == c)
                    region.put_chunk(c, src.get_chunk(c, size))
                region.clear_lazy_chunks(LAST)
            return data

    region = Repo(MirrorFinishes(lazy.tmp / "region"))
    r = pull(region, lazy.tmp / "a", LAST)
    assert (r.rebuilt_from, r.fallback_bytes) == (None, 0)
    assert_holds(lazy.tmp / "a", lazy.traj[LAST])
    assert not region.lazy_chunks(LAST)


# --- fresh pulls --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "rebuild"])
def test_a_fresh_pull_of_the_last_version_rebuilds_from_the_whole_keyframe(lazy, ok_cli, mode):
    for v in (LAST, LAST - 1):
        out = lazy.tmp / f"out{v}"
        ok_cli("pull", "--store", lazy.region, "--version", v, out, "--lazy-chunks", mode, "--no-progress")
        assert_holds(out, lazy.traj[v])
        verify_folder(out, open_repo(lazy.region).manifest(v))
    r = pull(lazy.region, lazy.tmp / "api", LAST)
    assert (r.rebuilt_from, r.fallback_bytes) == (0, 0)
    region_bytes = stored_bytes(open_repo(lazy.region))
    assert r.fetched_bytes <= region_bytes


def test_the_pull_command_says_how_it_read_the_version(lazy, run_cli):
    rc, out, err = run_cli("pull", "--store", lazy.region, lazy.tmp / "a", "--no-progress")
    assert rc == 0 and "rebuilt from keyframe 0" in err, err
    rc, out, err = run_cli(
        "pull", "--store", lazy.region, lazy.tmp / "b", "--lazy-chunks", "fallback", "--fallback-store", lazy.src
    )
    assert rc == 0 and f"of it from {lazy.src}" in err and "rebuilt" not in err, err
    assert out.strip() == str(LAST)


def test_a_fresh_pull_reads_the_noted_chunks_from_the_fallback_store(lazy, ok_cli):
    out = lazy.tmp / "out"
    ok_cli("pull", "--store", lazy.region, out, "--lazy-chunks", "fallback", "--fallback-store", lazy.src)
    assert_holds(out, lazy.traj[LAST])
    cfg = PullConfig(lazy=LazyReads("fallback", open_repo(lazy.src)))
    r = pull(lazy.region, lazy.tmp / "api", LAST - 1, config=cfg)
    noted = open_repo(lazy.src).manifest(LAST - 2).chunks
    assert r.rebuilt_from is None and 0 < r.fallback_bytes <= sum(c.size for c in noted)
    assert_holds(lazy.tmp / "api", lazy.traj[LAST - 1])


def test_auto_rebuilds_where_it_can_even_with_a_fallback_store(lazy):
    cfg = PullConfig(lazy=LazyReads("auto", open_repo(lazy.src)))
    r = pull(lazy.region, lazy.tmp / "out", LAST, config=cfg)
    assert (r.rebuilt_from, r.fallback_bytes) == (0, 0)
    assert_holds(lazy.tmp / "out", lazy.traj[LAST])


def test_a_partial_pull_across_lazy_keyframes(lazy):
    region = open_repo(lazy.region)
    sel = Selection(include=("*experts.1*", "lm_head*"))
    expected = {n: t for n, t in tensors(lazy.traj[LAST]).items() if sel.matches(n)}
    for folder, versions in (("fresh", [LAST]), ("follower", [1, 3, 4, LAST])):
        for v in versions:
            r = materialize(region, lazy.tmp / folder, v, sel)
            assert verify_partial(region, lazy.tmp / folder) == v
        got = tensors(lazy.tmp / folder)
        assert set(got) == set(expected) and all(bits(got[n]) == bits(t) for n, t in expected.items())
    # the same with the noted chunks from the fallback store: ranges of them, checked by their payloads
    cfg = PullConfig(lazy=LazyReads("fallback", open_repo(lazy.src)))
    r = materialize(region, lazy.tmp / "fallback", LAST, sel, config=cfg)
    assert r.version == LAST and verify_partial(region, lazy.tmp / "fallback") == LAST


# --- when neither way serves -------------------------------------------------------------------------
def collect_keyframe_zero(lazy) -> None:
    """What gc does once version 0 falls out of retention: its manifest, then its chunks."""
    region = open_repo(lazy.region)
    ids = [c.id for c in region.manifest(0).chunks]
    region.store.delete(version_key(0))
    for c in ids:
        region.store.delete(chunk_key(c))


def test_without_a_whole_keyframe_a_fresh_pull_fails_in_one_line_and_installs_nothing(lazy, run_cli, ws):
    collect_keyframe_zero(lazy)
    out = lazy.tmp / "out"
    for extra in ([], ["--lazy-chunks", "rebuild", "--fallback-store", lazy.src]):
        rc, _, err = run_cli("pull", "--store", lazy.region, out, *extra)
        line = ws.error_line(err)
        assert rc == 1 and f"version {LAST} needs 1 chunk(s)" in line and "--fallback-store" in line, line
        if extra:
            assert "--lazy-chunks auto or fallback" in line
        assert ws.content(out) == {}
    with pytest.raises(LazyChunksError) as exc:  # the API raises the same error
        pull(lazy.region, lazy.tmp / "v3", 3)
    assert exc.value.version == 3 and exc.value.chunks == open_repo(lazy.region).lazy_chunks(2)
    # the fallback store serves what the region cannot
    rc, _, err = run_cli("pull", "--store", lazy.region, out, "--fallback-store", lazy.src, "--no-progress")
    assert rc == 0, err
    assert_holds(out, lazy.traj[LAST])


def test_a_follower_still_follows_after_the_whole_keyframe_was_collected(lazy):
    out = lazy.tmp / "out"
    pull(lazy.region, out, 1)
    collect_keyframe_zero(lazy)
    for v in (2, 5, LAST):
        r = pull(lazy.region, out, v)
        assert r.rebuilt_from is None and r.fallback_bytes == 0
        assert_holds(out, lazy.traj[v])


def test_a_fallback_store_that_lies_is_refused(lazy, run_cli, ws):
    collect_keyframe_zero(lazy)
    src = open_repo(lazy.src)
    c = lazy_chunk(lazy.region, LAST)
    path = Path(lazy.src[len("file://") :]) / chunk_key(c)
    good = path.read_bytes()
    os.chmod(path, 0o644)
    path.write_bytes(bytes(b ^ 0x01 for b in good))  # same size, other bytes, under the same id
    out = lazy.tmp / "out"
    rc, _, err = run_cli("pull", "--store", lazy.region, out, "--lazy-chunks", "fallback", "--fallback-store", lazy.src)
    line = ws.error_line(err)
    assert rc == 1 and "checksum mismatch" in line and lazy.src in line, line
    assert ws.content(out) == {}
    # ranges of the chunk (a partial pull): each payload's own checksum refuses them
    cfg = PullConfig(lazy=LazyReads("fallback", src))
    with pytest.raises(ChecksumError, match=re.escape(lazy.src)):
        materialize(open_repo(lazy.region), lazy.tmp / "partial", LAST, Selection(include=("lm_head*",)), config=cfg)
    assert ws.content(lazy.tmp / "partial") == {}
    # a fallback store without the chunk: an error, not a silent rebuild of something else
    path.unlink()
    rc, _, err = run_cli("pull", "--store", lazy.region, out, "--fallback-store", lazy.src)
    line = ws.error_line(err)
    assert rc == 1 and chunk_key(c) in line and lazy.src in line, line
    assert ws.content(out) == {}


def test_a_note_whose_chunks_are_here_is_harmless(lazy):
    """A mirror that copied the chunks but has not removed its note yet."""
    collect_keyframe_zero(lazy)
    c = lazy_chunk(lazy.region, LAST)
    ref = next(r for r in open_repo(lazy.src).manifest(LAST).chunks if r.id == c)
    open_repo(lazy.region).put_chunk(c, open_repo(lazy.src).get_chunk(c, ref.size))
    r = pull(lazy.region, lazy.tmp / "out", LAST)
    assert r.fallback_bytes == 0
    assert_holds(lazy.tmp / "out", lazy.traj[LAST])
    assert open_repo(lazy.region).lazy_chunks(LAST)  # the note is the mirror's to remove


def test_a_missing_chunk_that_is_not_noted_is_still_an_integrity_error(lazy, run_cli, ws):
    region = open_repo(lazy.region)
    (c,) = region.lazy_chunks(LAST)
    region.clear_lazy_chunks(LAST)  # the note is gone, the chunk was never copied
    rc, _, err = run_cli("pull", "--store", lazy.region, lazy.tmp / "a", "--fallback-store", lazy.src)
    assert rc == 1 and chunk_key(c) in ws.error_line(err), err
    assert ws.content(lazy.tmp / "a") == {}
    (delta,) = region.manifest(LAST - 1).chunks  # a plain delta's only chunk
    region.store.delete(chunk_key(delta.id))
    rc, _, err = run_cli(
        "pull", "--store", lazy.region, "--version", LAST - 1, lazy.tmp / "b", "--fallback-store", lazy.src
    )
    assert rc == 1 and chunk_key(delta.id) in ws.error_line(err), err
    assert ws.content(lazy.tmp / "b") == {}


# --- the torch sink -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["patch", "flip"])
@pytest.mark.parametrize("fallback", [False, True])
def test_a_torch_sink_starting_afresh_rebuilds_then_follows(lazy, mode, fallback):
    """A model whose bytes are not the version it claims (say, loaded from elsewhere): every tensor
    is rebuilt from the region, across lazy keyframes; then it follows by deltas alone."""
    want = tensors(lazy.traj[LAST - 2])
    live = {n: torch.zeros_like(t) for n, t in want.items()}
    if mode == "flip":
        live = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in live.items()}
    reads = LazyReads("fallback", open_repo(lazy.src)) if fallback else None
    sink = TorchSink(lazy.region, live, LAST - 3, verify=False, mode=mode, lazy=reads)
    for v in (LAST - 2, LAST):
        up = sink.prepare(v)
        sink.apply(up)
        sink.after_apply(up)
        want = tensors(lazy.traj[v])
        assert all(bits(live[n]) == bits(t) for n, t in want.items()), v
    assert sink.version == LAST


# --- the subscriber daemon ----------------------------------------------------------------------------
def _status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5) as r:
        return json.loads(r.read())


class Daemon:
    def __init__(self, tmp: Path, name: str, *args):
        self.log_path = tmp / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.cli", "subscriber", *map(str, args)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSYNC_")},
            )
        self.port = int(self._until(lambda: re.search(r"listening.*?127\.0\.0\.1:(\d+)", self.log())).group(1))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _until(self, pred, timeout: float = 90.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the subscriber exited {self.proc.returncode}:\n{self.log()}")
            try:
                got = pred()
            except OSError:
                got = None
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out:\n{self.log()}")

    def serving(self, version: int) -> dict:
        return self._until(lambda: (s := _status(self.port))["current_version"] == version and s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_the_subscriber_starts_afresh_from_the_region_and_follows_a_lazy_keyframe(template, tmp_path):
    root, traj = template
    src = open_repo(root / "src")
    region_url = f"file://{tmp_path / 'region'}"
    region = open_repo(region_url)
    for v in range(LAST):  # the region's head is 7: its keyframe 6 has no full payloads here
        copy_version(src, region, v, lazy=v in LAZY)
    common = ["--store", region_url, "--no-fsync", "--listen", "127.0.0.1:0", "--poll-interval", "0.1"]
    daemons = []
    try:
        daemons.append(Daemon(tmp_path, "rebuild", *common, "--target", tmp_path / "t1"))
        daemons.append(
            Daemon(
                tmp_path,
                "fallback",
                *common,
                "--target",
                tmp_path / "t2",
                "--lazy-chunks",
                "fallback",
                "--fallback-store",
                f"file://{root / 'src'}",
            )
        )
        for d, target in zip(daemons, ("t1", "t2")):
            d.serving(LAST - 1)
            assert_holds(tmp_path / target / "current", traj[LAST - 1])
        copy_version(src, region, LAST, lazy=True)  # the next keyframe, lazily
        for d, target in zip(daemons, ("t1", "t2")):
            last = d.serving(LAST)["last_sync"]
            assert last["from_version"] == LAST - 1, last
            assert last["fetched_bytes"] < sum(c.size for c in src.manifest(LAST).chunks) / 4, last
            assert_holds(tmp_path / target / "current", traj[LAST])
    finally:
        for d in daemons:
            d.stop()


# --- bad input ------------------------------------------------------------------------------------------
def test_bad_lazy_flags_are_refused_in_one_line(lazy, run_cli, ws):
    out = lazy.tmp / "out"
    for cmd in (["pull", "--store", lazy.region, out], ["subscriber", "--store", lazy.region, "--target", out]):
        rc, _, err = run_cli(*cmd, "--lazy-chunks", "fallback")
        assert rc == 2 and "--lazy-chunks fallback needs --fallback-store" in ws.error_line(err), err
        rc, _, err = run_cli(*cmd, "--fallback-store", " ")
        assert rc == 2 and "--fallback-store is empty" in ws.error_line(err), err
        rc, _, err = run_cli(*cmd, "--lazy-chunks", "sometimes")
        assert rc == 2 and "invalid choice: 'sometimes'" in err, err
    assert not out.exists()


def test_a_damaged_note_is_read_as_listing_every_chunk_a_mirror_may_leave_out(lazy, run_cli, ws):
    """A note that cannot be read (torn, planted, naming another version) says nothing reliable about
    which chunks are here: readers take it to list every chunk only the version's full payloads use,
    avoid them, and install the right bytes (with a warning); no reader trusts it to be empty."""
    region = open_repo(lazy.region)
    wanted = lazy_candidates(region.manifest(LAST))
    assert region.lazy_chunks(LAST) and region.lazy_chunks(LAST) <= wanted
    for planted in (b'{"format": "weightsync.lazy"', region.store.get(lazy_key(LAST - 2))):
        region.store.put(lazy_key(LAST), planted, mode="overwrite")
        assert open_repo(lazy.region).lazy_chunks(LAST) == wanted
        out = lazy.tmp / f"out{len(planted)}"
        rc, _, err = run_cli("pull", "--store", lazy.region, out, "--fallback-store", lazy.src)
        assert rc == 0, err
        assert lazy_key(LAST) in err and "taking it to list every chunk" in err, err
        assert_holds(out, lazy.traj[LAST])
        rc, _, err = run_cli("pull", "--store", lazy.region, lazy.tmp / f"rb{len(planted)}")  # rebuild alone
        assert rc == 0, err
        assert_holds(lazy.tmp / f"rb{len(planted)}", lazy.traj[LAST])


def test_a_keyframe_repeating_a_whole_ones_bytes_does_not_block_the_rebuild(tmp_path):
    """``--keyframe-payloads never``: version 2 is a keyframe with version 0's bytes, so its full
    payload is version 0's chunk, which the region holds, yet the mirror notes it. Before, every
    use of that chunk was avoided, version 0 with it, and a fresh pull of the head failed ("cannot
    rebuild from a keyframe it holds whole"); a chunk that a version whose note leaves it out
    references is held."""
    from weightsync.sync.mirror import MirrorConfig, mirror

    traj = make_trajectory(tmp_path / "traj", steps=4, shards=1, **TINY)
    src = open_repo(tmp_path / "src")
    for ckpt in (traj[0], traj[1], traj[0], traj[3], traj[4]):
        publish(ckpt, src, config=PublishConfig(keyframe_interval=2))
    assert [v for v in src.versions() if src.manifest(v).keyframe] == [0, 2, 4]
    region = open_repo(tmp_path / "region")
    mirror(src, region, config=MirrorConfig(keyframe_payloads="never"))
    full0 = {c.id for c in region.manifest(0).chunks}
    assert region.lazy_chunks(2) & full0 and region.lazy_chunks(4)  # noted although held
    pull(region, tmp_path / "out", 4, config=PullConfig(fsync=False))
    assert_holds(tmp_path / "out", traj[4])
