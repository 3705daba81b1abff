"""Helpers shared by the benchmarks, free of torch: trajectory cache paths, checkpoint reading,
timing and memory figures."""

from __future__ import annotations

import hashlib
import json
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CACHE_DIR = BENCH_DIR / ".cache"
# Bump when benchmarks/trajectory.py generates different checkpoints, so stale caches are not reused.
GENERATOR_VERSION = 2

T = TypeVar("T")

# name -> (safetensors dtype, raw little-endian bytes as a 1-D uint8 array)
Checkpoint = dict[str, tuple[str, np.ndarray]]


def ensure_repo_importable() -> None:
    """Let `python benchmarks/x.py` import the weightsync package without installing it."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


# --- trajectory cache ------------------------------------------------------------------------------
def cache_key(lr: float, steps: int = 6, seed: int = 0, shards: int = 1, **model_kw) -> dict:
    """The make_trajectory arguments with defaults filled in, so equal trajectories share a key."""
    return {"v": GENERATOR_VERSION, "lr": lr, "steps": steps, "seed": seed, "shards": shards, **model_kw}


def cache_dirs(name: str, **kw) -> list[Path]:
    """Step folders of the cached trajectory `name` built with make_trajectory(**kw)."""
    key = cache_key(**kw)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = CACHE_DIR / f"{name}-{digest}"
    return [root / f"step_{i:06d}" for i in range(key["steps"])]


def is_complete(dirs: list[Path]) -> bool:
    return all((d / "COMPLETE").exists() for d in dirs)


def build_cached(name: str, lr: float, steps: int) -> list[Path]:
    """The cached trajectory, built first if needed in a child process (keeps torch, and the
    training's memory peak, out of the caller's process)."""
    dirs = cache_dirs(name, lr=lr, steps=steps)
    if not is_complete(dirs):
        cmd = [
            sys.executable,
            str(BENCH_DIR / "trajectory.py"),
            "--cache",
            name,
            "--lr",
            repr(lr),
            "--steps",
            str(steps),
        ]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    if not is_complete(dirs):
        raise RuntimeError(f"trajectory {name} was not built under {dirs[0].parent}")
    return dirs


# --- checkpoint reading ----------------------------------------------------------------------------
def read_safetensors(path: Path) -> Checkpoint:
    """Parse a safetensors file: 8-byte little-endian header length, JSON header, then data.
    Tensors are zero-copy slices of one buffer holding the file's data section."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = np.fromfile(f, dtype=np.uint8)
    header.pop("__metadata__", None)
    out: Checkpoint = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= data.size:
            raise ValueError(f"{path}: tensor {name} has offsets {begin}..{end} beyond the data")
        out[name] = (info["dtype"], data[begin:end])
    return out


def load_checkpoint(step_dir: Path) -> Checkpoint:
    """All tensors of an HF checkpoint folder: model.safetensors or shards listed in the index."""
    index = step_dir / "model.safetensors.index.json"
    if not index.exists():
        return read_safetensors(step_dir / "model.safetensors")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out: Checkpoint = {}
    for fname in files:
        out.update(read_safetensors(step_dir / fname))
    return out


def raw_bytes(ckpt: Checkpoint) -> int:
    return sum(buf.size for _, buf in ckpt.values())


# --- timing and memory -----------------------------------------------------------------------------
def best_of(fn: Callable[..., T], *args, repeat: int = 5) -> tuple[T, float]:
    """The result of fn(*args) and its fastest wall time over `repeat` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return result, best


def memcpy_gbps(nbytes: int = 128 << 20, threads: int = 1, fresh: bool = False) -> float:
    """np.copyto throughput of a large array, GB/s of bytes copied; with ``threads`` > 1 the array
    is split into that many slices copied at once (numpy releases the GIL while copying).
    ``fresh``: into newly allocated arrays, as a decoder's output is (the kernel zeroes each page
    on first touch)."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    cuts = np.linspace(0, nbytes, max(threads, 1) + 1).astype(np.int64)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]

    def copy(ds):
        d, s = ds
        np.copyto(np.empty_like(s) if fresh else d, s)

    if threads <= 1:
        return nbytes / best_of(copy, (dst, src))[1] / 1e9
    with ThreadPoolExecutor(threads) as pool:
        return nbytes / best_of(lambda: list(pool.map(copy, parts)))[1] / 1e9


def xor_gbps(nbytes: int = 128 << 20) -> float:
    """uint16 XOR throughput of two large arrays, GB/s of one operand's bytes."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    b = rng.integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    out = np.empty_like(a)
    return nbytes / best_of(np.bitwise_xor, a, b, out)[1] / 1e9


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parallel_seconds(
    fn: Callable[[T], object], items: list[T], threads: int, repeat: int = 3, nbytes: Callable[[T], int] | None = None
) -> float:
    """Fastest wall time over ``repeat`` runs of ``fn`` on every item, on a pool of ``threads``
    (one thread: a plain loop, without a pool's hand-offs). With ``nbytes`` (an item's tensor
    bytes), on the daemons' own pool: ``weightsync.sync.pipeline.ordered_map``, which hands small items
    to a worker in runs of ``TASK_BYTES``."""
    if threads <= 1:
        return best_of(lambda: [fn(item) for item in items], repeat=repeat)[1]
    if nbytes is not None:
        from weightsync.sync.pipeline import TASK_BYTES, ordered_map

        weight = lambda item: 3 * nbytes(item)  # noqa: E731  as publish and pull weigh a tensor
        return best_of(lambda: list(ordered_map(fn, items, weight, 1 << 62, threads, 3 * TASK_BYTES)), repeat=repeat)[1]
    with ThreadPoolExecutor(threads) as pool:
        return best_of(lambda: list(pool.map(fn, items)), repeat=repeat)[1]
