"""The prototype codec ``ctx3`` (ctx3.py) against ``sparse`` and ``ac``: size / zeroth-order bound and
thread-CPU-time throughput as a fraction of memcpy of the same tensors (whole passes over every tensor of a step
pair; the passes of all codecs and memcpy interleaved in rounds, the fastest of each kept, because this shared
machine's speed drifts by 2-3x within a minute); round trip and backward decode checked on every tensor; the bytes
of a one-version rollback with keyframes (today) and with ctx3 deltas.

    python research/issue18-ctx-codec/bench_ctx3.py [pairs] [K] [rounds]
"""

import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT), str(Path(__file__).resolve().parent)]
import common  # noqa: E402
import ctx3  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from weightsync.codec import registry  # noqa: E402
from weightsync.codec.payload import CodecConfig, _encode_payload, decode_tensor, encode_tensor  # noqa: E402


def h_bits(counts):
    c = np.asarray(counts, np.float64)
    c = c[c > 0]
    return float(c.sum() * np.log2(c.sum()) - (c * np.log2(c)).sum())


def main(npairs=5, K=ctx3.BUCKETS, rounds=7):
    cfg = CodecConfig()
    for lr in (1e-6, 1e-5):
        dirs = common.cache_dirs(f"moe-lr{lr:g}", lr=lr, steps=6)
        for a, b in list(itertools.pairwise(dirs))[:npairs]:
            old, new = common.load_checkpoint(a), common.load_checkpoint(b)
            names = sorted(new, key=lambda n: -new[n][1].size)
            ov = {n: old[n][1].view(np.uint16) for n in names}
            nv = {n: new[n][1].view(np.uint16) for n in names}
            ow = {n: np.empty_like(ov[n]) for n in names}
            bound = sum(
                h_bits(np.append(*np.unique(d[d != 0], return_counts=True)[1:], np.count_nonzero(d == 0))) / 8
                for d in (nv[n] - ov[n] for n in names)
            )
            # ctx3: one block per tensor (every tensor here is under the 32 MiB block), plus the 36 bytes of a
            # one-block payload container
            enc = {n: ctx3.encode_block("BF16", ov[n], nv[n], K)[0] for n in names}
            for n in names:
                ctx3.decode_block("BF16", memoryview(enc[n]), ov[n], ow[n], n)
                assert np.array_equal(ow[n], nv[n]), n
                assert np.array_equal(ctx3.decode_backward("BF16", enc[n], nv[n]), ov[n]), n
            sizes = {"ctx3": sum(len(e) + 36 for e in enc.values())}
            full = sum(len(encode_tensor("BF16", old[n][1], None, cfg).payload) for n in names if enc[n])
            payloads = {}
            for codec in ("sparse", "ac"):
                impl = registry.get(codec)
                payloads[codec] = {n: bytes(_encode_payload(impl, "BF16", ov[n], nv[n], cfg)[0]) for n in names}
                sizes[codec] = sum(len(e) for e in payloads[codec].values())

            def ours(n, e=enc):
                ctx3.decode_block("BF16", memoryview(e[n]), ov[n], ow[n], n, xxhash.xxh3_128())

            def theirs(codec, n):
                out = ow[n].view(np.uint8)
                decode_tensor("BF16", codec, payloads[codec][n], old[n][1], out.size, out=out, hasher=xxhash.xxh3_128())

            passes = {
                "memcpy": lambda: [np.copyto(ow[n], ov[n]) for n in names],
                "ctx3 enc": lambda: [ctx3.encode_block("BF16", ov[n], nv[n], K) for n in names],
                "ctx3 dec": lambda: [ours(n) for n in names],
            }
            for codec in ("sparse", "ac"):
                impl = registry.get(codec)
                passes[f"{codec} enc"] = lambda impl=impl: [
                    _encode_payload(impl, "BF16", ov[n], nv[n], cfg) for n in names
                ]
                passes[f"{codec} dec"] = lambda codec=codec: [theirs(codec, n) for n in names]
            fastest = dict.fromkeys(passes, float("inf"))
            for _ in range(rounds):
                for key, run in passes.items():
                    t = time.thread_time()
                    run()
                    fastest[key] = min(fastest[key], time.thread_time() - t)
            mem = fastest["memcpy"]
            row = [f"lr {lr:g} {a.name[-2:]}->{b.name[-2:]}"]
            for codec in ("ctx3", "sparse", "ac"):
                row.append(
                    f"{codec} {sizes[codec] / bound:.3f}x bound enc {mem / fastest[codec + ' enc']:.3f} "
                    f"dec {mem / fastest[codec + ' dec']:.3f}"
                )
            row.append(f"rollback keyframes {full / 1e6:.2f} MB -> ctx3 deltas {sizes['ctx3'] / 1e6:.2f} MB")
            print(" | ".join(row) + f" | memcpy {sum(v.nbytes for v in ov.values()) / mem / 1e9:.2f} GB/s", flush=True)


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    main(*args)
