"""Hostile review of issue 19's pipelined mirror on file stores (a source rewritten as another
lineage while a mirror follows it, a destination planted with damaged chunks or notes, committers
with different ``--keyframe-payloads``, a lazy region used as the source of another mirror).

Each test says what a hostile or unlucky user does and what must hold: no version of the wrong
bytes ever committed or pulled with success. Tests marked ``xfail(strict=True)`` show a defect."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

import weightsync
from weightsync.demo import make_trajectory
from weightsync.errors import WeightsyncError
from weightsync.format.keys import LAZY_PREFIX, chunk_key
from weightsync.sync.mirror import MirrorConfig, MirrorError, mirror
from weightsync.sync.publish import PublishConfig

SMALL = {"hidden": 64, "layers": 1, "experts": 2, "vocab": 256, "lr": 1e-6}
EVERY_2 = PublishConfig(keyframe_interval=2)


def repo(path: Path) -> weightsync.Repo:
    return weightsync.open_repo(f"file://{path}")


def publish_all(
    traj: list[Path], src: weightsync.Repo, upto: int | None = None, start: int = 0, config=EVERY_2
) -> None:
    for i in range(start, len(traj) if upto is None else upto + 1):
        weightsync.publish(traj[i], src, config=config, base_dir=traj[i - 1] if i else None)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def region_is_whole(dst: Path) -> list[str]:
    """What is wrong with the region: chunks missing and not noted, or holding other bytes."""
    r, wrong = repo(dst), []
    head = r.head_version()
    for v in r.versions():
        if head is None or v > head:
            continue
        noted = r.lazy_chunks(v)
        for c in r.manifest(v).chunks:
            path = dst / chunk_key(c.id)
            if not path.exists():
                if c.id not in noted:
                    wrong.append(f"{v}: {c.id} missing")
                continue
            if xxhash.xxh3_128_hexdigest(path.read_bytes()) != c.id:
                wrong.append(f"{v}: {c.id} damaged")
    return wrong


@pytest.fixture
def small(tmp_path) -> list[Path]:
    return make_trajectory(tmp_path / "traj", steps=5, **SMALL)


def follow(src, dst, cfg: MirrorConfig):
    stop, out = threading.Event(), {}

    def run():
        try:
            out["result"] = mirror(src, dst, follow=True, config=cfg, stop=stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, stop, out


def wait_for(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := pred():
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# --- a source rewritten as another lineage --------------------------------------------------------------
def test_a_following_mirror_refuses_a_source_rewritten_as_another_lineage(tmp_path, small):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src, dst = repo(src_dir), repo(dst_dir)
    publish_all(small, src, upto=3)
    t, stop, out = follow(src, dst, MirrorConfig(interval=0.05))
    try:
        wait_for(lambda: dst.head_version() == 3 or "error" in out, "the region at 3")
        # the source is wiped and republished from another run (another seed): 0..5 of other bytes
        other = make_trajectory(tmp_path / "other", steps=5, **(SMALL | {"seed": 1}))
        shutil.rmtree(src_dir)
        publish_all(other, repo(src_dir))
        time.sleep(1.0)  # twenty polls
    finally:
        stop.set()
        t.join(30)
    head = dst.head_version()
    # what must hold: the mirror refuses (a MirrorError), the region stays at the old lineage's 3
    assert isinstance(out.get("error"), MirrorError), (out, head)
    assert head == 3


def test_a_one_shot_mirror_refuses_a_source_rewritten_as_another_lineage(tmp_path, small):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=3)
    mirror(repo(src_dir), repo(dst_dir))
    other = make_trajectory(tmp_path / "other", steps=5, **(SMALL | {"seed": 1}))
    shutil.rmtree(src_dir)
    publish_all(other, repo(src_dir))
    with pytest.raises(MirrorError):
        mirror(repo(src_dir), repo(dst_dir))
    assert repo(dst_dir).head_version() == 3


# --- a destination planted with damaged state ------------------------------------------------------------
def test_a_planted_chunk_of_the_right_size_and_wrong_bytes_is_not_committed_over(tmp_path, small):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src, dst = repo(src_dir), repo(dst_dir)
    publish_all(small, src, upto=1)
    dst.init()
    victim = max(src.manifest(1).chunks, key=lambda c: c.size)  # the biggest chunk of version 1
    path = dst_dir / chunk_key(victim.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * victim.size)  # the right id and size, other bytes
    try:
        mirror(src, dst, config=MirrorConfig(keyframe_payloads="eager"))
    except WeightsyncError:
        return  # refusing is fine
    assert region_is_whole(dst_dir) == []  # else: it must have replaced the planted chunk


def test_a_pull_of_a_region_with_a_planted_chunk_fails_and_installs_nothing(tmp_path, small):
    """Whatever the mirror did, a reader never installs the planted bytes."""
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src, dst = repo(src_dir), repo(dst_dir)
    publish_all(small, src, upto=1)
    dst.init()
    victim = max(src.manifest(1).chunks, key=lambda c: c.size)
    path = dst_dir / chunk_key(victim.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * victim.size)
    mirror(src, dst, config=MirrorConfig(keyframe_payloads="eager"))
    out = tmp_path / "out"
    try:
        weightsync.pull(f"file://{dst_dir}", out, 1)
    except WeightsyncError:
        assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.iterdir())
        return
    assert files_of(out) == files_of(small[1])


def test_a_planted_note_listing_chunks_the_region_holds_is_cleared_by_the_next_run(tmp_path, small):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src, dst = repo(src_dir), repo(dst_dir)
    publish_all(small, src, upto=3)
    mirror(src, dst, config=MirrorConfig(keyframe_payloads="eager"))
    dst.note_lazy_chunks(1, [c.id for c in dst.manifest(1).chunks])  # a lie on a delta version
    res = mirror(src, dst, config=MirrorConfig(keyframe_payloads="lazy"))
    assert res.completed_versions == [1]
    assert list(dst.store.list(LAZY_PREFIX)) == []
    out = tmp_path / "out"
    weightsync.pull(f"file://{dst_dir}", out, 3)
    assert files_of(out) == files_of(small[3])


# --- committers with different --keyframe-payloads --------------------------------------------------------
def test_a_never_committer_after_an_eager_one_leaves_a_whole_region_that_serves(tmp_path, small):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src, dst = repo(src_dir), repo(dst_dir)
    publish_all(small, src)
    a = threading.Thread(target=mirror, args=(src, dst), kwargs={"config": MirrorConfig(keyframe_payloads="eager")})
    b = threading.Thread(target=mirror, args=(src, dst), kwargs={"config": MirrorConfig(keyframe_payloads="never")})
    a.start(), b.start()
    a.join(120), b.join(120)
    assert dst.head_version() == 5
    assert region_is_whole(dst_dir) == []
    for v in (2, 4, 5):
        out = tmp_path / f"out{v}"
        weightsync.pull(f"file://{dst_dir}", out, v)
        assert files_of(out) == files_of(small[v])


# --- a lazy region as the source of another region --------------------------------------------------------
def test_a_region_mirrored_from_a_lazy_region_serves_the_right_bytes(tmp_path, small):
    src_dir, a_dir, b_dir = tmp_path / "src", tmp_path / "a", tmp_path / "b"
    src, a, b = repo(src_dir), repo(a_dir), repo(b_dir)
    for v in range(len(small)):  # version by version: each keyframe's parent is at the region first
        publish_all(small, src, upto=v, start=v)
        mirror(src, a, config=MirrorConfig(keyframe_payloads="never"))
    assert sorted(int(k.split("/")[-1].split(".")[0]) for k in a.store.list(LAZY_PREFIX)) == [2, 4]
    res = mirror(a, b, config=MirrorConfig(keyframe_payloads="lazy"))
    assert res.head == 5
    assert region_is_whole(b_dir) == []
    for v in range(len(small)):
        out = tmp_path / f"out{v}"
        weightsync.pull(f"file://{b_dir}", out, v)
        assert files_of(out) == files_of(small[v])


# --- a destination gc with a grace period shorter than the mirror's refresh ---------------------------------
class BlockingStore(weightsync.store.FileStore):
    """A source whose reads of ``blocked`` keys wait for ``release``: a slow chunk holding up its version."""

    def __init__(self, root, blocked: set[str]):
        super().__init__(root)
        self.blocked, self.release, self.reached = blocked, threading.Event(), threading.Event()

    def get(self, key: str) -> bytes:
        if key in self.blocked:
            self.reached.set()
            self.release.wait(60)
        return super().get(key)

    def get_at_most(self, key, limit):  # how chunks are read whole
        return self.get(key)[: limit + 1]


def test_a_destination_gc_with_a_short_grace_never_tears_a_version_copied_ahead(tmp_path, small):
    from weightsync.sync.gc import GcConfig, gc

    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    publish_all(small, repo(src_dir), upto=3)
    plain = repo(src_dir)
    later = {c.id for v in (0, 2, 3) for c in plain.manifest(v).chunks}
    slow = {chunk_key(c.id) for c in plain.manifest(1).chunks if c.id not in later}
    assert slow
    store = BlockingStore(src_dir, slow)
    src, dst = weightsync.Repo(store), repo(dst_dir)
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=mirror(src, dst, config=MirrorConfig(keyframe_payloads="eager"))), daemon=True
    )
    t.start()
    try:
        assert store.reached.wait(60)
        ahead = {c.id for v in (2, 3) for c in plain.manifest(v).chunks} - {c.id for c in plain.manifest(0).chunks}
        wait_for(
            lambda: dst.head_version() == 0 and all((dst_dir / chunk_key(c)).exists() for c in ahead), "2, 3 ahead"
        )
        old = time.time() - 60  # a minute later (ages come from the files' times)
        for c in ahead:
            os.utime(dst_dir / chunk_key(c), (old, old))
        gc(dst, GcConfig(keep=1, grace_seconds=30))  # the operator's grace: 30 s, under the mirror's 300 s refresh
    finally:
        store.release.set()
        t.join(60)
    assert out.get("r") is not None and out["r"].head == 3
    assert region_is_whole(dst_dir) == []


# --- killed at any moment, restarted with other flags -------------------------------------------------------
FLAG_SETS = [
    ["--keyframe-payloads", "lazy"],
    ["--keyframe-payloads", "never"],
    ["--keyframe-payloads", "eager", "--shard", "0/2", "--commit"],
    ["--keyframe-payloads", "lazy", "--shard", "1/3"],
    ["--keyframe-payloads", "never", "--shard", "0/3", "--commit"],
    ["--keyframe-payloads", "eager"],
]


def test_a_mirror_killed_and_restarted_with_other_flags_each_time_never_tears_the_region(tmp_path, cli_env):
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src = repo(src_dir)
    traj = make_trajectory(tmp_path / "traj7", steps=7, **SMALL)
    publish_all(traj, src, upto=1)
    base = [
        sys.executable,
        "-m",
        "weightsync.cli",
        "mirror",
        "--from",
        f"file://{src_dir}",
        "--to",
        f"file://{dst_dir}",
    ]
    for i, (flags, delay) in enumerate(zip(FLAG_SETS * 2, (0.3, 0.6, 0.9, 1.2, 0.5, 1.5, 0.4, 0.8, 1.1, 0.7))):
        if i + 2 < len(traj):
            publish_all(traj, src, upto=i + 2, start=i + 2)  # a new version while the region lags
        proc = subprocess.Popen(
            [*base, "--follow", "--interval", "0.1", "--concurrency", "2", *flags],
            env=cli_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert region_is_whole(dst_dir) == [], flags
    r = subprocess.run([*base, "--keyframe-payloads", "lazy"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert repo(dst_dir).head_version() == 7 and region_is_whole(dst_dir) == []
    assert list(repo(dst_dir).store.list(LAZY_PREFIX)) == []  # one lazy run clears every note a killed run left
    out = tmp_path / "sub"
    for v in range(8):
        weightsync.pull(f"file://{dst_dir}", out, v)
        assert files_of(out) == files_of(traj[v]), v


# --- readers of a region torn by a rewritten source ----------------------------------------------------------
def torn_region(tmp_path: Path, small: list[Path], config=EVERY_2) -> tuple[Path, list[Path]]:
    """A region that followed its source from 0..3 of one run into 4..5 of another (the defect above);
    returns it and the other run's checkpoints."""
    src_dir, dst_dir = tmp_path / "src", tmp_path / "region"
    src, dst = repo(src_dir), repo(dst_dir)
    publish_all(small, src, upto=3, config=config)
    t, stop, out = follow(src, dst, MirrorConfig(interval=0.05))
    try:
        wait_for(lambda: dst.head_version() == 3, "the region at 3")
        other = make_trajectory(tmp_path / "other", steps=5, **(SMALL | {"seed": 1}))
        shutil.rmtree(src_dir)
        publish_all(other, repo(src_dir), config=config)
        wait_for(lambda: dst.head_version() == 5 or "error" in out, "the mirror's answer")
    finally:
        stop.set()
        t.join(30)
    return dst_dir, other


def bytes_of(t) -> bytes:
    return t.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()


@pytest.mark.parametrize("coder", [True, False], ids=["ans", "sparse"])
@pytest.mark.parametrize("mode", ["patch", "flip"])
def test_a_torch_sink_following_a_torn_region_never_reports_success_with_wrong_bytes(tmp_path, small, mode, coder):
    import torch
    from safetensors.torch import load_file

    from weightsync.codec import CodecConfig
    from weightsync.torch.sink import TorchSink

    config = PublishConfig(codec=CodecConfig(entropy_coder=coder), keyframe_interval=2)
    dst_dir, other = torn_region(tmp_path, small, config)
    if repo(dst_dir).head_version() == 3:
        return  # the mirror refused: nothing torn to read
    live = {n: t.clone() for n, t in load_file(str(small[3] / "model.safetensors")).items()}
    if mode == "flip":
        live = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in live.items()}
    sink = TorchSink(f"file://{dst_dir}", live, 3, mode=mode)
    for v in (4, 5):
        try:
            sink.update(v)
        except WeightsyncError:
            continue
        want = load_file(str(other[v] / "model.safetensors"))
        got = {n: t.detach() for n, t in live.items()}
        assert all(bytes_of(got[n]) == bytes_of(t) for n, t in want.items()), v
