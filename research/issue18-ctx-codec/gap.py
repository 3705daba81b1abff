"""Where `ans` is larger than `ac` at lr 1e-5, part by part, and what each candidate change to the
format would take off (static costs on the data; nothing here is a codec).

    python research/issue18-ctx-codec/gap.py [pairs...]      # default: pairs 1 and 4 of lr 1e-5

Uses benchmarks/codec.py's cached trajectory (it trains it if missing). For each pair, in MB:
- `ans` as the package codes it, split by the header (docs/FORMAT.md): the exception list, the
  buckets' Rice sections, the groups' escape and rANS sections, the rest of the header; `ac`'s size;
- positions: Rice (best k per bucket, as coded here) against the best Golomb code and against a
  static rANS over the bitmap's nibbles whose table follows from the bucket's density alone (no
  table bytes), by density band (a nibble coder decodes n_b / 4 symbols, Rice one per gap);
- the exception list: gaps over all positions (as coded) against ranks among the "edge" elements a
  backward decoder can find from the new values alone (new mantissa at either end, new exponent
  next to a threshold), the rest listed as today;
- values: static entropy per value group (as coded) against per old exponent (table costs apart),
  and the alphabet size before the escape.
"""

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import cache_dirs, load_checkpoint  # noqa: E402

from weightsync.codec import ans, registry  # noqa: E402
from weightsync.codec.entropy import normalise  # noqa: E402
from weightsync.codec.payload import CodecConfig  # noqa: E402

POP4 = np.array([bin(i).count("1") for i in range(16)])


def varint(d, p):
    v = s = 0
    while True:
        b = d[p]
        p += 1
        v |= (b & 127) << s
        s += 7
        if b < 128:
            return v, p


def parts(d):
    """Byte counts of one `ans` block's parts (docs/FORMAT.md's layout)."""
    K, L, G = d[4] & 7, d[4] >> 7, d[7]
    p = 8 + K - 1 + G - 1
    e, p = varint(d, p)
    p0 = p
    if e and L:
        p += 1
        x, p = varint(d, p)
        p += x
    elif e:
        for _ in range(e):
            _, p = varint(d, p)
        p += e
    exc = p - p0
    rice = 0
    for _ in range(K):
        _, p = varint(d, p)
        cb, p = varint(d, p)
        if cb:
            r, p = varint(d, p + 1)
            rice += r
    esc = rans = 0
    for _ in range(G):
        m, p = varint(d, p)
        if m:
            s = d[p] & 31
            p += 1
            for _ in range(s):
                _, p = varint(d, p)
            e_g, p = varint(d, p)
            a_g, p = varint(d, p)
            esc += e_g
            rans += a_g
    return dict(header=p - exc, exceptions=exc, rice=rice, escapes=esc, rans=rans)


def rice_bits(g):
    return min(np.where((g >> k) < 32, (g >> k) + 1 + k, 64).sum() for k in range(20))


def golomb_bits(g):
    best = rice_bits(g)
    for m in range(3, int(2 * g.mean()) + 3):
        b = int(m - 1).bit_length()
        u = (1 << b) - m
        best = min(best, (g // m + 1 + np.where(g % m < u, b - 1, b)).sum())
    return best


def nibble_bits(bits, c, n):
    q = min(4095, max(1, (c * 4096 + n // 2) // n))
    counts = np.array([q ** int(j) * (4096 - q) ** (4 - int(j)) for j in POP4], np.int64)
    f = np.zeros(16, np.int64)
    normalise(counts, f)
    b = np.concatenate([bits, np.zeros(-bits.size % 4, bool)]).reshape(-1, 4).astype(np.int64)
    h = np.bincount(b[:, 0] | b[:, 1] << 1 | b[:, 2] << 2 | b[:, 3] << 3, minlength=16)
    return -(h * np.log2(np.maximum(f, 1) / 4096)).sum() + 16


def entropy(x):
    _, c = np.unique(x, return_counts=True)
    return -(c * np.log2(c / c.sum())).sum()


def h2(c, n):
    if c in (0, n):
        return 0.0
    p = c / n
    return -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p))


def pair_report(old, new):
    coder = registry.get("ac")
    t = dict(ans=0, ac=0, header=0, exceptions=0, rice=0, escapes=0, rans=0)
    pos = dict(rice=0.0, golomb=0.0, best_nibble=0.0)
    bands = {}
    exc = dict(all_positions=0.0, edge_ranks=0.0, count=0, edge=0)
    vals = dict(group=0.0, exponent=0.0)
    alph = {s: 0.0 for s in (16, 32, 64)}
    for name, (dt, raw) in old.items():
        if dt != "BF16":
            continue
        o, n = raw.view("<u2"), new[name][1].view("<u2")
        ch = o != n
        if not ch.any():
            continue
        data, _ = ans.encode_block("BF16", o, n)
        t["ans"] += len(data)
        t["ac"] += len(coder.encode("BF16", o, n, CodecConfig())[0])
        for k, v in parts(data).items():
            t[k] += v
        thr, vthr = (np.asarray(x, np.int64) for x in ans._plan(o, n, 7, 8, 4, 16)[:2])
        e = ((o & 0x7FFF) >> 7).astype(np.int64)
        en = ((n & 0x7FFF) >> 7).astype(np.int64)
        bk = np.searchsorted(thr, e, side="right")
        grp = np.searchsorted(vthr, e, side="right")
        for b in np.unique(bk):
            c = ch[bk == b]
            nb, cb = c.size, int(c.sum())
            if cb == 0:
                continue
            ranks = np.flatnonzero(~c if 2 * cb > nb else c)
            g = np.diff(np.concatenate([[-1], ranks])) - 1
            r = rice_bits(g) if g.size else 0
            nib = nibble_bits(c, cb, nb)
            pos["rice"] += r
            pos["golomb"] += golomb_bits(g) if g.size else 0
            pos["best_nibble"] += min(r, nib)
            band = bands.setdefault(min(int(8 * min(cb, nb - cb) / nb), 3), [0.0, 0.0, 0, 0])
            band[0] += r
            band[1] += nib
            band[2] += (nb + 3) // 4
            band[3] += g.size
        both = np.unique(np.concatenate([thr, vthr]))
        moved = np.searchsorted(both, e, side="right") != np.searchsorted(both, en, side="right")
        w = (n & 0x7FFF).astype(np.int64) + 1  # a new mantissa at its top carries into the exponent
        edge = ((w & 0x7F) <= 1) & np.isin(w >> 7, both)
        ne, n_edge, e_edge = int(moved.sum()), int(edge.sum()), int((moved & edge).sum())
        exc["all_positions"] += h2(ne, o.size)
        exc["edge_ranks"] += h2(e_edge, n_edge) + h2(ne - e_edge, o.size)
        exc["count"] += ne
        exc["edge"] += e_edge
        d = n[ch].astype(np.int64) - o[ch].astype(np.int64)
        zz = np.where(d >= 0, 2 * d, -2 * d - 1)
        for k in np.unique(grp[ch]):
            vals["group"] += entropy(d[grp[ch] == k])
            for s in alph:
                z = zz[grp[ch] == k]
                alph[s] += entropy(np.minimum(z - 1, s - 1))
                esc = z[z >= s] - s
                if esc.size:  # the best Exp-Golomb order, as the escapes are coded
                    alph[s] += min((2 * np.floor(np.log2((esc >> h) + 1)) + 1 + h).sum() for h in range(12))
        for x in np.unique(e[ch]):
            vals["exponent"] += entropy(d[e[ch] == x])
    mb = lambda v: round(v / 1e6, 4)  # noqa: E731
    bits = lambda v: round(v / 8e6, 4)  # noqa: E731
    print("  bytes:", {k: mb(v) for k, v in t.items()}, f"ans/ac {t['ans'] / t['ac']:.4f}")
    print("  positions (bits as MB):", {k: bits(v) for k, v in pos.items()})
    for b in sorted(bands):
        r, nib, syms, gaps = bands[b]
        lo, hi = b / 8, (b + 1) / 8 if b < 3 else 0.5
        print(
            f"    density {lo:.3f}-{hi:.3f}: Rice {bits(r)} nibbles {bits(nib)} ({nib / r:.4f}); {syms / gaps:.2f} symbols a gap"
        )
    print("  exceptions:", {k: bits(v) if isinstance(v, float) else v for k, v in exc.items()})
    print("  values, static entropy:", {k: bits(v) for k, v in vals.items()})
    print("  values, alphabet size before the escape (symbols + escapes):", {s: bits(v) for s, v in alph.items()})


def main():
    pairs = [int(x) for x in sys.argv[1:]] or [1, 4]
    dirs = cache_dirs("moe-lr1e-05", lr=1e-5, steps=6)
    for pair in pairs:
        print(f"lr 1e-5 pair {pair}", flush=True)
        pair_report(load_checkpoint(dirs[pair]), load_checkpoint(dirs[pair + 1]))


if __name__ == "__main__":
    main()
