"""Many writers and readers on one store: two publishers racing for every version number, gc
collecting behind them, and twenty subscriber processes following the head.

Two trainers (different seeds, so their checkpoints differ) mark step i ready in their folders at
the same moment, so the publishers race for version i; the store's create-only manifests let one
win and the other move on. gc keeps the newest 4 versions (keyframes every 3) with a 10 s grace:
the contract is a grace longer than the longest publish, and on 2 loaded cores with 22 daemons a
publish can take several seconds (S3 ages also read up to ~2 s old: whole-second timestamps).
At the end: every version number was published by exactly one publisher (none lost, none twice),
every version still stored is byte for byte the checkpoint of its publisher, every subscriber
serves the head byte for byte, never went backwards and never saw a checksum failure.
Runs on a file store, and on SeaweedFS when it is there.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "functional"))  # the daemon helpers

from test_daemons import Daemon, wait_for  # noqa: E402

import weightsync  # noqa: E402
from weightsync.demo import SyntheticTrainer
from weightsync.errors import WeightsyncError
from weightsync.sync.gc import GcConfig, gc, list_chunks_with_age

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
SUBSCRIBERS = 20
STEPS = 8
GRACE = 10.0  # longer than any publish here (module docstring)


def content(folder: Path) -> dict[str, bytes]:
    return {
        rel: p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
        and ".weightsync" not in (rel := p.relative_to(folder).as_posix()).split("/")
        and rel != "COMPLETE"
    }


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def checkpoints(watch: Path, seed: int) -> list[Path]:
    """Steps 0..STEPS-1 written now; each becomes ready when its COMPLETE marker is dropped."""
    t = SyntheticTrainer(seed=seed, **TINY)
    out = []
    for i in range(STEPS):
        if i:
            t.step()
        out.append(t.save(watch / f"step_{i:06d}"))
    return out


def age_past_grace(repo: weightsync.Repo, backend: str, store_dir: Path) -> None:
    """Every chunk older than GRACE: a file store's by setting its mtime, an S3 store's (whose ages
    the server sets) by waiting until its listing says so, and no longer."""
    if backend == "file":
        old = time.time() - 10 * GRACE
        for p in (store_dir / "chunks").rglob("*"):
            if p.is_file():
                os.utime(p, (old, old))
        return
    deadline = time.monotonic() + GRACE + 60
    while any(age is None or age < GRACE + 1 for _, _, age in list_chunks_with_age(repo.store)):  # ages +-1 s
        assert time.monotonic() < deadline, "chunks never aged past the grace period"
        time.sleep(0.2)


def stop_all(daemons: list[Daemon]) -> dict[str, int]:
    """Stop every daemon (each one killed if it ignores SIGTERM), then raise the first failure:
    one that fails to stop must not leave the others running after the test."""
    codes, errors = {}, []
    for i, d in enumerate(daemons):
        try:
            codes[d.role + str(i)] = d.stop()
        except AssertionError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return codes


def logged(log: str, what: str) -> list[int]:
    return [int(m) for m in re.findall(rf"{what} (\d+)", log)]


@pytest.mark.exclusive  # twenty daemons and two publishers at once
@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.integration)])
def test_two_publishers_gc_and_twenty_subscribers_on_one_store(backend, request, tmp_path):
    if backend == "s3":
        url, env = request.getfixturevalue("s3_url"), request.getfixturevalue("seaweed").env()
    else:
        url, env = f"file://{tmp_path / 'store'}", {}
    ckpts = {name: checkpoints(tmp_path / f"watch-{name}", seed) for name, seed in (("a", 0), ("b", 1))}
    pubs = {
        name: Daemon(
            "publisher",
            [
                "--store",
                url,
                "--watch",
                tmp_path / f"watch-{name}",
                "--state-dir",
                tmp_path / f"st-{name}",
                "--keyframe-interval",
                3,
                "--id",
                f"pub-{name}",
            ],
            tmp_path,
            env=env,
        )
        for name in ckpts
    }
    subs = [
        Daemon(
            "subscriber",
            [
                "--store",
                url,
                "--target",
                tmp_path / f"sub-{i:02d}",
                "--no-fsync",
                "--id",
                f"sub-{i:02d}",
                "--ledger-interval",
                "1",
            ],
            tmp_path,
            env=env,
        )
        for i in range(SUBSCRIBERS)
    ]
    for sub in subs:  # each starts beside the others' warm-ups (2-3 CPU-s each on a slow 2-core machine)
        sub.start_timeout = 60.0
    repo = weightsync.open_repo(url)
    stop_gc = threading.Event()
    gc_runs, gc_errors = [], []

    def collector() -> None:
        while not stop_gc.wait(0.5):
            try:
                if repo.check():
                    gc_runs.append(gc(repo, GcConfig(keep=4, grace_seconds=GRACE)))
            except WeightsyncError as exc:  # e.g. a manifest deleted under a concurrent listing
                gc_errors.append(exc)

    everyone = [*pubs.values(), *subs]
    gc_thread = threading.Thread(target=collector, daemon=True)
    try:
        with ThreadPoolExecutor(8) as pool:  # inside the try: one that fails to start stops them all
            list(pool.map(Daemon.start, everyone))
        gc_thread.start()
        for i in range(STEPS):  # both trainers finish step i at once: the publishers race for it
            for steps in ckpts.values():
                (steps[i] / "COMPLETE").write_text("")
            time.sleep(0.3)
        wait_for(lambda: repo.head_version() == STEPS - 1, 60, "the last version")
        head = STEPS - 1
        for sub in subs:
            sub.wait_version(head, timeout=60)
        stop_gc.set()
        gc_thread.join(30)
        for sub in subs:
            m = sub.get("/metrics")[1]
            assert metric(m, "weightsync_checksum_failures_total") == 0, sub.log()
    finally:
        stop_gc.set()
        codes = stop_all(everyone)
    assert set(codes.values()) == {0}, codes
    age_past_grace(repo, backend, tmp_path / "store")  # the losers' and old versions' chunks age ...
    gc_runs.append(gc(repo, GcConfig(keep=4, grace_seconds=GRACE)))  # ... and one more gc collects them

    published = {name: logged(p.log(), "published version") for name, p in pubs.items()}
    assert not set(published["a"]) & set(published["b"]), f"a version published twice: {published}"
    assert sorted(published["a"] + published["b"]) == list(range(STEPS)), f"a version lost: {published}"
    owner = {v: name for name, vs in published.items() for v in vs}
    kept = repo.versions()
    assert kept[-1] == head and len(gc_runs) > 0 and not gc_errors, (kept, gc_errors)
    assert sum(r.deleted_chunks for r in gc_runs) > 0, "gc never collected a chunk: the race was not exercised"
    for v in kept:
        out = tmp_path / f"check-{v}"
        weightsync.pull(repo, out, v, config=weightsync.PullConfig(fsync=False))
        assert content(out) == content(ckpts[owner[v]][v]), f"version {v} is not {owner[v]}'s step {v}"
    expected = content(ckpts[owner[head]][head])
    for sub in subs:
        assert content(Path(sub.args[sub.args.index("--target") + 1]) / "current") == expected
        swaps = logged(sub.log(), "swapped to version")
        assert swaps == sorted(set(swaps)) and swaps[-1] == head, (
            f"{sub.log_path.name} went backwards or twice: {swaps}"
        )
    assert sum(r.deleted_versions.__len__() for r in gc_runs) > 0, "gc never collected anything"


def test_a_subscriber_left_behind_by_gc_catches_up(tmp_path):
    """A subscriber follows versions 0..5 (keyframes every 3), is pinned back to 1 and then 0, and
    stays there while 6 and 7 are published and gc keeps only 6 and 7. Following the head again, it
    must build 7 from what the store still holds, not from the manifests it read before gc deleted
    them (their chunks are gone)."""
    store = tmp_path / "store"
    trainer, ckpts = SyntheticTrainer(seed=0, **TINY), []
    for i in range(8):
        if i:
            trainer.step()
        ckpts.append(trainer.save(tmp_path / "ckpt" / f"step_{i}"))
    cfg = weightsync.PublishConfig(keyframe_interval=3)
    sub = Daemon("subscriber", ["--store", store, "--target", tmp_path / "sub", "--no-fsync"], tmp_path)
    for i in range(6):
        weightsync.publish(ckpts[i], store, config=cfg)
        if i == 0:
            sub.start()
        sub.wait_version(i)
    try:
        for pin in (1, 0):  # current 0, standby 1: both older than anything gc keeps
            sub.put_target(pin)
            sub.wait_version(pin)
        for i in (6, 7):
            weightsync.publish(ckpts[i], store, config=cfg)
        result = gc(weightsync.open_repo(store), GcConfig(keep=2, grace_seconds=0))
        assert result.deleted_versions == [0, 1, 2, 3, 4, 5]
        sub.put_target("latest")
        sub.wait_version(7, timeout=20)
        assert content(tmp_path / "sub" / "current") == content(ckpts[7])
    finally:
        assert sub.stop() == 0
