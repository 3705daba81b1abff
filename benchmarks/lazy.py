"""Bytes a fresh pull of the last version reads from a region whose mirror copied keyframe full
payloads lazily (docs/FORMAT.md section 1, lazy chunks): (a) rebuilt from the region's whole
keyframe plus deltas, (b) the noted chunks from the source store (fallback), (c) from a region
holding everything; and what a follower of the previous version reads. Keyframes every 2 and
every 5 versions; the region is mirrored version by version, keeping version 0 whole and every
later keyframe without its full payloads. File stores: bytes are what the pull reads, seconds the
CPU time of the pull (all threads; the machine is shared, so wall time says little).

    python benchmarks/lazy.py [--steps 6] [--intervals 2 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__:
    from . import common
else:  # run as a script from benchmarks/
    import common

common.ensure_repo_importable()

from weightsync.format.keys import version_key  # noqa: E402
from weightsync.local.verify import verify_folder  # noqa: E402
from weightsync.store.repo import Repo, open_repo  # noqa: E402
from weightsync.sync.lazy import LazyReads  # noqa: E402
from weightsync.sync.publish import PublishConfig, publish  # noqa: E402
from weightsync.sync.pull import PullConfig, pull  # noqa: E402

MB = 1e6


def full_only_chunks(repo: Repo, version: int) -> frozenset[str]:
    """The chunks of ``version`` only its full payloads use (what a lazy mirror leaves out)."""
    m = repo.manifest(version)
    full = {m.chunks[p.chunk].id for f in m.files for s in f.segments if s.codec == "full" for p in s.payload.parts}
    other = {
        m.chunks[p.chunk].id
        for f in m.files
        for s in f.segments
        if s.delta is not None and s.delta.payload is not None
        for p in s.delta.payload.parts
    }
    for v in repo.versions():
        if v != version:
            other |= {c.id for c in repo.manifest(v).chunks}
    return frozenset(full - other)


def mirror_lazily(src: Repo, dst: Repo) -> None:
    """Copy every version of ``src`` in commit order; keyframes with a parent: note their
    full-payload chunks and leave them out."""
    dst.init()
    for v in src.versions():
        m = src.manifest(v)
        left = full_only_chunks(src, v) if m.keyframe and m.parent is not None else frozenset()
        if left:
            dst.note_lazy_chunks(v, left)
        for ref in m.chunks:
            if ref.id not in left:
                dst.store_chunk(ref.id, ref.size, lambda ref=ref: src.get_chunk(ref.id, ref.size))
        dst.store.put(version_key(v), src.read_version(v, signatures=False)[0], mode="create")
        dst.set_head(v)


def chunk_bytes(repo: Repo) -> int:
    return sum(o.size for o in repo.store.list_meta("chunks/"))


def measure(region, out: Path, version: int, lazy: LazyReads | None = None, base: Path | None = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    if base is not None:
        shutil.copytree(base, out)
    t0 = time.process_time()
    r = pull(region, out, version, config=PullConfig(lazy=lazy or LazyReads(), fsync=False))
    seconds = time.process_time() - t0
    verify_folder(out, open_repo(region).manifest(version))
    return {"bytes": r.fetched_bytes, "fallback": r.fallback_bytes, "from": r.rebuilt_from, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="checkpoints of the lr 1e-6 trajectory (default 6)")
    ap.add_argument("--intervals", type=int, nargs="+", default=[2, 5])
    ap.add_argument("--workdir", help="where to put the stores (default: a temp dir, removed)")
    args = ap.parse_args()
    dirs = common.build_cached("moe-lr1e-06", 1e-6, args.steps)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="weightsync-lazy-"))
    last = len(dirs) - 1
    raw = sum(f.stat().st_size for f in dirs[last].iterdir() if f.is_file())
    print(f"trajectory: {len(dirs)} checkpoints of {raw / MB:.1f} MB (lr 1e-6); fresh pulls of version {last}")
    rows = []
    try:
        for k in args.intervals:
            root = work / f"k{k}"
            shutil.rmtree(root, ignore_errors=True)
            src = open_repo(root / "src")
            for i, d in enumerate(dirs):
                publish(d, src, config=PublishConfig(keyframe_interval=k), base_dir=dirs[i - 1] if i else None)
            region = open_repo(root / "region")
            mirror_lazily(src, region)
            keyframes = [v for v in src.versions() if src.manifest(v).keyframe]
            follower = root / "follower"
            pull(region, follower, last - 1, config=PullConfig(fsync=False))
            row = {
                "k": k,
                "keyframes": keyframes,
                "src": chunk_bytes(src),
                "region": chunk_bytes(region),
                "rebuild": measure(region, root / "out", last, LazyReads("rebuild")),
                "fallback": measure(region, root / "out", last, LazyReads("fallback", src)),
                "whole": measure(src, root / "out", last),
                "follower": measure(region, root / "out", last, base=follower),
            }
            rows.append(row)
            shutil.rmtree(root)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        "| keyframe every | keyframes | source chunks MB | region chunks MB | fresh pull: rebuild MB (CPU s) "
        "| fallback MB: region + source (CPU s) | whole region MB (CPU s) | follower MB (CPU s) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rb, fb, wh, fo = r["rebuild"], r["fallback"], r["whole"], r["follower"]
        print(
            f"| {r['k']} | {', '.join(map(str, r['keyframes']))} | {r['src'] / MB:.1f} | {r['region'] / MB:.1f} "
            f"({100 * r['region'] / r['src']:.0f}%) | {rb['bytes'] / MB:.1f} ({rb['seconds']:.1f}, from {rb['from']}) "
            f"| {(fb['bytes'] - fb['fallback']) / MB:.1f} + {fb['fallback'] / MB:.1f} ({fb['seconds']:.1f}) "
            f"| {wh['bytes'] / MB:.1f} ({wh['seconds']:.1f}) | {fo['bytes'] / MB:.2f} ({fo['seconds']:.1f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
