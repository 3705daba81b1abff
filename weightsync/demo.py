"""``weightsync demo``: the main job end to end on the embedded file store.

Generates a small synthetic RL trajectory, publishes every step, pulls each into a replica folder
incrementally, verifies it byte for byte, and prints sizes, ratios and timings.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import weightsync

from .progress import human_bytes
from .publishing import PublishConfig
from .synth import SyntheticTrainer


def run_demo(workdir: str | None, steps: int = 8, hidden: int = 256) -> int:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    store = f"file://{(root / 'store').absolute()}"
    replica = root / "replica"
    trainer = SyntheticTrainer(hidden=hidden, layers=4, experts=8, vocab=8192, lr=1e-6, seed=0)
    print(f"weightsync demo in {root}: store {store}, replica {replica}")
    print(f"{'step':>4} {'kind':>8} {'checkpoint':>11} {'delta':>10} {'ratio':>7} {'changed':>8} {'publish':>8} {'pull':>7} {'verify':>7}")
    raw_total = payload_total = 0
    cfg = PublishConfig(keyframe_interval=max(2, steps + 1))
    t_all = time.perf_counter()
    for step in range(steps + 1):
        if step:
            trainer.step()
        ckpt = trainer.save(root / "checkpoints" / f"step_{step:06d}")
        pub = weightsync.publish(ckpt, store, step, config=cfg, base_dir=root / "checkpoints" / f"step_{step - 1:06d}" if step else None)
        t0 = time.perf_counter()
        weightsync.pull(store, replica, step)
        t_pull = time.perf_counter() - t0
        t0 = time.perf_counter()
        weightsync.verify(store, replica, step)
        t_verify = time.perf_counter() - t0
        kind = "keyframe" if pub.keyframe else "delta"
        print(f"{step:>4} {kind:>8} {human_bytes(pub.raw_bytes):>11} {human_bytes(pub.payload_bytes):>10} {pub.ratio:>6.1f}x "
              f"{100 * pub.changed_fraction:>7.2f}% {pub.seconds['total']:>7.2f}s {t_pull:>6.2f}s {t_verify:>6.2f}s")
        if step:
            raw_total += pub.raw_bytes
            payload_total += pub.payload_bytes
    if raw_total:
        print(f"deltas: {human_bytes(raw_total)} of checkpoints shipped as {human_bytes(payload_total)} "
              f"({raw_total / max(1, payload_total):.1f}x smaller); replica verified byte for byte at every step; "
              f"total {time.perf_counter() - t_all:.1f}s")
    sys.stdout.flush()
    return 0
