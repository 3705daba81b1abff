"""Escapes at lr 1e-5: coded bytes vs ideal (class entropy + raw bits) per group.
(Session 39; reads blocks in the layout before nibbles and carried bytes: run it with cced093's tree
on PYTHONPATH, e.g. a git worktree.)"""
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
tot = dict(n=0, eg=0.0, ideal_cls=0.0, ideal_full=0.0, vals=0)
allv = []
for pi in sel:
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    for name in a:
        if a[name][0] != "BF16": continue
        o, n = a[name][1].view("<u2"), b[name][1].view("<u2")
        data, ch = ans.encode_block("BF16", o, n)
        if not ch: continue
        p = ans.Parsed("BF16", memoryview(data), o.size, o.dtype, "t")
        for g in range(p.G):
            dd = p.diffs[p.dstart[g]:p.dstart[g+1]].astype(np.int16).astype(np.int64)
            z = (dd << 1) ^ (dd >> 63)
            v = z[z >= 16] - 16
            if not v.size: continue
            tot["n"] += v.size
            best = 1e18
            for h in range(0, 16):
                x = (v >> h) + 1
                m = np.floor(np.log2(x)).astype(np.int64)
                eg = (2 * m + 1 + h).sum()
                _, cc = np.unique(m, return_counts=True)
                cls = -(cc * np.log2(cc / cc.sum())).sum() + (m + h).sum()
                best = min(best, cls)
                if h == 0: eg0 = eg
                tot.setdefault("eg_h", {}); 
            egs = [(2 * np.floor(np.log2((v >> h) + 1)) + 1 + h).sum() for h in range(16)]
            tot["eg"] += min(egs) / 8
            tot["ideal_cls"] += best / 8
            _, cc = np.unique(v, return_counts=True)
            tot["ideal_full"] += -(cc * np.log2(cc / cc.sum())).sum() / 8
            allv.append(v)
ns = len(sel)
print({k: round(v / ns) for k, v in tot.items() if not isinstance(v, dict)})
v = np.concatenate(allv)
print("escape values quantiles", np.percentile(v, [10, 25, 50, 75, 90, 99]).tolist(), "max", v.max())
