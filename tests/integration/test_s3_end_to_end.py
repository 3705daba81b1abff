"""weightsync end to end on a real SeaweedFS: regional mirrors (S3 to S3, S3 to file), retention
under a running publisher, a killed publish that resumes, racing publishers.

Publishers and mirrors run as real processes (``python -m weightsync.cli`` or a short script);
every version a test reads back is pulled and compared with its checkpoint file by file.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from procs import finish, spawn_cli

import weightsync
from weightsync.demo import make_trajectory
from weightsync.errors import WeightsyncError
from weightsync.format.keys import chunk_key
from weightsync.sync.gc import GcConfig, gc, list_chunks_with_age
from weightsync.sync.mirror import mirror

pytestmark = pytest.mark.integration

TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}
MIRROR_BUCKET = "weightsync-mirror"


# --- helpers ----------------------------------------------------------------------------------------
def content(root: Path) -> dict[str, str]:
    """relpath -> sha256 of every file outside ``.weightsync``."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith(".weightsync"):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def pull_and_check(repo: weightsync.Repo, version: int, out: Path, checkpoint: Path) -> None:
    weightsync.pull(repo, out, version)
    assert content(out) == content(checkpoint), f"version {version} of {repo.url} differs from {checkpoint}"


@pytest.fixture
def env(tmp_path):
    """``env()``: the environment for child processes, read when called (after ``s3_env`` has
    pointed boto3 at SeaweedFS), with a private publish cache."""

    def make() -> dict[str, str]:
        e = dict(os.environ)
        e["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
        return e

    return make


@pytest.fixture
def mirror_url(seaweed, s3_url) -> str:
    """A fresh prefix in a second bucket (another "region")."""
    seaweed.make_bucket(MIRROR_BUCKET)
    return f"s3://{MIRROR_BUCKET}/{s3_url.rsplit('/', 1)[1]}"


@pytest.fixture
def traj(tmp_path) -> list[Path]:
    return make_trajectory(tmp_path / "traj", steps=5, shards=2, **TINY)


# --- regional mirror --------------------------------------------------------------------------------
def test_mirror_s3_to_s3_following_then_s3_to_file(s3_url, mirror_url, traj, tmp_path, env):
    src = weightsync.open_repo(s3_url)
    cfg = weightsync.PublishConfig(keyframe_interval=3)
    weightsync.publish(traj[0], src, config=cfg)
    follower = spawn_cli("mirror", "--from", s3_url, "--to", mirror_url, "--follow", "--interval", "0.2", env=env())
    regional = weightsync.open_repo(mirror_url)
    try:
        for v in range(1, len(traj)):
            weightsync.publish(traj[v], src, config=cfg, base_dir=traj[v - 1])
        deadline = time.monotonic() + 30
        while regional.head_version() != len(traj) - 1:
            assert follower.poll() is None and time.monotonic() < deadline, follower.stderr.read()
            time.sleep(0.1)
        follower.send_signal(signal.SIGINT)
        rc, out, err = finish(follower, 20)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert rc == 0, err
    assert out.strip() == "5"
    assert regional.versions() == list(range(6))
    for key in ("HEAD", "weightsync.json", *(f"versions/{v:020d}.json" for v in range(6))):
        assert regional.store.get(key) == src.store.get(key)
    sub = tmp_path / "subscriber"  # a subscriber in the region pulls from the regional store
    for v in range(6):
        pull_and_check(regional, v, sub, traj[v])

    again = mirror(src, regional)  # idempotent
    assert again.copied_versions == [] and again.copied_chunks == 0

    local = weightsync.open_repo(tmp_path / "region-file")
    res = mirror(src, local)
    assert res.copied_versions == list(range(6))
    assert res.copied_bytes == sum(local.store.head(k) for k in local.store.list("chunks/"))
    for v in (0, 4, 5):
        pull_and_check(local, v, tmp_path / f"file-{v}", traj[v])


# --- retention --------------------------------------------------------------------------------------
PUBLISHER = """
import sys, time, weightsync
store, pause, *dirs = sys.argv[1:]
prev = None
for d in dirs:
    time.sleep(float(pause))
    r = weightsync.publish(d, store, config=weightsync.PublishConfig(keyframe_interval=3), base_dir=prev)
    print(r.version, d, flush=True)
    prev = d
"""


def test_gc_on_s3_while_a_publisher_runs(s3_url, tmp_path, env):
    checkpoints = make_trajectory(tmp_path / "traj", steps=7, shards=1, **TINY)
    script = tmp_path / "publisher.py"
    script.write_text(PUBLISHER)
    grace = 3.0  # S3 LastModified and Date have a resolution of one second: ages are +-1 s
    repo = weightsync.open_repo(s3_url)
    proc = subprocess.Popen(
        [sys.executable, str(script), s3_url, "0.3", *map(str, checkpoints)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    runs = during = 0
    try:
        while proc.poll() is None:
            if repo.check():
                during += gc(repo, GcConfig(keep=2, grace_seconds=grace)).deleted_chunks
                runs += 1
            time.sleep(0.05)
    finally:
        rc, out, err = finish(proc)
    assert rc == 0, err
    # gc ran beside the publisher; whether a chunk was already old enough to go during the run
    # depends on the machine's speed against the grace period, so deletions are checked below
    assert runs > 3, (runs, during)
    published = {int(v): Path(d) for v, d in (line.split(" ", 1) for line in out.splitlines())}
    assert sorted(published) == list(range(len(checkpoints)))
    deadline = time.monotonic() + grace + 60  # every chunk past the grace (ages +-1 s), no longer
    while any(age is None or age < grace + 1 for _, _, age in list_chunks_with_age(repo.store)):
        assert time.monotonic() < deadline, "chunks never aged past the grace period"
        time.sleep(0.2)
    res = gc(repo, GcConfig(keep=2, grace_seconds=grace))
    assert res.young_chunks == 0 and during + res.deleted_chunks > 0
    kept = repo.versions()
    assert kept[-2:] == [len(checkpoints) - 2, len(checkpoints) - 1]
    for v in kept:
        pull_and_check(repo, v, tmp_path / f"kept-{v}", published[v])
    needed = {chunk_key(c.id) for v in kept for c in repo.manifest(v).chunks}
    assert set(repo.store.list("chunks/")) == needed
    ages = [age for _, _, age in list_chunks_with_age(repo.store)]
    assert all(a is not None and -5 < a < 120 for a in ages)  # ages from LastModified and the server clock


def test_gc_aborts_stale_multipart_uploads(s3_url, seaweed, traj):
    repo = weightsync.open_repo(s3_url)
    weightsync.publish(traj[0], repo)
    bucket, prefix = s3_url[len("s3://") :].split("/", 1)
    client = seaweed.client()
    key = f"{prefix}/chunks/ab/ab{'0' * 30}"  # a big chunk whose uploader was killed
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)

    def uploads() -> list[str]:
        return [u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", ())]

    assert uploads() == [upload]
    assert gc(repo, GcConfig(keep=1)).partial_writes == 0 and uploads() == [upload]  # young: maybe in flight
    time.sleep(1.1)
    assert gc(repo, GcConfig(keep=1, grace_seconds=0)).partial_writes == 1 and uploads() == []
    pull_and_check(repo, 0, traj[0].parent / "out", traj[0])


# --- resumable and atomic publishing ----------------------------------------------------------------
def test_killed_publish_resumes_without_uploading_again(s3_url, tmp_path, env):
    ckpt = make_trajectory(tmp_path / "big", steps=0, hidden=512, layers=2, experts=4, vocab=4096)[0]
    repo = weightsync.open_repo(s3_url)
    proc = spawn_cli(
        "publish", ckpt, "--store", s3_url, "--no-cache", "--chunk-mib", "1", "--concurrency", "1", env=env()
    )
    try:
        deadline = time.monotonic() + 60
        while sum(1 for _ in repo.store.list("chunks/")) < 3:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        finish(proc)
    stored = {k: repo.store.head(k) for k in repo.store.list("chunks/")}
    assert repo.head_version() is None, "killed too late: the publish had committed"
    result = weightsync.publish(ckpt, repo, config=weightsync.PublishConfig(chunk_bytes=1 << 20, upload_concurrency=1))
    total = sum(c.size for c in repo.manifest(0).chunks)
    assert result.version == 0
    assert result.uploaded_bytes <= total - sum(stored.values())
    assert 0 < result.uploaded_bytes < total
    assert {chunk_key(c.id) for c in repo.manifest(0).chunks} >= set(stored)  # same deterministic chunks
    pull_and_check(repo, 0, tmp_path / "out", ckpt)


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_racing_publishers_exactly_one_wins(backend, request, traj, tmp_path, env):
    url = request.getfixturevalue("s3_url") if backend == "s3" else f"file://{tmp_path / 'store'}"
    repo = weightsync.open_repo(url)
    weightsync.publish(traj[0], repo)
    candidates = {traj[1]: content(traj[1]), traj[2]: content(traj[2])}
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:  # readers see version 1 whole (one of the candidates) or not at all
        out = tmp_path / "reader"
        try:
            while not done.is_set():
                head = repo.head_version()
                if head == 1:
                    weightsync.pull(repo, out, 1)
                    assert content(out) in candidates.values()
                    seen.append(1)
                time.sleep(0.01)
        except (AssertionError, WeightsyncError) as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        procs = [
            spawn_cli("publish", c, "--store", url, "--version", 1, "--base", traj[0], "--no-cache", env=env())
            for c in candidates
        ]
        results = [finish(p, 120) for p in procs]
    finally:
        done.set()
        t.join()
    assert not errors, errors
    rcs = [rc for rc, _, _ in results]
    assert sorted(rcs) == [0, 1], results
    winner = list(candidates)[rcs.index(0)]
    _, out, _ = results[rcs.index(0)]
    _, _, err = results[rcs.index(1)]
    assert out.strip() == "1"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error:") and "version 1" in lines[0], err
    assert repo.versions() == [0, 1]
    pull_and_check(repo, 1, tmp_path / "final", winner)


COMMIT_RACER = """
import os, sys, time, weightsync
from weightsync.store.repo import Repo

store, ckpt, base, ready, go = sys.argv[1:]
commit = Repo.commit

def at_the_gate(self, manifest, etag, *signing):  # chunks are up; wait so that both racers commit at once
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    return commit(self, manifest, etag, *signing)

Repo.commit = at_the_gate
try:
    weightsync.publish(ckpt, store, 1, base_dir=base)
    print("won")
except weightsync.WeightsyncError as exc:
    print("lost", exc)
"""


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_racing_commits_exactly_one_wins(backend, request, traj, tmp_path, env):
    """Both racers have uploaded their chunks and commit version 1 at the same moment."""
    url = request.getfixturevalue("s3_url") if backend == "s3" else f"file://{tmp_path / 'store'}"
    repo = weightsync.open_repo(url)
    weightsync.publish(traj[0], repo)
    script = tmp_path / "racer.py"
    script.write_text(COMMIT_RACER)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), url, str(traj[i]), str(traj[0]), str(tmp_path / f"ready{i}"), str(go)],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{i}").exists() for i in (1, 2)):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [
                p.communicate() for p in procs
            ]
            time.sleep(0.01)
        assert repo.head_version() == 0
        go.touch()
        results = [finish(p) for p in procs]
    finally:
        for p in procs:
            finish(p, 5)
    assert all(rc == 0 for rc, _, _ in results), results
    outcomes = [out.split()[0] for _, out, _ in results]
    assert sorted(outcomes) == ["lost", "won"], results
    loser = results[outcomes.index("lost")][1]
    assert "version 1 already exists" in loser, loser
    assert repo.versions() == [0, 1]
    pull_and_check(repo, 1, tmp_path / "final", traj[1 + outcomes.index("won")])
