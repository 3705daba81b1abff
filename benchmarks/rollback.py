"""Bytes a rollback fetches: a folder holding a version pulls an older one, planned as before
(from the target's keyframe, reusing unchanged tensors: ``PullConfig(backward=False)``) and by
undoing the deltas between them where their codec is invertible (``ans``, the default,
``sparse`` and ``dense``; ``ac`` is not). The lr 1e-6 trajectory published with ``ans``, with
``sparse`` (``--fast-codec``) and with ``ac`` deltas, a keyframe every ``--intervals`` versions.
File stores: bytes are what the pull reads, seconds the CPU time of the pull (all threads; the
machine is shared).

    python benchmarks/rollback.py [--steps 6] [--intervals 20 3] [--pairs 5:4 5:3 4:2] [--workdir DIR]
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

from weightsync.codec.payload import CodecConfig  # noqa: E402
from weightsync.local.verify import verify_folder  # noqa: E402
from weightsync.store.repo import open_repo  # noqa: E402
from weightsync.sync.publish import PublishConfig, publish  # noqa: E402
from weightsync.sync.pull import PullConfig, pull  # noqa: E402

MB = 1e6
CODECS = {"ans": CodecConfig(), "sparse": CodecConfig(entropy_coder=False), "ac": CodecConfig(coder="ac")}


def delta_bytes(repo, version: int, reverse: bool) -> int:
    """The bytes of the chunks holding ``version``'s deltas (a keyframe's own deltas, not its full
    payloads), or with ``reverse`` their reverse payloads (``ans``'s exception lists, in chunks of
    their own: only a rollback reads them)."""
    m = repo.manifest(version)
    ids = set()
    for f in m.files:
        for s in f.segments:
            enc = s.delta if s.codec == "full" else s
            p = None if enc is None or enc.payload is None else enc.payload.reverse if reverse else enc.payload
            if p is not None:
                ids.update(m.chunks[x.chunk].id for x in p.parts)
    return sum(c.size for c in m.chunks if c.id in ids)


def rollback(store: Path, held: Path, out: Path, target: int, backward: bool) -> dict:
    """Pull ``target`` into a copy of ``held`` (a folder holding a newer version)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(held, out)
    t0 = time.process_time()
    r = pull(store, out, target, config=PullConfig(backward=backward, fsync=False))
    seconds = time.process_time() - t0
    verify_folder(out, open_repo(store).manifest(target))  # byte for byte the version
    return {"bytes": r.fetched_bytes, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="checkpoints of the lr 1e-6 trajectory (default 6)")
    ap.add_argument("--intervals", type=int, nargs="+", default=[20, 3], help="keyframe intervals (default 20 3)")
    ap.add_argument("--pairs", nargs="+", default=["5:4", "5:3", "4:2"], help="rollbacks FROM:TO (default 5:4 5:3 4:2)")
    ap.add_argument("--workdir", help="where to put the stores (default: a temp dir, removed)")
    args = ap.parse_args()
    pairs = [tuple(map(int, p.split(":"))) for p in args.pairs]
    dirs = common.build_cached("moe-lr1e-06", 1e-6, args.steps)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="weightsync-rollback-"))
    raw = sum(f.stat().st_size for f in dirs[0].iterdir() if f.is_file())
    print(f"trajectory: {len(dirs)} checkpoints of {raw / MB:.1f} MB (lr 1e-6)")
    rows = []
    try:
        for k in args.intervals:
            for name, codec in CODECS.items():
                root = work / f"{name}-k{k}"
                shutil.rmtree(root, ignore_errors=True)
                store = root / "store"
                cfg = PublishConfig(codec=codec, keyframe_interval=k)
                for i, d in enumerate(dirs):
                    publish(d, store, i, config=cfg, base_dir=dirs[i - 1] if i else None)
                repo = open_repo(store)
                keyframes = [v for v in repo.versions() if repo.manifest(v).keyframe]
                held: dict[int, Path] = {}
                for src, dst in pairs:
                    if src not in held:
                        held[src] = root / f"held-{src}"
                        pull(store, held[src], src, config=PullConfig(fsync=False))
                    delta = sum(delta_bytes(repo, v, False) for v in range(dst + 1, src + 1))
                    reverse = sum(delta_bytes(repo, v, True) for v in range(dst + 1, src + 1))
                    rows.append(
                        {
                            "codec": name,
                            "k": k,
                            "keyframes": keyframes,
                            "pair": (src, dst),
                            "stored": delta,
                            "reverse": reverse,
                            "before": rollback(store, held[src], root / "out", dst, False),
                            "after": rollback(store, held[src], root / "out", dst, True),
                        }
                    )
                shutil.rmtree(root)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        "| deltas | keyframe every (keyframes) | rollback | delta chunks of the versions left MB "
        "| their reverse chunks MB | before: from the keyframe MB (CPU s) | after: deltas undone MB (CPU s) "
        "| after / before |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        b, a = r["before"], r["after"]
        print(
            f"| {r['codec']} | {r['k']} ({', '.join(map(str, r['keyframes']))}) | {r['pair'][0]} -> {r['pair'][1]} "
            f"| {r['stored'] / MB:.2f} | {r['reverse'] / MB:.3f} | {b['bytes'] / MB:.2f} ({b['seconds']:.1f}) "
            f"| {a['bytes'] / MB:.2f} ({a['seconds']:.1f}) | {a['bytes'] / b['bytes']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
