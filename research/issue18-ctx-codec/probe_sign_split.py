"""Values split into "magnitude 1 or not" (Rice-coded gaps between the others), raw signs of the +-1
changes and a symbol for the rest, against the groups' symbol entropy: python probe_sign_split.py 1e-05 0 4"""
import sys, os, glob
HERE = __import__("pathlib").Path(__file__).resolve().parent
CACHE = HERE.parents[1] / "benchmarks" / ".cache"
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
sys.path.insert(0, str(HERE.parents[1]))
import numpy as np
from pathlib import Path
from common import load_checkpoint
from weightsync.codec import ans
from weightsync.codec.entropy import NSYM
lr = sys.argv[1]
d = sorted(glob.glob(f"{CACHE}/moe-lr{lr}-*"))[0]
steps = sorted(os.listdir(d))
def H(c):
    c = c[c > 0].astype(float); return -(c * np.log2(c / c.sum())).sum()
def rice_bits(g):
    return min(np.where((g >> k) < 32, (g >> k) + 1 + k, 64).sum() for k in range(20))
for pi in [int(x) for x in sys.argv[2:]]:
    a, b = load_checkpoint(Path(d)/steps[pi]), load_checkpoint(Path(d)/steps[pi+1])
    tot = dict(sym=0.0, split_ideal=0.0, split_rice=0.0, nsym=0, nbig=0, blk=0)
    pos_neg = np.zeros(2)
    for k in a:
        if a[k][0] != "BF16": continue
        o, n = a[k][1].view("<u2"), b[k][1].view("<u2")
        if (o == n).all(): continue
        blk = ans.encode_block("BF16", o, n)[0]; tot["blk"] += len(blk)
        p = ans.Parsed("BF16", memoryview(blk), o.size, o.dtype, "t")
        for g in range(p.G):
            dd = p.diffs[p.dstart[g]:p.dstart[g+1]].astype(np.int16).astype(np.int64)
            if not dd.size: continue
            z = (dd << 1) ^ (dd >> 63)
            sym = np.minimum(z - 1, NSYM - 1)
            tot["sym"] += H(np.bincount(sym, minlength=NSYM))
            mag = np.abs(dd); big = mag > 1
            pos_neg += [np.sum(dd > 0), np.sum(dd < 0)]
            # split: indicator big (ideal binary), sign raw, magnitude-2.. symbols (mag 2..8 -> 7 symbols + escape)
            nb = big.sum(); tot["nsym"] += dd.size; tot["nbig"] += nb
            hb = 0.0 if nb in (0, dd.size) else -(nb*np.log2(nb/dd.size) + (dd.size-nb)*np.log2(1-nb/dd.size))
            # magnitudes >1 with their sign folded: symbol = min(zigzag-3, 13) -> i.e. code big ones by the same alphabet
            bs = np.minimum(z[big] - 3, NSYM - 3)
            hm = H(np.bincount(bs, minlength=NSYM)) if nb else 0.0
            idx = np.flatnonzero(big)
            gaps = np.diff(np.concatenate([[-1], idx])) - 1
            rb = rice_bits(gaps.astype(np.int64)) if nb else 0
            # signs raw only for the +-1 ones (big ones carry sign in their symbol)
            tot["split_ideal"] += hb + (dd.size - nb) + hm
            tot["split_rice"] += rb + (dd.size - nb) + hm
    print(lr, pi, "blk MB %.4f" % (tot["blk"]/1e6), "values sym-entropy MB %.4f split ideal %.4f split rice %.4f" % (tot["sym"]/8e6, tot["split_ideal"]/8e6, tot["split_rice"]/8e6),
          "big share %.3f" % (tot["nbig"]/tot["nsym"]), "pos/neg", pos_neg / pos_neg.sum())
