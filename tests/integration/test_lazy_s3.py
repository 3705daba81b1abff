"""A region on a real SeaweedFS whose mirror copied keyframe full payloads lazily (docs/FORMAT.md
section 1): fresh pulls rebuild from its whole keyframe, or read the noted chunks (whole, or as
ranges) from the source store on S3; a source that lies is refused; a fallback store that cannot
be reached does not hold up a pull that does not need it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from lazy_region import copy_version, stored_bytes
from procs import finish, spawn_cli

from weightsync.demo import make_trajectory
from weightsync.errors import ChecksumError
from weightsync.format.keys import chunk_key
from weightsync.store.repo import open_repo
from weightsync.sync.lazy import LazyReads
from weightsync.sync.publish import PublishConfig, publish
from weightsync.sync.pull import PullConfig, pull
from weightsync.sync.selection import Selection, materialize, verify_partial

pytestmark = pytest.mark.integration

TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_lazy_region_on_s3(s3_url, tmp_path):
    traj = make_trajectory(tmp_path / "traj", steps=5, shards=2, **TINY)
    src_url, region_url = f"{s3_url}/src", f"{s3_url}/region"
    src, region = open_repo(src_url), open_repo(region_url)
    for i, ckpt in enumerate(traj):
        publish(ckpt, src, config=PublishConfig(keyframe_interval=2), base_dir=traj[i - 1] if i else None)
    for v in src.versions():
        copy_version(src, region, v, lazy=v in (2, 4))
    assert stored_bytes(region) <= stored_bytes(src) / 2
    last = 5

    # rebuilt from keyframe 0 (the default), with an unreachable fallback store it never needs
    dead = f"http://127.0.0.1:{dead_port()}"
    rc, out, err = finish(
        spawn_cli(
            "pull",
            "--store",
            region_url,
            tmp_path / "a",
            "--fallback-store",
            src_url,
            "--fallback-endpoint-url",
            dead,
            "--no-progress",
        )  # fmt: skip
    )
    assert rc == 0 and "rebuilt from keyframe 0" in err, err
    assert files_of(tmp_path / "a") == files_of(traj[last])

    # a follower of version 1 crosses both lazy keyframes on their deltas
    pull(region, tmp_path / "f", 1)
    r = pull(region, tmp_path / "f", last)
    assert (r.rebuilt_from, r.fallback_bytes) == (None, 0)
    assert files_of(tmp_path / "f") == files_of(traj[last])

    # the noted chunks from the source store on S3: whole (a pull), ranges (a partial pull)
    rc, out, err = finish(
        spawn_cli(
            "pull",
            "--store",
            region_url,
            tmp_path / "b",
            "--lazy-chunks",
            "fallback",
            "--fallback-store",
            src_url,
            "--no-progress",
        )  # fmt: skip
    )
    assert rc == 0 and f"of it from {src_url}" in err, err
    assert files_of(tmp_path / "b") == files_of(traj[last])
    cfg = PullConfig(lazy=LazyReads("fallback", src))
    sel = Selection(include=("lm_head*",))
    assert materialize(region, tmp_path / "p", last, sel, config=cfg).version == last
    assert verify_partial(region, tmp_path / "p") == last

    # a source that lies under the chunk's id is refused, whole or in ranges; nothing installed
    (c,) = region.lazy_chunks(4)
    good = src.store.get(chunk_key(c))
    src.store.put(chunk_key(c), bytes(b ^ 0x01 for b in good), mode="overwrite")
    rc, out, err = finish(
        spawn_cli(
            "pull", "--store", region_url, tmp_path / "c", "--lazy-chunks", "fallback", "--fallback-store", src_url
        )  # fmt: skip
    )
    assert rc == 1 and "checksum mismatch" in err and src_url in err, err
    assert not (tmp_path / "c").exists() or files_of(tmp_path / "c") == {}
    with pytest.raises(ChecksumError):
        materialize(
            region, tmp_path / "q", last, sel, config=PullConfig(lazy=LazyReads("fallback", open_repo(src_url)))
        )
    assert files_of(tmp_path / "q") == {}
