"""The kinds of `ans` kernel side by side (session 42; weightsync.codec.simd.KINDS: native 1, bmi2 2,
portable 0): the pass alone, the scan alone, whole encode_block and decode_block over every BF16
tensor of a step pair of benchmarks/codec.py's cached trajectories, thread CPU time, fastest of R, the
kinds alternating. LR 'large': the first 120 tensors of benchmarks/e2e.py's 2.03 GiB trajectory.
SB=N overrides ans.SCAN_BITMAPS. With a CPU's features less VBMI2 (a Cascade Lake's instructions),
in a numba cache of its own:

    F=$(python -c "from numba.core.codegen import get_host_cpu_features as g; print(g())")
    NUMBA_CPU_FEATURES=${F/+avx512vbmi2/-avx512vbmi2} NUMBA_CACHE_DIR=/tmp/nc \\
        python research/issue18-ctx-codec/probe_s42_kinds.py 1e-05 0
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from common import load_checkpoint  # noqa: E402

from weightsync.codec import ans, simd  # noqa: E402

lr, pair = sys.argv[1], int(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
if os.environ.get("SB"):
    ans.SCAN_BITMAPS = int(os.environ["SB"])
root = sorted((ROOT / "benchmarks/.cache").glob("e2e-*" if lr == "large" else f"moe-lr{lr}-*"))[0]
steps = sorted(p for p in root.iterdir() if p.name.startswith("step"))
a, b = load_checkpoint(steps[pair]), load_checkpoint(steps[pair + 1])
items = []
for name, (dtype, buf) in a.items():
    if dtype != "BF16":
        continue
    o, n = buf.view("<u2"), b[name][1].view("<u2")
    data, ch = ans.encode_block("BF16", o, n)
    if not ch:
        continue
    thr, vthr, dense, _ = ans._plan(o, n, 7, 8, ans.BUCKETS, 16)
    p = ans.Parsed("BF16", memoryview(data), o.size, o.dtype, name)
    items.append(dict(o=o, n=n, data=data, thr=thr, vthr=vthr, dense=dense, p=p, out=np.empty_like(o)))
    if lr == "large" and len(items) >= 120:
        break
elements, size = sum(x["o"].size for x in items) / 1e6, sum(len(x["data"]) for x in items) / 1e6
print(f"{lr} pair {pair}: {len(items)} tensors, {elements:.1f} M elements, {size:.3f} MB; default {simd.NATIVE}")
kinds = [k for k in (simd.VECTOR, simd.BMI2, simd.PORTABLE) if k in simd.KINDS]


def scan(k):
    for x in items:
        o, n, thr, vthr = x["o"], x["n"], x["thr"], x["vthr"]
        raw, st = ans._SCRATCH.take(o.size, thr.size + 1, 2)
        ans._kernel("scan", thr.size + 1, vthr.size + 1, k)(o, n, thr, vthr, 7, 8, raw, st, bool(x["dense"]))


def pass_(k):
    for x in items:
        p = x["p"]
        lims, st = np.empty(ans.MAX_K + ans.MAX_G, np.uint16), np.empty(ans.S_LEN, np.int64)
        ans._pass_state(p.thr, p.vthr, p.shift, p.nb, p.wbase, p.dstart, lims, st)
        if ans._kernel("pass", p.K, p.G, k)(x["out"], x["o"], 0, x["o"].size, lims, st, p.words, p.diffs):
            raise SystemExit("pass failed")


def encode(k):
    for x in items:
        ans.encode_block("BF16", x["o"], x["n"], native=k)


def decode(k):
    for x in items:
        ans.decode_block("BF16", memoryview(x["data"]), x["o"], x["out"], "t", native=k)


for k in kinds:  # the same bytes and results in every kind
    for x in items:
        assert ans.encode_block("BF16", x["o"], x["n"], native=k)[0] == x["data"], k
        ans.decode_block("BF16", memoryview(x["data"]), x["o"], x["out"], "t", native=k)
        assert np.array_equal(x["out"], x["n"]), k
best = {}
for _ in range(rounds):
    for what, f in (("pass", pass_), ("scan", scan), ("encode", encode), ("decode", decode)):
        for k in kinds:
            t = time.thread_time()
            f(k)
            best[what, k] = min(best.get((what, k), 9e9), time.thread_time() - t)
for what in ("pass", "scan", "encode", "decode"):
    print(f"{what:7s}", "  ".join(f"{simd.KIND_NAMES[k]} {1e3 * best[what, k]:.1f}" for k in kinds), "ms")
