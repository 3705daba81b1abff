"""Faults between weightsync and its store, and on the subscriber's disk.

S3 faults come from ``tests/faultproxy.py`` between boto3 and SeaweedFS: throttling (503
SlowDown), 500s, connection resets, slow answers, bodies cut short, and answers lost after the
server acted. SeaweedFS itself is stopped and restarted in the middle of transfers. Every test
checks that the work completes through retries, that every stored chunk still matches its id, that
what is served is byte-identical to the checkpoint, and that the daemons count their retries in
``weightsync_store_retries_total``, by the reason of each retry.

The disk-full test mounts a size-limited tmpfs (needs root or CAP_SYS_ADMIN; skipped otherwise)
under the subscriber's target folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "functional"))  # the daemon helpers

from faultproxy import FaultProxy, Rule  # noqa: E402
from test_daemons import Daemon, http, trainer, wait_for  # noqa: E402

import weightsync  # noqa: E402
from weightsync.demo import SyntheticTrainer, make_trajectory
from weightsync.format.keys import chunk_key
from weightsync.store.retry import RETRY_OPS, RETRY_REASONS

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
SMALL = dict(hidden=128, layers=1, experts=2, vocab=512)  # ~0.8 MB: keyframes span several 64 KiB chunks
S3 = pytest.mark.integration


# --- helpers ------------------------------------------------------------------------------------------
def content(folder: Path) -> dict[str, bytes]:
    """The files of a checkpoint or replica (not ``.weightsync``, not the ``COMPLETE`` marker)."""
    return {
        rel: p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
        and ".weightsync" not in (rel := p.relative_to(folder).as_posix()).split("/")
        and rel != "COMPLETE"
    }


def metric(text: str, name: str) -> float:
    """Sum of every series of ``name`` in a Prometheus text exposition."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def retry_reasons(*texts: str) -> dict[str, float]:
    """reason -> retries of ``weightsync_store_retries_total`` in Prometheus text expositions; every
    series is labelled with an ``op`` and a ``reason`` of their fixed sets."""
    out: dict[str, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "weightsync_store_retries_total":
                    assert s.labels["op"] in RETRY_OPS and s.labels["reason"] in RETRY_REASONS, s.labels
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
    return out


def check_chunks(repo: weightsync.Repo) -> int:
    """Every stored chunk is the bytes its id names (nothing corrupt was stored); returns the count."""
    keys = list(repo.store.list("chunks/"))
    for key in keys:
        data = repo.store.get(key)
        assert xxhash.xxh3_128_hexdigest(data) == key.rsplit("/", 1)[1], f"corrupt chunk stored: {key}"
    return len(keys)


@pytest.fixture
def proxy(seaweed):
    p = FaultProxy(seaweed.endpoint, seed=1).start()
    yield p
    p.stop()


@pytest.fixture
def proxied_env(s3_env, proxy) -> dict[str, str]:
    """Environment for daemons that reach SeaweedFS through the proxy."""
    return {**s3_env.env(), "AWS_ENDPOINT_URL": proxy.endpoint}


# --- every fault kind, through the Python API ------------------------------------------------------------
@S3
def test_every_fault_kind_is_retried_and_nothing_corrupt_is_stored_or_served(s3_url, proxy, tmp_path):
    traj = make_trajectory(tmp_path / "traj", steps=3, shards=2, **SMALL)
    repo = weightsync.open_repo(s3_url, endpoint_url=proxy.endpoint)  # retries: RetryingStore
    cfg = weightsync.PublishConfig(chunk_bytes=64 << 10, keyframe_interval=2)
    rules = [
        Rule("503", method="PUT", key=r"/chunks/", count=3),
        Rule("500", method="PUT", key=r"/chunks/", count=2),
        Rule("reset", method="PUT", key=r"/chunks/", count=2),
        Rule("drop", method="PUT", key=r"/chunks/", count=2),
        Rule("delay", method="PUT", key=r"/chunks/", count=2, delay=0.3),
        Rule("503", method="HEAD", count=2),
        Rule("reset", method="GET", key=r"/HEAD$", count=2),
        Rule("500", method="GET", key=r"/versions/", count=2),
        Rule("503", method="GET", key=r"list-type=2", count=2),  # LIST
        Rule("truncate", method="GET", key=r"/chunks/", count=3, fraction=0.3),
        Rule("reset", method="GET", key=r"/chunks/", count=2),
        Rule("503", method="GET", key=r"/chunks/", count=2),
        Rule("delay", method="GET", key=r"/chunks/", count=2, delay=0.3),
    ]
    for rule in rules:
        proxy.add(rule)
    for i, ckpt in enumerate(traj):
        assert weightsync.publish(ckpt, repo, config=cfg).version == i
    for v in (0, 3):  # a keyframe, and a delta on a keyframe (fresh); then incremental 0 -> 3
        out = tmp_path / f"fresh-{v}"
        weightsync.pull(repo, out, v, config=weightsync.PullConfig(fsync=False, fetch_concurrency=4))
        assert content(out) == content(traj[v])
    out = tmp_path / "fresh-0"
    weightsync.pull(repo, out, 3, config=weightsync.PullConfig(fsync=False))
    assert content(out) == content(traj[3])
    unfired = [r for r in rules if r.fired == 0]
    assert not unfired, f"rules that never fired: {unfired}"
    assert set(proxy.counts()) == {"503", "500", "reset", "drop", "delay", "truncate"}
    proxy.clear()
    assert check_chunks(weightsync.open_repo(s3_url)) >= 6
    assert weightsync.open_repo(s3_url).versions() == [0, 1, 2, 3]


@S3
def test_a_whole_chunk_read_cut_short_is_retried(s3_url, proxy, tmp_path):
    """A chunk read whole (at most its size + 1 bytes, ``Store.get_at_most``) whose body the network
    cut short came back short without a word, and the pull failed on a checksum mismatch, which is
    not retried. It is a transport error: retried, and the pull succeeds."""
    traj = make_trajectory(tmp_path / "traj", steps=0, **SMALL)
    repo = weightsync.open_repo(s3_url, endpoint_url=proxy.endpoint)
    weightsync.publish(traj[0], repo)
    rule = proxy.add(Rule("truncate", method="GET", key=r"/chunks/", count=1, fraction=0.5))
    out = tmp_path / "out"
    weightsync.pull(repo, out, 0, config=weightsync.PullConfig(fsync=False))
    assert rule.fired == 1 and content(out) == content(traj[0])


@S3
@pytest.mark.parametrize("write", ["manifest", "head"])
def test_a_lost_answer_to_a_commit_write_neither_fails_nor_blocks_the_publish(write, s3_url, proxy, tmp_path):
    """The server stores the manifest (or moves the head) but the answer is lost: the retry finds
    its own write (412). The publish must succeed, and the next one too."""
    traj = make_trajectory(tmp_path / "traj", steps=2, **TINY)
    repo = weightsync.open_repo(s3_url, endpoint_url=proxy.endpoint)
    weightsync.publish(traj[0], repo)
    proxy.add(Rule("drop", method="PUT", key=r"/versions/" if write == "manifest" else r"/HEAD$", count=1))
    try:
        result = weightsync.publish(traj[1], repo)
        assert result.version == 1
    except weightsync.WeightsyncError as exc:
        pytest.fail(f"a lost answer to the {write} write failed the publish: {exc}")
    finally:
        assert proxy.counts() == {"drop": 1}
    assert weightsync.publish(traj[2], repo).version == 2, "the next publish is blocked"
    assert repo.versions() == [0, 1, 2]


# --- daemons under random faults and a server restart --------------------------------------------------
def random_faults(proxy: FaultProxy, p: float) -> None:
    """Each kind on its first request, then with probability ``p`` on every request (lost answers
    only on chunk writes: see test_a_lost_answer_to_a_commit_write_neither_fails_nor_blocks_the_publish).
    The first firings make every kind certain to occur: the seeded draws alone depend on how the
    daemons' requests interleave, and chunk writes are few."""
    for count, prob in ((1, 1.0), (None, p)):
        proxy.add(Rule("drop", method="PUT", key=r"/chunks/", count=count, probability=prob))
        for kind in ("503", "500", "reset", "truncate"):
            proxy.add(Rule(kind, count=count, probability=prob))
        proxy.add(Rule("delay", count=count, probability=prob, delay=0.05))


@S3
def test_daemons_converge_through_random_faults_and_count_their_retries(s3_url, proxy, proxied_env, tmp_path):
    watch = tmp_path / "watch"
    watch.mkdir()
    random_faults(proxy, 0.04)
    pub = Daemon(
        "publisher", ["--store", s3_url, "--watch", watch, "--state-dir", tmp_path / "st"], tmp_path, env=proxied_env
    ).start()
    sub = Daemon(
        "subscriber",
        ["--store", s3_url, "--target", tmp_path / "sub", "--no-fsync", "--ledger-interval", "0.3"],
        tmp_path,
        env=proxied_env,
    ).start()
    try:
        assert trainer(watch, 0, 4, 0.2).wait(60) == 0
        sub.wait_version(3, timeout=90)
        assert content(tmp_path / "sub" / "current") == content(watch / "checkpoint-3")
        retries = {d.role: metric(d.get("/metrics")[1], "weightsync_store_retries_total") for d in (pub, sub)}
        assert retries["subscriber"] > 0 and retries["publisher"] > 0, retries
        assert metric(sub.get("/metrics")[1], "weightsync_checksum_failures_total") == 0
        # each injected kind is told apart: 503 SlowDown, 500, resets and drops, bodies cut short
        reasons = retry_reasons(*(d.get("/metrics")[1] for d in (pub, sub)))
        assert reasons["other"] == 0 and {r for r, n in reasons.items() if n} >= {
            "throttled",
            "server_error",
            "connection",
        }, reasons
    finally:
        assert pub.stop() == 0 and sub.stop() == 0
    injected = proxy.counts()
    proxy.clear()
    assert sum(injected.values()) >= 10 and len(injected) >= 5, injected
    repo = weightsync.open_repo(s3_url)
    assert repo.versions() == [0, 1, 2, 3]
    check_chunks(repo)


@S3
def test_seaweedfs_stopped_and_restarted_mid_transfer(s3_url, seaweed, proxy, proxied_env, tmp_path):
    """Chunk transfers are slowed so the server goes down under them: publishes and syncs fail
    their retries, back off, and finish once it is back."""
    watch = tmp_path / "watch"
    watch.mkdir()
    proxy.add(Rule("delay", key=r"/chunks/", delay=0.4))
    pub = Daemon(
        "publisher",
        ["--store", s3_url, "--watch", watch, "--state-dir", tmp_path / "st", "--chunk-mib", 1],
        tmp_path,
        env=proxied_env,
    ).start()
    sub = Daemon(
        "subscriber", ["--store", s3_url, "--target", tmp_path / "sub", "--no-fsync"], tmp_path, env=proxied_env
    ).start()
    try:
        assert trainer(watch, 0, 1, 0.0).wait(60) == 0
        sub.wait_version(0, timeout=60)
        t0 = time.monotonic()
        assert trainer(watch, 1, 2, 0.0).wait(60) == 0  # steps 1 and 2
        wait_for(lambda: proxy.seen("PUT", r"/chunks/", since=t0) >= 1, 30, "a chunk upload in flight")

        def retries() -> dict[str, float]:
            return {d.role: metric(d.get("/metrics")[1], "weightsync_store_retries_total") for d in (pub, sub)}

        before = retries()
        seaweed.stop()
        # down until both daemons have met the outage (not for a fixed time a slow machine may not fill)
        wait_for(
            lambda: all(r > before[role] for role, r in retries().items()),
            60,
            "both daemons retrying against the stopped server",
        )
        seaweed.start()
        sub.wait_version(2, timeout=90)
        assert content(tmp_path / "sub" / "current") == content(watch / "checkpoint-2")
    finally:
        if not seaweed.running:
            seaweed.start()
        assert pub.stop() == 0 and sub.stop() == 0
    proxy.clear()
    repo = weightsync.open_repo(s3_url)
    assert repo.versions() == [0, 1, 2]
    check_chunks(repo)


@S3
def test_a_corrupt_chunk_is_never_served_and_the_subscriber_recovers_once_it_is_repaired(
    s3_url, seaweed, tmp_path, monkeypatch
):
    """Version 1's first chunk is overwritten with garbage in the bucket before the head moves: the
    subscriber counts a checksum failure, names the object, keeps serving version 0, and takes
    version 1 once the chunk is repaired."""
    traj = make_trajectory(tmp_path / "traj", steps=1, **TINY)
    repo = weightsync.open_repo(s3_url)
    weightsync.publish(traj[0], repo)
    target = tmp_path / "sub"
    sub = Daemon(
        "subscriber", ["--store", s3_url, "--target", target, "--no-fsync"], tmp_path, env=seaweed.env()
    ).start()
    try:
        sub.wait_version(0)
        saved = {}
        commit = weightsync.Repo.commit

        def corrupt_then_commit(self, manifest, etag, *signing):
            key = chunk_key(manifest.chunks[0].id)
            saved[key] = self.store.get(key)
            self.store.put(key, b"garbage" * 100, mode="overwrite")
            return commit(self, manifest, etag, *signing)

        monkeypatch.setattr(weightsync.Repo, "commit", corrupt_then_commit)
        weightsync.publish(traj[1], repo)
        monkeypatch.undo()
        ((key, good),) = saved.items()
        status = wait_for(lambda: (s := sub.status())["last_error"] and s, 30, "the failed sync")
        assert key in status["last_error"], status["last_error"]
        assert status["current_version"] == 0
        assert metric(sub.get("/metrics")[1], "weightsync_checksum_failures_total") >= 1
        assert http("GET", sub.url + "/readyz")[0] == 200
        assert content(target / "current") == content(traj[0])
        repo.store.put(key, good, mode="overwrite")
        sub.wait_version(1, timeout=30)
        assert content(target / "current") == content(traj[1])
    finally:
        assert sub.stop() == 0


# --- disk full --------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (``mount -t tmpfs -o size=2m``), unmounted after the test."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_on_the_subscriber_is_a_clear_error_and_current_keeps_serving(small_disk, tmp_path):
    """Version 1 adds a 3 MiB file that does not fit next to version 0 on a 2 MiB disk: the sync
    fails with ENOSPC in the status and the logs, version 0 stays in service, whole; a one-shot
    pull fails with one line; once the disk grows, the subscriber takes version 1."""
    store = tmp_path / "store"
    t = SyntheticTrainer(**TINY)
    v0 = t.save(tmp_path / "ckpt" / "step_0")
    t.step()
    v1 = t.save(tmp_path / "ckpt" / "step_1")
    (v1 / "extra.bin").write_bytes(os.urandom(3 << 20))
    weightsync.publish(v0, store)
    target = small_disk / "sub"
    sub = Daemon("subscriber", ["--store", store, "--target", target, "--no-fsync", "--version", 0], tmp_path).start()
    replica = small_disk / "replica"  # for a one-shot pull on the same disk
    try:
        sub.wait_version(0)
        weightsync.pull(store, replica, 0, config=weightsync.PullConfig(fsync=False))
        sub.put_target("latest")
        weightsync.publish(v1, store)
        status = wait_for(lambda: (s := sub.status())["last_error"] and s, 30, "the failed sync")
        assert "No space left on device" in status["last_error"], status["last_error"]
        assert status["current_version"] == 0 and status["state"] in ("error", "waiting"), status
        assert http("GET", sub.url + "/readyz")[0] == 200
        assert "No space left on device" in sub.log()
        assert weightsync.verify(store, target / "current", 0) == 0
        assert content(target / "current") == content(v0)

        r = subprocess.run(
            [sys.executable, "-m", "weightsync.cli", "pull", "--store", str(store), str(replica)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and "No space left on device" in r.stderr, r.stderr
        assert weightsync.verify(store, replica, 0) == 0
        subprocess.run(["rm", "-rf", str(replica)], check=True)

        subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
        sub.wait_version(1, timeout=60)
        assert content(target / "current") == content(v1)
    finally:
        assert sub.stop() == 0
    json.loads((target / "current" / ".weightsync" / "state.json").read_text())


@S3
def test_gc_retries_its_own_s3_reads(s3_url, proxy, tmp_path):
    """gc reads object ages with LIST pages and HEADs (the protocol's list_meta and head_meta);
    those are retried like every other store read, so throttling does not fail a gc run."""
    from weightsync.sync.gc import GcConfig, gc

    traj = make_trajectory(tmp_path / "traj", steps=3, **SMALL)
    repo = weightsync.open_repo(s3_url, endpoint_url=proxy.endpoint)
    cfg = weightsync.PublishConfig(chunk_bytes=64 << 10, keyframe_interval=2)
    for ckpt in traj:
        weightsync.publish(ckpt, repo, config=cfg)
    rules = [
        Rule("503", method="GET", key=r"list-type=2.*chunks", count=2),
        Rule("500", method="HEAD", key=r"/chunks/", count=2),
    ]
    for rule in rules:
        proxy.add(rule)
    result = gc(repo, GcConfig(keep=1, grace_seconds=0))
    assert [r.fired for r in rules] == [2, 2]
    assert result.deleted_chunks > 0
    proxy.clear()
    out = tmp_path / "out"
    head = len(traj) - 1
    weightsync.pull(weightsync.open_repo(s3_url), out, head, config=weightsync.PullConfig(fsync=False))
    assert content(out) == content(traj[head])
    assert weightsync.open_repo(s3_url).versions() == [2, 3]  # the head's chain back to its keyframe
