"""A trainer rank for the rank device-publisher tests: :func:`shard` is rank r's state dict at a step
(deterministic, so a test recomputes what every rank published), and run as a script it publishes
its shard step by step with :class:`weightsync.torch.device.RankDeviceDiffPublisher`, printing one
JSON line per step::

    python tests/rank_device_worker.py STORE --rank R --world W --steps 0-4 [--commit]
        [--timeout S] [--crash-at STEP] [--short-at STEP] [--work DIR]

``--crash-at STEP``: the process dies (``os._exit``) at that step after its device diff, before
its part is written. ``--short-at STEP``: wait only 3 s for that step's commit (a round that a
crashed rank leaves uncommitted)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHANGED = 0.03  # fraction of elements moved per step (by one unit in the last place)


def ints(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` as a flat integer tensor."""
    return t.contiguous().view(-1).view(INT[t.element_size()])


def _move(t: torch.Tensor, g: torch.Generator) -> None:
    v = ints(t)
    mask = torch.rand(v.numel(), generator=g) < CHANGED
    delta = torch.randint(0, 2, (v.numel(),), generator=g, dtype=v.dtype) * 2 - 1
    v.add_(torch.where(mask, delta, torch.zeros_like(delta)))


def shard(rank: int, step: int, events: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """Rank ``rank``'s state dict and metadata at ``step``: bf16 matrices, an f32 vector and an
    int64 counter, ~3% of their elements moved each step. With ``events``: step 2 adds a tensor,
    step 3 reshapes the f32 vector, retypes a tensor and removes one, step 4 sets metadata."""
    g = torch.Generator().manual_seed(1000 + rank)
    sd = {f"layers.{rank}.w{i}": (torch.randn(64 + 8 * rank, 48, generator=g) * 0.02).bfloat16() for i in range(3)} | {
        f"layers.{rank}.norm": torch.ones(48, dtype=torch.float32),
        f"layers.{rank}.count": torch.arange(16, dtype=torch.int64),
        f"layers.{rank}.flag": torch.zeros(8, dtype=torch.uint8),
    }
    meta = None
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(7919 * s + rank)
        for name in sorted(sd):
            if sd[name].is_floating_point():
                _move(sd[name], g)
        if f"layers.{rank}.count" in sd:
            sd[f"layers.{rank}.count"][s % 16] += 1
        if events and s == 2:
            sd[f"layers.{rank}.new"] = torch.full((5,), float(rank), dtype=torch.bfloat16)
        if events and s == 3:
            sd[f"layers.{rank}.norm"] = sd[f"layers.{rank}.norm"][:40].clone()
            sd[f"layers.{rank}.flag"] = sd[f"layers.{rank}.flag"].to(torch.int16)
            del sd[f"layers.{rank}.count"]
        if events and s == 4:
            meta = {"step": "4"}
    return sd, meta


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--steps", required=True, help="FIRST-LAST")
    ap.add_argument("--commit", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--short-at", type=int)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    from weightsync.errors import VersionError
    from weightsync.sync.publish import PublishConfig
    from weightsync.torch.device import RankDeviceDiffPublisher

    first, last = map(int, args.steps.split("-"))
    pub = RankDeviceDiffPublisher(
        args.store,
        rank=args.rank,
        world=args.world,
        commit=args.commit,
        commit_timeout=args.timeout,
        poll=0.05,
        config=PublishConfig(keyframe_interval=3),
        work_dir=args.work,
    )
    now = {"step": None}
    write = pub.mirror.write

    def crash(diff, *a):
        if now["step"] == args.crash_at:
            os._exit(17)  # after the device diff, before anything of the part is stored
        return write(diff, *a)

    pub.mirror.write = crash
    with pub:
        for step in range(first, last + 1):
            now["step"] = step
            pub.commit_timeout = 3.0 if step == args.short_at else args.timeout
            sd, meta = shard(args.rank, step)
            line = {"step": step}
            try:
                r = pub.publish(sd, version=step, metadata=meta)
                line |= {"route": r.route, "d2h": r.d2h_bytes, "tensor_bytes": r.tensor_bytes}
                line |= {"committed": r.committed, "keyframe": r.keyframe, "parent": r.parent}
            except VersionError as exc:
                line |= {"error": str(exc)}
            line["base"] = pub.base_version
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
