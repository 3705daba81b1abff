"""Sizes of `ans` (the package on PYTHONPATH) and `ac` per lr pair, every BF16 tensor one block:
    python probe_sizes.py 1e-05 --ac                     # this checkout: ans against ac
    PYTHONPATH=<worktree with MAX_K = BUCKETS = 8 in codec/ans.py> python probe_sizes.py 1e-05
(2026-12-06, session 38: see README, "Session 38".)"""
import sys, os, glob, time
HERE = __import__("pathlib").Path(__file__).resolve().parent
CACHE = HERE.parents[1] / "benchmarks" / ".cache"
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import numpy as np
from pathlib import Path
from common import load_checkpoint
from weightsync.codec import ans, registry
from weightsync.codec.payload import CodecConfig
import weightsync; print(weightsync.__file__, ans.MAX_K)
lr = sys.argv[1] if len(sys.argv) > 1 else "1e-05"
d = sorted(glob.glob(f"{CACHE}/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d))
ac = registry.get("ac")
tot_a = tot_c = 0
docac = "--ac" in sys.argv
for pi in range(5):
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    sa = sc = 0
    for k in a:
        if a[k][0] != "BF16": continue
        o, n = a[k][1].view("<u2"), b[k][1].view("<u2")
        if (o == n).all(): continue
        blk = ans.encode_block("BF16", o, n)[0]
        sa += len(blk)
        if docac: sc += len(ac.encode("BF16", o, n, CodecConfig())[0])
    tot_a += sa; tot_c += sc
    print(pi, sa, sc, "%.4f" % (sa / sc) if sc else "")
print("total", tot_a, tot_c, "%.4f" % (tot_a / tot_c) if tot_c else "")
