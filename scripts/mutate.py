"""A mutation check of the regressions that matter (issue 22): each mutation below breaks one
guarantee by hand (a check removed, a comparison weakened), and the tests named with it must
fail. Run from the repository root::

    python scripts/mutate.py                  # every mutation against this tree
    python scripts/mutate.py --tree ../main   # the package and tests of another checkout
    python scripts/mutate.py -m tiling        # only mutations whose name holds "tiling"

The package is copied once into a scratch folder put first on ``PYTHONPATH`` (subprocesses the
tests start inherit it); each mutation edits that copy, runs its tests with ``-x`` and a timeout,
and restores the file with its modification time (numba's cache stays valid). A mutation is
*caught* when its tests fail (pytest exit 1), *not caught* when they pass or are missing, and
*n/a* when its text is not in the tree (another version of the code). Prints a table and
``caught/total``; exits 1 if any applicable mutation was not caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mutation:
    """``old`` (or the first of several spellings found) replaced by ``new`` in ``file`` (relative to
    the package's parent); ``tests``: pytest arguments (files, node ids, ``-k`` expressions)."""

    name: str
    file: str
    old: str | tuple[str, ...]
    new: str
    tests: tuple[str, ...]


CODEC = ("tests/unit/test_codec.py",)
FORMAT = ("tests/unit/test_format.py",)
PLAN = ("tests/unit/test_subscriber_plan.py", "-k", "plan_next")
HOSTILE_PULL = ("tests/functional/test_hostile.py", "-k", "corrupt_chunk_downloaded or corrupt_range")

MUTATIONS = [
    # --- codecs
    Mutation(
        "sparse: gap width check",
        "weightsync/codec/sparse.py",
        "if gw not in (1, 2, 4) or not 0 < k",
        "if not 0 < k",
        (*CODEC, "-k", "sparse"),
    ),
    Mutation(
        "sparse: positions past the block",
        "weightsync/codec/sparse.py",
        "        if done < k:\n",
        "        if False:\n",
        (*CODEC, "-k", "sparse"),
    ),
    Mutation(
        "zstd: declared frame size",
        "weightsync/codec/streams.py",
        "    if declared != expected:\n",
        "    if False:\n",
        (*CODEC, "-k", "hostile or garbage or truncat or bomb"),
    ),
    Mutation(
        "codec: result checksum",
        "weightsync/codec/payload.py",
        "    if actual != xxh3:\n        raise ChecksumError(what, xxh3, actual)\n",
        "",
        (*CODEC, "-k", "rebuild or checksum"),
    ),
    # --- manifest validation
    Mutation(
        "manifest: segments tile the file",
        "weightsync/format/manifest.py",
        "        if s.begin != pos:\n",
        "        if False:\n",
        FORMAT,
    ),
    Mutation(
        "manifest: part inside its chunk",
        "weightsync/format/manifest.py",
        "off + length <= chunks[ci].size",
        "off <= chunks[ci].size",
        FORMAT,
    ),
    Mutation(
        "manifest: own checksum",
        "weightsync/format/manifest.py",
        '    if doc.get("checksum") != checksum:\n',
        "    if False:\n",
        FORMAT,
    ),
    Mutation(
        "manifest: keyframe holds full segments",
        "weightsync/format/manifest.py",
        'if keyframe and any(s.codec != "full"',
        'if False and any(s.codec != "full"',
        FORMAT,
    ),
    Mutation(
        "manifest: segment range holds its shape",
        "weightsync/format/manifest.py",
        "if end < begin or count * ITEMSIZE[dtype] != end - begin:",
        "if end < begin:",
        FORMAT,
    ),
    # --- paths
    Mutation(
        "paths: '..' components",
        "weightsync/format/keys.py",
        'any(p in ("", ".", "..") for p in parts)',
        'any(p in ("", ".") for p in parts)',
        FORMAT,
    ),
    Mutation(
        "paths: no file under a file",
        "weightsync/format/manifest.py",
        "            if sub is None:\n",
        "            if False:\n",
        FORMAT,
    ),
    Mutation(
        "paths: .weightsync is reserved",
        "weightsync/format/keys.py",
        '        or parts[0] == ".weightsync"\n',
        "",
        FORMAT,
    ),
    # --- checksums on the pull path
    Mutation(
        "checksum: chunk against its id",
        "weightsync/store/repo.py",
        "    if actual != chunk_id:\n",
        "    if False:\n",
        HOSTILE_PULL,
    ),
    Mutation(
        "checksum: payload read from ranges",
        "weightsync/sync/rebuild.py",
        '        check_checksum(f"payload of version {step.version} in {self.url}/{keys}", step.xxh3, buf)\n',
        "",
        HOSTILE_PULL,
    ),
    Mutation(
        "checksum: ranged GET length",
        "weightsync/sync/transfer.py",
        "        if len(data) != n:\n",
        "        if False:\n",
        ("tests/functional/test_hostile.py", "-k", "damaged_store_objects and truncated"),
    ),
    # --- auth
    Mutation(
        "auth: bearer token compared",
        "weightsync/service/api.py",
        "if expected is not None and (request.path",
        "if False and (request.path",
        ("tests/functional/test_security.py", "-k", "token"),
    ),
    # --- head compare-and-swap
    Mutation(
        "head: never moved back after a lost race",
        "weightsync/store/repo.py",
        ("                if current is not None and current > v:\n", "current > manifest.version:\n"),
        "                if False:\n",
        ("tests/unit/test_repo.py",),
    ),
    Mutation(
        "head: a version below it is refused",
        "weightsync/store/repo.py",
        "        if head is not None and head > v:\n",
        "        if False:\n",
        ("tests/unit/test_repo.py",),
    ),
    # --- gc
    Mutation(
        "gc: grace period",
        "weightsync/sync/gc.py",
        "(age is not None and age < grace)",
        "(age is not None and age > grace)",
        ("tests/functional/test_mirror_gc.py", "-k", "gc"),
    ),
    Mutation(
        "gc: keeps the newest versions",
        "weightsync/sync/gc.py",
        "        if self.keep < 1:\n",
        "        if False:\n",
        ("tests/functional/test_bad_input.py", "-k", "gc_keeps"),
    ),
    # --- the subscriber's decisions
    Mutation(
        "subscriber: stop before the swap",
        "weightsync/service/subscriber.py",
        "        if self.stop_token.is_set:\n            self.view = View(self.view.current, version)\n",
        "        if False:\n            self.view = View(self.view.current, version)\n",
        ("tests/functional/test_subscriber_edges.py",),
    ),
    Mutation(
        "subscriber: pin above the head waits",
        "weightsync/service/subscriber.py",
        "    if desired > head:\n",
        "    if desired > head + 1:\n",
        (*PLAN, "tests/functional/test_subscriber_edges.py"),
    ),
    Mutation(
        "subscriber: back-off after a failure",
        "weightsync/service/subscriber.py",
        "if view.failed_version == desired and now < view.retry_at:",
        "if False:",
        PLAN,
    ),
    Mutation(
        "subscriber: idle when serving the target",
        "weightsync/service/subscriber.py",
        "    if view.current == desired:\n",
        "    if False:\n",
        PLAN,
    ),
    Mutation(
        "subscriber: no versions yet",
        "weightsync/service/subscriber.py",
        "    if head is None:\n        return Wait(",
        "    if False:\n        return Wait(",
        PLAN,
    ),
]


def _find(text: str, old: str | tuple[str, ...]) -> str | None:
    for o in (old,) if isinstance(old, str) else old:
        if text.count(o) == 1:
            return o
    return None


def run(tree: Path, mutations: list[Mutation], timeout: float) -> list[tuple[Mutation, str, float]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="ws-mutate-") as scratch:
        shutil.copytree(tree / "weightsync", Path(scratch) / "weightsync", ignore=shutil.ignore_patterns("__pycache__"))
        # PYTHONSAFEPATH: no ``python -m`` (pytest, the CLI the tests start) puts its working
        # directory, the unmutated tree, ahead of the copy
        env = {**os.environ, "PYTHONPATH": scratch, "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        for m in mutations:
            path = Path(scratch) / m.file
            text = path.read_text()
            old = _find(text, m.old)
            files = [t for t in m.tests if t.endswith(".py")]
            if old is None:
                results.append((m, "n/a", 0.0))
                continue
            if not all((tree / f).exists() for f in files):
                results.append((m, "NOT CAUGHT (no such test file)", 0.0))
                continue
            st = path.stat()
            path.write_text(text.replace(old, m.new))
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
            cmd += [f"--basetemp={scratch}/pt", "-o", "addopts=--strict-markers"]
            try:
                rc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=timeout).returncode
                verdict = {0: "NOT CAUGHT", 1: "caught"}.get(rc, f"error (pytest exit {rc})")
                if rc == 5:
                    verdict = "NOT CAUGHT (no test selected)"
            except subprocess.TimeoutExpired:
                verdict = "timeout"
            finally:
                path.write_text(text)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # numba's cache keys on it
            results.append((m, verdict, time.monotonic() - t0))
            print(f"{verdict:12} {time.monotonic() - t0:6.1f}s  {m.name}", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="checkout to mutate")
    ap.add_argument("-m", "--match", default="", help="only mutations whose name holds this")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation's tests")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if args.match in m.name]
    results = run(args.tree.resolve(), chosen, args.timeout)
    print(f"\n{'mutation':45} {'file':35} result")
    for m, verdict, _ in results:
        print(f"{m.name:45} {m.file.removeprefix('weightsync/'):35} {verdict}")
    applicable = [r for r in results if r[1] != "n/a"]
    caught = sum(r[1] == "caught" for r in applicable)
    print(f"\ncaught/total: {caught}/{len(applicable)} ({len(results) - len(applicable)} n/a)")
    return 0 if caught == len(applicable) else 1


if __name__ == "__main__":
    sys.exit(main())
