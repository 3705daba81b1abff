"""What an operator reads in the logs and sees at start-up: text log fields that ``key=value`` parsers
read whole; the publisher naming an unfinished checkpoint that holds back ready ones (once) and logging
the wait it really takes before retrying a failed publish; a mirror following an empty source waits
instead of exiting; an API on all interfaces without a token is warned about."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import shutil
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry
from test_daemons import daemons, wait_for  # noqa: F401  (daemons is a fixture)

import weightsync
from weightsync.demo import SyntheticTrainer
from weightsync.service.config import Backoff, Identity, PublisherConfig, StoreConfig
from weightsync.service.metrics import Metrics
from weightsync.service.publisher import Publisher
from weightsync.service.runtime import _TextFormatter

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)


def test_text_log_fields_with_blanks_are_quoted():
    record = logging.LogRecord("weightsync.x", logging.INFO, __file__, 1, "published version 3", None, None)
    record.fields = {"kind": "delta", "parent": 2, "size": "1.5 MiB", "error": 'a "b" = c', "empty": ""}
    line = _TextFormatter("%(message)s").format(record)
    assert line == 'published version 3 kind=delta parent=2 size="1.5 MiB" error="a \\"b\\" = c" empty=""'


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_the_publisher_reports_a_blocking_checkpoint_once_and_the_real_retry_wait(tmp_path, caplog):
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    t = SyntheticTrainer(**TINY, seed=0)
    t.save(watch / "step_0")  # no marker: unfinished
    for step in (1, 2):
        t.step()
        (t.save(watch / f"step_{step}") / "COMPLETE").write_text("")
    clock = Clock()
    cfg = PublisherConfig(StoreConfig(store), watch, tmp_path / "st", Identity("p"), backoff=Backoff(1.0, 60.0))
    pub = Publisher(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "publisher"), clock=clock)

    async def run(n: int) -> list[float]:
        pub._wake = asyncio.Event()
        return [await pub._iteration() for _ in range(n)]

    with caplog.at_level(logging.INFO, "weightsync.publisher"):
        asyncio.run(run(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checkpoint 0 to complete; ready checkpoint(s) 1, 2 wait behind it" in warnings[0]
    assert pub.status()["state"] == "waiting" and "--stale-after" in pub.status()["reason"]

    (watch / "step_0" / "COMPLETE").write_text("")
    (watch / "step_0" / "model.safetensors").write_bytes(b"\xff" * 16)  # a broken checkpoint: the publish fails
    caplog.clear()
    waits = []
    with caplog.at_level(logging.INFO, "weightsync.daemon"):
        for _ in range(3):
            wait = asyncio.run(run(1))[0]
            waits.append(wait)
            clock.now += wait  # the loop sleeps that long, then plans: the failed step is due exactly then
    assert waits == [1.0, 2.0, 4.0], waits  # the step's own back-off, doubling
    logged = [r.fields["retry_in"] for r in caplog.records if r.getMessage() == "iteration failed"]
    assert logged == ["1.0s", "2.0s", "4.0s"]
    # the error names the step's folder, not only the file in it
    assert pub.status()["last_error"].startswith(f"CheckpointError: checkpoint {watch / 'step_0'}: model.safetensors")


def test_a_step_whose_version_a_hand_publish_took_is_reported_not_passed_over(tmp_path, caplog):
    """``POST /v1/publish`` of an older folder gives it the head + 1, the next step's number: when the
    trainer finished that step, the watcher took it for published, logged nothing and said "version
    2 is the newest checkpoint" while version 2 held step 0's bytes."""
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    t = SyntheticTrainer(**TINY, seed=0)
    for step in (0, 1):
        (t.save(watch / f"step_{step}") / "COMPLETE").write_text("")
        t.step()
    cfg = PublisherConfig(StoreConfig(store), watch, tmp_path / "st", Identity("p"))
    pub = Publisher(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "publisher"))

    async def run() -> None:
        pub._wake = asyncio.Event()
        for _ in range(3):
            await pub._iteration()
        assert (await pub.publish_request(str(watch / "step_0"), None)).version == 2
        (t.save(watch / "step_2") / "COMPLETE").write_text("")
        for _ in range(2):
            await pub._iteration()

    with caplog.at_level(logging.INFO, "weightsync.publisher"):
        asyncio.run(run())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith(f"checkpoint {watch / 'step_2'} is not published: its version")
    assert pub.status()["last_error"] == errors[0]


def test_a_marker_with_content_is_published_an_empty_one_is_not(tmp_path):
    """``--marker model.safetensors.index.json`` (the file ``save_pretrained`` writes last) was left
    out of every version without a word: pulled folders lacked the index."""
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    t = SyntheticTrainer(**TINY, seed=0)
    index = b'{"weight_map": {}}'
    for step, marker in ((0, b""), (1, index)):
        (t.save(watch / f"step_{step}") / "index.json").write_bytes(marker)
        t.step()
    cfg = PublisherConfig(StoreConfig(store), watch, tmp_path / "st", Identity("p"), marker="index.json")
    cfg = dataclasses.replace(cfg, publish=dataclasses.replace(cfg.publish, ignore=("index.json",)))
    pub = Publisher(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "publisher"))

    async def run() -> None:
        pub._wake = asyncio.Event()
        for _ in range(3):
            await pub._iteration()

    asyncio.run(run())
    repo = weightsync.open_repo(store)
    assert "index.json" not in {f.path for f in repo.manifest(0).files}
    assert "index.json" in {f.path for f in repo.manifest(1).files}
    weightsync.pull(store, tmp_path / "out", 1)
    assert (tmp_path / "out" / "index.json").read_bytes() == index


def test_a_missing_watched_folder_is_said_once_and_one_that_becomes_a_file_is_one_line(tmp_path, caplog):
    """A mistyped --watch looked like "no checkpoint to publish" with nothing logged; a watched folder
    replaced by a file logged a traceback every poll."""
    store, watch = f"file://{tmp_path / 'store'}", tmp_path / "watch"
    cfg = PublisherConfig(StoreConfig(store), watch, tmp_path / "st", Identity("p"))
    pub = Publisher(cfg, weightsync.open_repo(store), Metrics(CollectorRegistry(), "publisher"))

    async def run(n: int) -> None:
        pub._wake = asyncio.Event()
        for _ in range(n):
            await pub._iteration()

    with caplog.at_level(logging.INFO, "weightsync"):
        asyncio.run(run(3))
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == [f"the watched folder {watch} does not exist: waiting for it (is --watch right?)"]
        assert pub.status()["state"] == "idle"
        assert pub.status()["reason"] == f"the watched folder {watch} does not exist"
        watch.mkdir()
        asyncio.run(run(1))
        assert pub.status()["reason"] == "no checkpoint to publish"
        watch.rmdir()
        watch.write_text("")
        caplog.clear()
        asyncio.run(run(2))
    assert pub.status()["last_error"] == f"CheckpointError: the watched folder {watch} is not a directory"
    assert not [r for r in caplog.records if r.exc_info]  # no traceback

    async def poll_pending() -> None:  # the daemon's look at pending checkpoints between iterations
        with contextlib.suppress(asyncio.TimeoutError):
            # still looking after 0.5 s; it used to die of the file at its first look, and the daemon
            # then stopped with exit code 1 and a traceback
            await asyncio.wait_for(pub._list_pending(), 0.5)

    pub.cfg = dataclasses.replace(cfg, poll_interval=0.05)
    asyncio.run(poll_pending())

    # back with a checkpoint, then gone again: said again
    watch.unlink()
    (SyntheticTrainer(**TINY, seed=0).save(watch / "step_0") / "COMPLETE").write_text("")
    caplog.clear()
    with caplog.at_level(logging.INFO, "weightsync"):
        asyncio.run(run(2))
        shutil.rmtree(watch)
        asyncio.run(run(1))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"the watched folder {watch} does not exist: waiting for it (is --watch right?)"]


def test_a_following_mirror_waits_for_an_empty_source(tmp_path):
    src, dst, log = tmp_path / "src", tmp_path / "dst", tmp_path / "mirror.log"
    src.mkdir()
    cmd = [sys.executable, "-m", "weightsync.cli", "mirror", "--from", str(src), "--to", str(dst), "--follow"]
    with open(log, "w") as err:
        proc = subprocess.Popen([*cmd, "--interval", "0.1"], stderr=err, stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "waiting for the source" in log.read_text(), 30, "the mirror to wait")
        time.sleep(0.5)  # several polls
        assert proc.poll() is None, log.read_text()
        t = SyntheticTrainer(**TINY, seed=0)
        weightsync.publish(t.save(tmp_path / "c0"), str(src), 0)
        wait_for(lambda: (dst / "HEAD").exists(), 30, "the mirror to copy version 0")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert (
        len(re.findall(r"INFO weightsync\.mirror: waiting for the source: .* is not a weightsync store yet", text)) == 1
    )
    assert "mirrored version 0" in text and out.strip() == "0"


def test_a_daemon_whose_port_is_taken_exits_without_starting(tmp_path, run_cli):
    """A subscriber whose --listen port was taken logged "started" and wrote its fleet record, which
    ``fleet --all`` listed as a stopped subscriber, before it exited 1."""
    import socket

    store = tmp_path / "store"
    weightsync.publish(SyntheticTrainer(**TINY, seed=0).save(tmp_path / "c0"), str(store), 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--store", store, "--target", tmp_path / "t", "--id", "s1", "--listen", f"127.0.0.1:{port}"]
        rc, _, err = run_cli("subscriber", *args)
    assert rc == 1 and "address already in use" in err.splitlines()[-1], err
    assert "started" not in err and not (tmp_path / "t" / "current").exists()
    rc, out, _ = run_cli("fleet", "--store", store, "--all", "--json")
    assert rc == 0 and json.loads(out)["subscribers"] == [], out


def test_an_api_on_all_interfaces_without_a_token_is_warned_about(tmp_path, daemons):  # noqa: F811
    store = tmp_path / "store"
    weightsync.publish(SyntheticTrainer(**TINY, seed=0).save(tmp_path / "c0"), str(store), 0)
    sub = daemons("subscriber", ["--store", store, "--target", tmp_path / "t", "--no-fsync"])
    assert "without a token" not in sub.log()
    sub.stop()
    log = tmp_path / "open.log"
    argv = [
        sys.executable,
        "-m",
        "weightsync.cli",
        "subscriber",
        "--store",
        str(store),
        "--target",
        str(tmp_path / "t"),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen([*argv, "--listen", "0.0.0.0:0"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "without a token" in log.read_text(), 20, "the warning")
        assert "WARNING weightsync.daemon: the API listens on 0.0.0.0 without a token" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
