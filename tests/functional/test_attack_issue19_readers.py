"""Hostile review of issue 19's lazy readers and mirror chains on file stores: a fallback store of
another lineage, a note on an intermediate keyframe's own delta payload, a rollback in a lazy region,
a region mirrored eagerly from a region that never copied its keyframes' payloads. Each reader ends
with the checkpoint's bytes or a one-line error with nothing installed."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
from lazy_region import copy_version

from weightsync.demo import make_trajectory
from weightsync.errors import WeightsyncError
from weightsync.format.keys import chunk_key
from weightsync.store.repo import open_repo
from weightsync.sync.lazy import LazyReads
from weightsync.sync.mirror import MirrorConfig, mirror
from weightsync.sync.publish import PublishConfig, publish
from weightsync.sync.pull import PullConfig, pull

TINY = dict(hidden=32, layers=1, experts=2, vocab=128)
LAST = 6
LAZY = (2, 4, 6)  # keyframes every 2 versions; the region holds 0 whole


def publish_traj(traj, url):
    src = open_repo(url)
    for i, ckpt in enumerate(traj):
        publish(ckpt, src, config=PublishConfig(keyframe_interval=2), base_dir=traj[i - 1] if i else None)
    return src


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("attack-lazy")
    traj = make_trajectory(root / "traj", steps=LAST, **TINY)
    src = publish_traj(traj, root / "src")
    region = open_repo(root / "region")
    for v in src.versions():
        copy_version(src, region, v, lazy=v in LAZY)
    other = make_trajectory(root / "other-traj", steps=LAST, **(TINY | {"seed": 7}))
    publish_traj(other, root / "other")  # another lineage: same version numbers, other bytes
    return root, traj


@pytest.fixture
def lazy(template, tmp_path):
    root, traj = template
    for name in ("src", "region", "other"):
        shutil.copytree(root / name, tmp_path / name)
    return types.SimpleNamespace(
        src=f"file://{tmp_path / 'src'}",
        region=f"file://{tmp_path / 'region'}",
        other=f"file://{tmp_path / 'other'}",
        traj=traj,
        tmp=tmp_path,
    )


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def nothing_installed(folder: Path) -> bool:
    return not folder.exists() or not any(p.suffix == ".safetensors" for p in folder.iterdir())


def collect_keyframe_zero(lazy) -> None:
    """The region's only whole keyframe is gone: a fresh reader cannot rebuild."""
    region = open_repo(lazy.region)
    for c in region.manifest(0).chunks:
        if c.id not in {r.id for v in range(1, LAST + 1) for r in region.manifest(v).chunks}:
            region.store.delete(chunk_key(c.id))
    region.store.delete("versions/%020d.json" % 0)


def test_a_fallback_store_of_another_lineage_is_one_line_and_installs_nothing(lazy, run_cli, ws):
    collect_keyframe_zero(lazy)
    out = lazy.tmp / "out"
    rc, stdout, stderr = run_cli(
        "pull", out, "--store", lazy.region, "--version", LAST, "--lazy-chunks", "fallback",
        "--fallback-store", lazy.other,
    )  # fmt: skip
    assert rc != 0, stdout
    ws.error_line(stderr)
    assert nothing_installed(out)


def test_a_fallback_store_of_another_lineage_is_never_read_for_bytes_of_the_same_version_number(lazy):
    """With ``auto`` and a whole keyframe here, the region's own bytes serve; the other lineage's
    fallback is never trusted for a version number it also has."""
    out = lazy.tmp / "out"
    pull(lazy.region, out, LAST, config=PullConfig(lazy=LazyReads("auto", open_repo(lazy.other))))
    assert files_of(out) == files_of(lazy.traj[LAST])


def test_a_note_on_an_intermediate_keyframes_delta_payload_reads_it_from_the_fallback(lazy):
    region = open_repo(lazy.region)
    m = region.manifest(2)
    deltas = {m.chunks[p.chunk].id for f in m.files for s in f.segments if s.delta and s.delta.payload
              for p in s.delta.payload.parts}  # fmt: skip
    assert deltas
    region.note_lazy_chunks(2, region.lazy_chunks(2) | deltas)
    for c in deltas:
        region.store.delete(chunk_key(c))
    out = lazy.tmp / "out"
    with pytest.raises(WeightsyncError):  # no fallback: 0 + deltas needs keyframe 2's delta
        pull(lazy.region, out, 3, config=PullConfig(lazy=LazyReads("rebuild")))
    assert nothing_installed(out)
    pull(lazy.region, out, 3, config=PullConfig(lazy=LazyReads("auto", open_repo(lazy.src))))
    assert files_of(out) == files_of(lazy.traj[3])


def test_rollback_pulls_in_a_lazy_region_give_each_versions_bytes(lazy):
    out = lazy.tmp / "out"
    pull(lazy.region, out, LAST)
    for v in (5, 2, 1, 4, 0, 6, 3):  # back and forth across lazy keyframes
        pull(lazy.region, out, v)
        assert files_of(out) == files_of(lazy.traj[v]), v


def test_a_region_mirrored_eagerly_from_a_region_that_never_copied_keyframe_payloads(lazy, run_cli, ws):
    """The second region's eager mirror cannot get keyframe 2's full payloads from the first: it must
    end in one line (or commit with a note of its own), never commit a torn version."""
    dst = f"file://{lazy.tmp / 'second'}"
    rc, stdout, stderr = run_cli("mirror", "--from", lazy.region, "--to", dst, "--keyframe-payloads", "eager")
    second = open_repo(dst)
    if rc != 0:
        last = stderr.splitlines()[-1]
        assert last.startswith("weightsync: error:"), stderr
        head = second.head_version() if second.check() else None
        assert head is None or head < 2, head
        return
    out = lazy.tmp / "out"
    pull(dst, out, LAST, config=PullConfig(lazy=LazyReads("auto", open_repo(lazy.src))))
    assert files_of(out) == files_of(lazy.traj[LAST])


def test_a_lazy_mirror_of_a_lazy_region_serves_a_fresh_reader(lazy):
    second = open_repo(lazy.tmp / "second")
    res = mirror(open_repo(lazy.region), second, config=MirrorConfig(keyframe_payloads="lazy"))
    assert res.head == LAST
    out = lazy.tmp / "out"
    pull(second, out, LAST)
    assert files_of(out) == files_of(lazy.traj[LAST])


def test_an_eager_mirror_of_a_lazy_region_carries_its_notes_on(lazy, run_cli):
    """A lazy region as the source of another mirror, even an eager one: the chunks the source never
    copied are noted at the destination too (they cannot be copied from there), every version is
    committed, and readers of the second region rebuild or read the first region's source."""
    dst = f"file://{lazy.tmp / 'second'}"
    rc, _, stderr = run_cli("mirror", "--from", lazy.region, "--to", dst, "--keyframe-payloads", "eager")
    assert rc == 0, stderr
    region, second = open_repo(lazy.region), open_repo(dst)
    assert second.head_version() == LAST
    for v in LAZY:
        assert second.lazy_chunks(v) == region.lazy_chunks(v) != frozenset()
    out = lazy.tmp / "out"
    pull(second, out, LAST)  # rebuilt from keyframe 0, which both regions hold whole
    assert files_of(out) == files_of(lazy.traj[LAST])
    pull(second, lazy.tmp / "fb", LAST, config=PullConfig(lazy=LazyReads("fallback", open_repo(lazy.src))))
    assert files_of(lazy.tmp / "fb") == files_of(lazy.traj[LAST])
