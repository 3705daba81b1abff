"""Sizes per step with nibbles on/off; lr from env LR; per block-size band.
(Session 39: python probe_s39_cmp.py; LR=1e-06 for the other trajectory.)"""
import sys, os, glob
from pathlib import Path
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path.insert(0, str(ROOT / "benchmarks")); sys.path.insert(0, str(ROOT))
import numpy as np
from common import load_checkpoint
from weightsync.codec import ans
lr = os.environ.get("LR", "1e-05")
d = sorted(glob.glob(f"{ROOT}/benchmarks/.cache/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d))
sel = [int(x) for x in sys.argv[1:]] or range(len(steps) - 1)
on = off = 0; worse = []
for pi in sel:
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    for name in a:
        if a[name][0] != "BF16": continue
        o, n = a[name][1].view("<u2"), b[name][1].view("<u2")
        x, ch = ans.encode_block("BF16", o, n)
        if not ch: continue
        y, _ = ans.encode_block("BF16", o, n, nibbles=False)
        on += len(x); off += len(y)
        if len(x) > len(y): worse.append((o.size, len(x) - len(y)))
ns = len(sel)
print(f"lr {lr}: nibbles {on/ns:.0f} rice-only {off/ns:.0f} ({100*(on/off-1):+.3f}%)", "blocks worse:", len(worse)/ns, "bytes", sum(w for _, w in worse)/ns, "sizes", sorted(set(s for s, _ in worse))[:10])
