"""End-to-end fuzzing of what a subscriber reads from a store: mutate a real stored manifest, chunk
or head pointer, then pull (into an empty folder, incrementally over the previous version, and
back from the next version: a rollback that undoes its deltas, reverse payloads included).

The rule checked on every case: the pull raises a ``WeightsyncError`` (never another exception),
or it succeeds and the folder holds the expected version byte for byte (never a wrong byte, and no
file that the version does not have). A pull never changes the store, and the folder it was
refused into keeps the version it had.

    python benchmarks/fuzz.py                       # 5 minutes or 20000 cases, whichever first
    python benchmarks/fuzz.py --seconds 60 --seed 3 --json fuzz.json

Prints the cases run, their outcomes by error type, and the violations (wrong outputs, crashes)
with the mutation that caused each; exits 1 if there was any. The short, hypothesis-driven variant
is ``tests/functional/test_hostile.py`` (it imports this module's harness).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import weightsync  # noqa: E402
from weightsync.demo import make_trajectory
from weightsync.errors import WeightsyncError
from weightsync.format.keys import chunk_key, version_key
from weightsync.sync.pull import PullConfig

TINY = dict(hidden=64, layers=1, experts=2, vocab=256)  # some ans blocks list exceptions: reverse payloads
MANIFEST_OPS = (
    "flip",
    "set",
    "delete",
    "insert",
    "truncate",
    "json-delete",
    "json-replace",
    "json-bump",
    "json-swap",
    "json-dup",
)
CHUNK_OPS = ("flip", "truncate", "extend", "swap", "missing")
OTHER_OPS = ("manifest-swap", "manifest-missing", "head")
# JSON values a mutation may put anywhere in a manifest (besides ones drawn at random)
SPECIAL = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    10**18 + 1,
    1 << 50,
    1.5,
    float("1e308"),
    "",
    "../evil",
    "/etc/passwd",
    "a/../../b",
    ".weightsync/state.json",
    "x\\y",
    "ok.bin",
    [],
    {},
    [0, 0, 1],
    "same",
    "full",
    "sparse",
    "dense",
    "BF16",
    "F16",
    "header",
    "tensor",
    "blob",
    "0" * 32,
    "f" * 32,
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree(root: Path, skip_state: bool = False) -> dict[str, str]:
    """relpath -> sha256 (``<dir>``, ``<link>``) of everything under ``root``."""
    out: dict[str, str] = {}
    root = Path(root)
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if skip_state and rel == Path("."):
            dirnames[:] = [d for d in dirnames if d != ".weightsync"]
        for d in dirnames:
            p = Path(dirpath, d)
            out[(rel / d).as_posix()] = "<link>" if p.is_symlink() else "<dir>"
        for name in filenames:
            p = Path(dirpath, name)
            out[(rel / name).as_posix()] = "<link>" if p.is_symlink() else _sha(p.read_bytes())
    return out


@dataclass
class World:
    """A file store holding a tiny trajectory (keyframes with deltas, plain deltas, two shards), the
    expected content of each version, and a replica folder of each version for incremental pulls."""

    root: Path
    store: Path
    expected: dict[int, dict[str, str]]  # version -> files (relpath -> sha256)
    replicas: dict[int, Path]
    objects: dict[str, bytes] = field(default_factory=dict)  # pristine store objects by key

    @property
    def versions(self) -> list[int]:
        return sorted(self.expected)

    def restore(self) -> None:
        """Put every store object back as it was (after a mutation)."""
        for key in list(_keys(self.store)):
            if key not in self.objects:
                (self.store / key).unlink()
        for key, data in self.objects.items():
            path = self.store / key
            if not path.is_file() or path.is_symlink() or path.read_bytes() != data:
                path.unlink(missing_ok=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)

    def chunks_of(self, version: int) -> list[str]:
        doc = json.loads(self.objects[version_key(version)])
        return [c["id"] for c in doc["chunks"]]


def _keys(store: Path):
    for p in store.rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            yield p.relative_to(store).as_posix()


def build_world(root: Path, steps: int = 4) -> World:
    root = Path(root)
    traj = make_trajectory(root / "traj", steps=steps, shards=2, **TINY)
    store = root / "store"
    cfg = weightsync.PublishConfig(keyframe_interval=2, chunk_bytes=16 << 10)  # several chunks per version
    expected, replicas = {}, {}
    for v, ckpt in enumerate(traj):
        weightsync.publish(ckpt, store, config=cfg)
        expected[v] = tree(ckpt)
        replicas[v] = root / f"replica-{v}"
        weightsync.pull(store, replicas[v], v, config=PullConfig(fsync=False))
    world = World(root, store, expected, replicas)
    world.objects = {k: (store / k).read_bytes() for k in _keys(store)}
    return world


# --- mutations ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    """What to damage: ``target`` is manifest/chunk/other, ``op`` one of the *_OPS, ``version`` whose
    manifest or chunk, ``a``/``b`` positions or indices (taken modulo the size), ``value`` a JSON
    value or bytes for the op."""

    target: str
    op: str
    version: int
    a: int = 0
    b: int = 0
    value: object = None

    def __str__(self) -> str:
        return f"{self.target}:{self.op} v{self.version} a={self.a} b={self.b} value={self.value!r}"[:300]


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k in sorted(node):
            yield from _json_paths(node[k], (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, (*prefix, i))


def _mutate_json(doc, op: str, a: int, b: int, value):
    paths = [p for p in _json_paths(doc) if p]
    path = paths[a % len(paths)]
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "json-delete":
        del parent[last]
    elif op == "json-replace":
        parent[last] = value
    elif op == "json-bump":
        cur = parent[last]
        if isinstance(cur, bool) or not isinstance(cur, int):
            parent[last] = value
        else:
            parent[last] = cur + (1 if b % 2 else -1) * (1 + b % 7)
    elif op in ("json-swap", "json-dup"):
        if isinstance(parent, list) and len(parent) > 1:
            j = b % len(parent)
            if op == "json-swap":
                parent[last], parent[j] = parent[j], parent[last]
            else:
                parent.insert(j, json.loads(json.dumps(parent[last])))
        else:
            parent[last] = value
    return doc


def mutate_bytes(data: bytes, op: str, a: int, b: int, value) -> bytes:
    n = len(data)
    pos = a % max(1, n)
    if op == "flip":
        return data[:pos] + bytes([data[pos] ^ (1 << (b % 8))]) + data[pos + 1 :] if n else b"\x00"
    if op == "set":
        return data[:pos] + bytes([b % 256]) + data[pos + 1 :] if n else b"\x00"
    if op == "delete":
        return data[:pos] + data[pos + 1 + b % 16 :]
    if op == "insert":
        extra = value if isinstance(value, bytes) else str(value).encode()
        return data[:pos] + extra + data[pos:]
    if op == "truncate":
        return data[:pos]
    if op == "extend":
        return data + (value if isinstance(value, bytes) and value else b"\x00")
    raise ValueError(op)


def apply(world: World, m: Mutation) -> None:
    """Damage ``world.store`` as ``m`` says (``world.restore()`` undoes it)."""
    store = world.store
    if m.target == "manifest":
        path = store / version_key(m.version)
        data = world.objects[version_key(m.version)]
        if m.op.startswith("json-"):
            try:
                value = m.value if not isinstance(m.value, bytes) else m.value.decode("latin-1")
                data = json.dumps(_mutate_json(json.loads(data), m.op, m.a, m.b, value)).encode()
            except (TypeError, ValueError):
                data = data[:-1]
        else:
            data = mutate_bytes(data, m.op, m.a, m.b, m.value)
        path.write_bytes(data)
    elif m.target == "chunk":
        ids = world.chunks_of(m.version)
        cid = ids[m.a % len(ids)]
        path = store / chunk_key(cid)
        data = world.objects[chunk_key(cid)]
        if m.op == "missing":
            path.unlink()
        elif m.op == "swap":
            others = sorted(k for k in world.objects if k.startswith("chunks/") and k != chunk_key(cid))
            path.write_bytes(world.objects[others[m.b % len(others)]])
        else:
            path.write_bytes(mutate_bytes(data, m.op, m.b, m.a, m.value))
    elif m.op == "manifest-swap":
        other = world.versions[m.a % len(world.versions)]
        (store / version_key(m.version)).write_bytes(world.objects[version_key(other)])
    elif m.op == "manifest-missing":
        (store / version_key(m.version)).unlink()
    elif m.op == "head":
        value = (
            m.value
            if isinstance(m.value, bytes)
            else json.dumps({"format": "weightsync.head", "version": m.value}).encode()
        )
        (store / "HEAD").write_bytes(value)
    else:
        raise ValueError(f"unknown mutation {m}")


def random_mutation(rng: random.Random, versions: list[int]) -> Mutation:
    target = rng.choice(("manifest", "manifest", "manifest", "chunk", "chunk", "other"))
    ops = {"manifest": MANIFEST_OPS, "chunk": CHUNK_OPS, "other": OTHER_OPS}[target]
    op = rng.choice(ops)
    if rng.random() < 0.5:
        value = rng.choice(SPECIAL)
    else:
        value = rng.choice(
            [
                rng.randrange(-(2**40), 2**40),
                rng.random(),
                rng.randbytes(rng.randrange(0, 8)),
                "".join(rng.choice("ab./_-\\0") for _ in range(rng.randrange(0, 12))),
            ]
        )
    if op == "head" and not isinstance(value, (int, bytes)):
        value = rng.choice([-1, 0, 1, 2, 3, 99, 10**18, b"", b"{}", b"garbage"])
    # mostly the versions a pull of the last two reads (the older ones only matter for chunk sharing)
    version = rng.choice([*versions[-3:], *versions[-3:], *versions])
    return Mutation(target, op, version, rng.randrange(1 << 30), rng.randrange(1 << 30), value)


# --- one case -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    kind: str  # ok | refused | wrong | crash
    detail: str

    @property
    def violation(self) -> bool:
        return self.kind in ("wrong", "crash")


def run_case(
    world: World, m: Mutation, work: Path, incremental: bool, version: int | None = None, rollback: bool = False
) -> Outcome:
    """Apply ``m``, pull ``version`` (default: the head; fresh, or over the previous version's
    replica, or with ``rollback`` over the next version's: below the head only), judge, restore."""
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    target = max(world.versions) if version is None else version
    prev = max(0, target - 1)
    if rollback:
        prev, incremental = target + 1, True
    if incremental:
        shutil.copytree(world.replicas[prev], out, symlinks=True)
    before = tree(out)
    try:
        apply(world, m)
        damaged = tree(world.store)
        try:
            want = "latest" if version is None else version
            r = weightsync.pull(world.store, out, want, config=PullConfig(fsync=False, decode_threads=2))
            outcome = _judge(world, out, r.version)
        except WeightsyncError as exc:
            outcome = Outcome("refused", type(exc).__name__)
            after = tree(out)
            if incremental and tree(out, skip_state=True) != tree(world.replicas[prev], skip_state=True):
                outcome = Outcome("wrong", f"refused ({exc}) but the folder no longer holds version {prev}")
            elif not incremental and {p: h for p, h in after.items() if not p.startswith(".weightsync")} != {
                p: h for p, h in before.items() if not p.startswith(".weightsync")
            }:
                outcome = Outcome("wrong", f"refused ({exc}) but files appeared in the folder")
        except Exception as exc:  # noqa: BLE001 - the point: anything else is a crash
            outcome = Outcome("crash", f"{type(exc).__name__}: {exc}"[:300])
        if tree(world.store) != damaged:
            outcome = Outcome("wrong", "the pull changed the store")
        return outcome
    finally:
        world.restore()


def _judge(world: World, out: Path, version: int) -> Outcome:
    if version not in world.expected:
        return Outcome("wrong", f"pulled version {version}, which was never published")
    got = {p: h for p, h in tree(out, skip_state=True).items() if h != "<dir>"}
    want = world.expected[version]
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:4]
        return Outcome("wrong", f"version {version} differs from its checkpoint: {diff}")
    return Outcome("ok", f"version {version}")


# --- the long run --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="stop after this long (default 300)")
    p.add_argument("--max-iterations", type=int, default=20000, help="stop after this many cases (default 20000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    by_target: Counter[str] = Counter()
    violations: list[tuple[str, str, str]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="weightsync-fuzz-") as tmp:
        world = build_world(Path(tmp) / "world")
        work = Path(tmp) / "work"
        work.mkdir()
        n = 0
        while n < args.max_iterations and time.monotonic() - t0 < args.seconds:
            m = random_mutation(rng, world.versions)
            incremental = rng.random() < 0.5
            version = rng.choice([None, *world.versions[1:]])
            rollback = incremental and version is not None and version < max(world.versions) and rng.random() < 0.5
            o = run_case(world, m, work, incremental, version, rollback)
            n += 1
            by_target[f"{m.target}:{m.op}"] += 1
            outcomes[o.kind if o.kind != "refused" else f"refused:{o.detail}"] += 1
            if o.violation:
                kind = "rollback" if rollback else "incremental" if incremental else "fresh"
                how = f"{kind} pull of {'latest' if version is None else version}"
                violations.append((str(m), how, f"{o.kind}: {o.detail}"))
    seconds = time.monotonic() - t0
    figures = {
        "cases": n,
        "seconds": round(seconds, 1),
        "seed": args.seed,
        "outcomes": dict(outcomes),
        "mutations": dict(by_target),
        "violations": len(violations),
        "wrong_outputs": sum(1 for v in violations if v[2].startswith("wrong")),
        "crashes": sum(1 for v in violations if v[2].startswith("crash")),
        "examples": violations[:20],
    }
    print(f"weightsync end-to-end fuzz: {n} cases in {seconds:.0f} s (seed {args.seed})")
    for k, c in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {c:>7}  {k}")
    print(f"violations: {len(violations)} ({figures['wrong_outputs']} wrong outputs, {figures['crashes']} crashes)")
    seen: set[str] = set()
    for m, how, what in violations:
        key = what.split(":")[0] + what.split(":")[1][:40] if ":" in what else what
        if key not in seen:
            seen.add(key)
            print(f"  {how}: {m}\n      -> {what}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
