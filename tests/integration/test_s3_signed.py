"""Signed versions on a real SeaweedFS: ``weightsync publish --signing-key`` and ``pull``/``verify
--trusted-key`` as real processes against ``s3://``; an object written into the bucket without the
key is refused, and the folder keeps its version."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import boto3
import pytest
from procs import finish, spawn_cli

import weightsync
from weightsync.demo import make_trajectory

pytestmark = pytest.mark.integration


def content(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.relative_to(root).as_posix().startswith(".weightsync")
    }


def cli(*args, env) -> tuple[int, str, str]:
    return finish(spawn_cli(*args, env=env), timeout=180)


def test_signed_publish_and_verified_pull_over_s3(s3_url, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    traj = make_trajectory(tmp_path / "traj", steps=2, hidden=32, layers=1, experts=2, vocab=128)
    rc, key_id, err = cli("keygen", tmp_path / "k", env=env)
    assert rc == 0, err
    for ckpt in traj[:2]:
        rc, _, err = cli("publish", ckpt, "--store", s3_url, "--signing-key", tmp_path / "k", env=env)
        assert rc == 0, err
    bucket, prefix = s3_url[len("s3://") :].split("/", 1)
    s3 = boto3.client("s3")
    listed = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/signatures/")["Contents"]}
    assert listed == {f"{prefix}/signatures/{v:020d}.json" for v in (0, 1)}
    out, trusted = tmp_path / "out", ["--trusted-key", f"{tmp_path / 'k'}.pub"]
    rc, stdout, err = cli("pull", "--store", s3_url, *trusted, out, "--no-progress", env=env)
    assert (rc, stdout) == (0, "1\n"), err
    assert content(out) == content(traj[1])
    rc, _, err = cli("verify", "--store", s3_url, *trusted, out, env=env)
    assert rc == 0, err
    assert weightsync.open_repo(s3_url, trusted_keys=[f"{tmp_path / 'k'}.pub"]).manifest(1).version == 1

    # someone with write access to the bucket but not the key commits version 2
    weightsync.publish(traj[2], s3_url)
    rc, _, err = cli("pull", "--store", s3_url, *trusted, out, "--no-progress", env=env)
    assert rc == 1 and err.strip().endswith(f"refused, it is not signed (trusted key {key_id.strip()})"), err
    assert content(out) == content(traj[1])
    rc, _, err = cli("verify", "--store", s3_url, *trusted, out, env=env)
    assert rc == 3 and "version 2" in err
