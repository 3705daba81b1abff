"""An ``ans`` block decoded on the tensor's device (weightsync.torch.ansdecode) against the host
decoder, for one block of BF16 weights near 0.02 with a fraction of elements moved by one unit.

Rows, each the fastest of --repeat rounds:
- host pass: weightsync.codec.ans.decode_block on one thread (parse + pass; no hash);
- host pass + copy to the device: what a sink that decodes on the host then moves;
- device decode: the block's streams parsed on the host (timed apart), the pass by torch on the device;
- device copy: torch clone of the tensor on the device (the memcpy baseline there).

Usage: `python benchmarks/devicedecode.py [--device cuda] [--elements 16e6] [--changed 0.03]`
(benchmarks/gpu.sh runs it on CUDA; on the CPU it is a smoke check of the same steps).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

if __package__:
    from . import common
else:  # run as a script from benchmarks/
    import common

common.ensure_repo_importable()
from weightsync.codec import ans
from weightsync.torch.ansdecode import decode_block


def timed(fn, sync, repeat: int) -> float:
    """The fastest of ``repeat`` calls (after one warm-up), in seconds."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--elements", type=float, default=16e6, help="elements of the block (default 16e6: 32 MiB)")
    ap.add_argument("--changed", type=float, default=0.03, help="fraction of elements changed")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = int(args.elements)
    rng = np.random.default_rng(0)
    old = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    moved = rng.random(n) < args.changed
    new[moved] += rng.choice(np.array([1, 0xFFFF], np.uint16), int(moved.sum()))
    block, _, k = ans.encode_block_apart("BF16", old, new)  # as payloads hold it (its list apart)
    old_dev = torch.from_numpy(old.view(np.int16)).to(dev)
    host_out = np.empty_like(old)
    staging = torch.empty(n, dtype=torch.int16, pin_memory=dev.type == "cuda")
    dev_out = torch.empty_like(old_dev)

    def host_then_copy():
        ans.decode_block("BF16", memoryview(block), old, host_out, "bench")
        staging.numpy()[:] = host_out.view(np.int16)
        dev_out.copy_(staging, non_blocking=True)

    rows = {
        "host pass (1 thread)": timed(
            lambda: ans.decode_block("BF16", memoryview(block), old, host_out, "b"), sync, args.repeat
        ),
        "host pass + copy to device": timed(host_then_copy, sync, args.repeat),
        "host parse of the streams": timed(
            lambda: ans.Parsed("BF16", memoryview(block), n, old.dtype, "b"), sync, args.repeat
        ),
        "device decode (parse + torch pass)": timed(lambda: decode_block("BF16", block, old_dev), sync, args.repeat),
        "device copy (clone)": timed(lambda: old_dev.clone(), sync, args.repeat),
    }
    got = decode_block("BF16", block, old_dev).cpu().numpy().view(np.uint16)
    exact = np.array_equal(got, new)
    print(f"{n:,} BF16 elements, {k:,} changed ({k / n:.2%}), block {len(block):,} bytes, device {dev}; exact: {exact}")
    print(f"{'':38s} {'ms':>9s} {'GB/s':>8s}")
    for name, s in rows.items():
        print(f"{name:38s} {s * 1e3:9.2f} {2 * n / s / 1e9:8.2f}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
