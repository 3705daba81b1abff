"""Peak RSS of publish and pull against the bound "1 GiB + 2x the largest tensor".

Each operation runs in a fresh subprocess that reports its own peak RSS (VmHWM; ru_maxrss would
include the parent's peak, which Linux carries across exec). The checkpoint
holds one large bf16 tensor plus small ones; version 1 changes ~3% of its elements by one ulp.

    python benchmarks/memory.py [--big-mib 1024] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from weightsync.demo import write_safetensors

OP = """
import json, sys, weightsync
from weightsync.sync.publish import PublishConfig
op, a, b, v = sys.argv[1:5]
if op == "publish":
    cfg = PublishConfig(keyframe_interval=int(sys.argv[6]) if len(sys.argv) > 6 else 20)
    r = weightsync.publish(a, b, int(v), config=cfg, base_dir=sys.argv[5] if len(sys.argv) > 5 else None)
    extra = {"payload_bytes": r.payload_bytes, "raw_bytes": r.raw_bytes}
else:
    r = weightsync.pull(a, b, int(v))
    extra = {"fetched_bytes": r.fetched_bytes}
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"rss": hwm, **extra}))
"""


def make_checkpoints(root: Path, big_mib: int, seed: int = 0) -> tuple[Path, Path, int]:
    rng = np.random.default_rng(seed)
    n = big_mib * (1 << 20) // 2
    big = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    big = ((big + 0x7FFF + ((big >> 16) & 1)) >> 16).astype(np.uint16)
    small = {f"layers.{i}.weight": rng.integers(0, 1 << 16, 4096 * 64, dtype=np.uint16) for i in range(8)}
    dirs = []
    for version in range(2):
        if version:
            idx = rng.choice(n, size=n * 3 // 100, replace=False)
            big[idx] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=idx.size)
        d = root / f"step_{version}"
        d.mkdir(parents=True, exist_ok=True)
        tensors = {"embed.weight": ("BF16", (n // 1024, 1024), big.tobytes())}
        tensors.update({k: ("BF16", (64, 4096), v.tobytes()) for k, v in small.items()})
        write_safetensors(d / "model.safetensors", tensors)
        dirs.append(d)
    return dirs[0], dirs[1], n * 2


def run(op: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", OP, op, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the largest tensor in MiB")
    ap.add_argument("--workdir")
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="ws-mem-"))
    v0, v1, largest = make_checkpoints(root, args.big_mib)
    store = f"file://{root / 'store'}"
    bound = (1 << 30) + 2 * largest
    rows = [
        ("publish v0 (keyframe)", run("publish", str(v0), store, "0")),
        ("publish v1 (delta, --base v0)", run("publish", str(v1), store, "1", str(v0))),
        ("publish v2 (keyframe with its delta, --base v1)", run("publish", str(v0), store, "2", str(v1), "2")),
        ("pull v0 into empty folder", run("pull", store, str(root / "replica"), "0")),
        ("pull v1 (incremental)", run("pull", store, str(root / "replica"), "1")),
    ]
    gib = 1 << 30
    print(f"largest tensor {largest / gib:.2f} GiB; bound = 1 GiB + 2 x largest = {bound / gib:.2f} GiB\n")
    print("| operation | peak RSS | bound | within |")
    print("|---|---:|---:|:---:|")
    for name, r in rows:
        print(f"| {name} | {r['rss'] / gib:.2f} GiB | {bound / gib:.2f} GiB | {'yes' if r['rss'] <= bound else 'NO'} |")


if __name__ == "__main__":
    main()
