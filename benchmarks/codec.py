"""The codec table: delta sizes of consecutive RL checkpoints against baselines and entropy bounds.

For each trajectory (lr 1e-6 and 1e-5, from benchmarks/trajectory.py, cached) and each consecutive
step pair (old, new) it measures, in bytes of the new checkpoint:

- raw: the bf16 tensor data;
- the zeroth-order entropy bound of the change: each element's symbol d = (new - old) mod 2^16 of
  the uint16 views (0 when unchanged) taken as i.i.d., N * H(d); computed per tensor and summed
  (the headline) and pooled over the whole checkpoint;
- the same conditioned on the old value's exponent field ((old >> 7) & 0xFF): sum over exponent
  groups of n_g * H(d | group), per tensor (headline) and pooled;
- zstd (level 3) and ZipNN of the full new checkpoint; XOR of the whole data + zstd (level 3);
- ours: weightsync.codec.encode_tensor per tensor with the default codec (``ans``), with ``ac`` and
  with ``sparse``, each payload decoded and checked byte for byte.

Ratios are raw / size over all pairs together. Throughput of ours (GB/s of raw tensor bytes;
encode = diff + code, decode = decode + apply + xxh3-128 verify, hashed as it is written) is measured
in whole passes over every tensor of a pair, on one core (a loop) and on all cores (a thread pool,
largest first), beside np.copyto of the same tensors: the passes are interleaved round by round and
each keeps its fastest round, since this machine's speed drifts within a minute. np.copyto of large
arrays and uint16 XOR are measured too. The trajectories' model is small (most tensors 0.6 MB), so throughput is also
measured on one step pair of benchmarks/e2e.py's 2.03 GiB checkpoints (most tensors 4 MiB), as a
bigger model's tensors are met (skip it with --no-large; --large-only measures nothing else, for a
host of many cores: benchmarks/cores.sh). Peak RSS is reported after imports, after the `ours` pass
(before bounds and baselines run) and at the end.

Usage: `python benchmarks/codec.py [--quick] [--no-large | --large-only] [--json FILE]`
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

try:
    import zipnn

    zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16")
except (ImportError, TypeError):  # no wheel (a lent GPU machine's Python 3.12), or 0.1's other API
    zipnn = None  # the row is left out, and the report says so
import zstandard

if __package__:
    from . import common, e2e
else:  # run as a script from benchmarks/
    import common
    import e2e

common.ensure_repo_importable()
from weightsync.codec import CodecConfig, decode_tensor, encode_tensor, hashing

TRAJECTORIES = {"lr 1e-6": 1e-6, "lr 1e-5": 1e-5}
STEPS = 6  # published checkpoints per trajectory: 5 consecutive pairs
QUICK_PAIRS = 2
LARGE = "e2e 2.03 GiB"  # throughput also on one pair of benchmarks/e2e.py's checkpoints (4 MiB tensors)
TIMING_REPEAT = 5  # interleaved rounds of whole passes; each keeps its fastest (noisy shared cores)
CORES = len(os.sched_getaffinity(0))  # the cores this process may run on (taskset: benchmarks/cores.sh)


class CodecMismatch(RuntimeError):
    """Our codec decoded something other than what it encoded."""


# --- entropy bounds ----------------------------------------------------------------------------------
def _nlog2n(counts: np.ndarray) -> float:
    c = counts[counts > 0].astype(np.float64)
    return float((c * np.log2(c)).sum())


@dataclass
class ChangeCounts:
    """Sufficient statistics of a change for both bounds: elements per old exponent, unchanged
    elements per old exponent, and (exponent << 16 | d) of every changed element."""

    per_exp: np.ndarray
    unchanged_per_exp: np.ndarray
    changed_keys: np.ndarray

    @classmethod
    def of(cls, old: np.ndarray, new: np.ndarray) -> ChangeCounts:
        """old, new: uint16 views of one bf16 tensor."""
        d = new - old  # wraps mod 2^16
        exp = (old >> 7) & 0xFF
        changed = d != 0
        per_exp = np.bincount(exp, minlength=256)
        exp_changed = exp[changed]
        unchanged = per_exp - np.bincount(exp_changed, minlength=256)
        keys = (exp_changed.astype(np.uint32) << 16) | d[changed]
        return cls(per_exp, unchanged, keys)

    @classmethod
    def pooled(cls, parts: list[ChangeCounts]) -> ChangeCounts:
        return cls(
            sum(p.per_exp for p in parts),
            sum(p.unchanged_per_exp for p in parts),
            np.concatenate([p.changed_keys for p in parts]),
        )

    def bound_bits(self) -> tuple[float, float]:
        """(N * H(d), sum over exponent groups of n_g * H(d | group)), in bits."""
        n = self.per_exp.sum()
        _, d_counts = np.unique(self.changed_keys & 0xFFFF, return_counts=True)
        plain = _nlog2n(np.array([n])) - _nlog2n(np.append(d_counts, self.unchanged_per_exp.sum()))
        _, joint = np.unique(self.changed_keys, return_counts=True)
        cond = _nlog2n(self.per_exp) - _nlog2n(np.concatenate([joint, self.unchanged_per_exp]))
        return max(plain, 0.0), max(cond, 0.0)


# --- measurements ------------------------------------------------------------------------------------
@dataclass
class PairResult:
    """Sizes in bytes for one (old, new) step pair; times in seconds."""

    pair: str
    raw: int
    changed: int = 0
    ulp1: int = 0
    sizes: dict[str, float] = field(default_factory=dict)
    codecs: dict[str, int] = field(default_factory=dict)
    encode_s: float = 0.0  # the default codec (`ans`)
    decode_s: float = 0.0
    encode_all_s: float = 0.0
    decode_all_s: float = 0.0
    ac_encode_s: float = 0.0  # the same with `--entropy-coder ac`
    ac_decode_s: float = 0.0
    ac_encode_all_s: float = 0.0
    ac_decode_all_s: float = 0.0
    sparse_encode_s: float = 0.0  # the same with the entropy coder off (`sparse`, the daemons' --fast-codec)
    sparse_decode_s: float = 0.0
    sparse_encode_all_s: float = 0.0
    sparse_decode_all_s: float = 0.0
    memcpy_s: float = 0.0  # np.copyto of every new tensor into the decoders' output buffers
    memcpy_all_s: float = 0.0


VARIANTS = {"": CodecConfig(), "ac_": CodecConfig(coder="ac"), "sparse_": CodecConfig(entropy_coder=False)}
"""The codec configurations measured, by the prefix of their fields: the default (``ans``), ``ac``
(``--entropy-coder ac``) and ``sparse`` (``--fast-codec``)."""

SIZE_KEYS = {"": "ours", "ac_": "ours_ac", "sparse_": "ours_sparse"}


def measure_ours(old: common.Checkpoint, new: common.Checkpoint, res: PairResult, variants: dict = VARIANTS) -> None:
    """Encode every tensor against its old version with each of :data:`VARIANTS`, decode and verify
    (xxh3-128 of the result, as a pull does), check bit-exactness; then time whole passes of each
    variant's encode and decode and of memcpy of the same bytes, interleaved round by round (this
    machine's speed drifts within a minute: only figures taken side by side compare), single-threaded
    per tensor, then all tensors on all cores."""
    outs = {name: np.empty_like(buf) for name, (_, buf) in new.items()}  # reused by every pass (as memcpy's)
    encoded = {}
    for pre, cfg in variants.items():
        used, total = Counter(), 0
        for name, (dtype, buf) in new.items():
            enc = encode_tensor(dtype, buf, old[name][1], cfg)
            out, _ = decode_verify(dtype, enc, old[name][1], buf.size, outs[name])
            if not np.array_equal(out, buf):
                raise CodecMismatch(f"{res.pair} {name}: decode({enc.codec}) differs from the input")
            used[enc.codec] += 1
            total += len(enc.payload)
            encoded[pre, name] = enc
        res.sizes[SIZE_KEYS[pre]] = total
        if not pre:
            res.codecs = dict(used)
    # Whole passes over every tensor, so each is met with cold caches as in a publish or a pull (a
    # per-tensor best-of would find a small tensor's inputs still in cache). All cores: tensors are
    # independent (the kernels, zstd and xxhash release the GIL); largest first, on the daemons' pool.
    names = sorted(new, key=lambda n: -new[n][1].size)
    passes = {"memcpy": lambda n: np.copyto(outs[n], new[n][1])}
    for pre, cfg in variants.items():
        passes[pre + "encode"] = lambda n, cfg=cfg: encode_tensor(new[n][0], new[n][1], old[n][1], cfg)
        passes[pre + "decode"] = lambda n, pre=pre: decode_verify(
            new[n][0], encoded[pre, n], old[n][1], new[n][1].size, outs[n]
        )
    size = lambda n: new[n][1].size  # noqa: E731
    for suffix, threads in (("_s", 1), ("_all_s", CORES)):
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(TIMING_REPEAT):
            for key, fn in passes.items():
                best[key] = min(best[key], common.parallel_seconds(fn, names, threads, 1, size))
        for key, seconds in best.items():
            setattr(res, key + suffix, seconds)


def decode_verify(dtype: str, enc, base: np.ndarray, nbytes: int, out: np.ndarray) -> tuple[np.ndarray, bytes]:
    """Decode and apply a payload into ``out`` (not the base: a copy, patched), hashing the result
    as it is written (what a pull does before installing it: :func:`weightsync.codec.rebuild`)."""
    hasher = hashing.hasher()
    out = decode_tensor(dtype, enc.codec, enc.payload, base, nbytes, out=out, hasher=hasher)
    return out, hasher.digest()


def analyse_change(old: common.Checkpoint, new: common.Checkpoint, res: PairResult) -> None:
    """Both bounds in bytes (per tensor summed, and pooled), changed and +-1 ulp element counts."""
    parts = []
    for name, (dtype, buf) in new.items():
        if dtype != "BF16":
            raise ValueError(f"{name}: the bounds are defined for BF16 tensors, got {dtype}")
        parts.append(ChangeCounts.of(old[name][1].view(np.uint16), buf.view(np.uint16)))
    per_tensor = np.array([p.bound_bits() for p in parts]).sum(axis=0) / 8
    pooled = ChangeCounts.pooled(parts)
    bound, bound_exp = np.array(pooled.bound_bits()) / 8
    res.sizes.update(bound=per_tensor[0], bound_pooled=bound, bound_exp=per_tensor[1], bound_exp_pooled=bound_exp)
    d = pooled.changed_keys & 0xFFFF
    res.changed = int(d.size)
    res.ulp1 = int(np.count_nonzero((d == 1) | (d == 0xFFFF)))


def _flat(ckpt: common.Checkpoint, names: list[str]) -> np.ndarray:
    return np.concatenate([ckpt[n][1] for n in names])


def measure_baselines(old: common.Checkpoint, new: common.Checkpoint, res: PairResult) -> None:
    """zstd-3 and ZipNN of the full new checkpoint, and zstd-3 of the XOR of all tensor data."""
    names = list(new)
    flat_new = _flat(new, names)
    zstd = zstandard.ZstdCompressor(level=3)
    res.sizes["zstd"] = len(zstd.compress(flat_new))
    if zipnn is not None:
        nn = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16")
        res.sizes["zipnn"] = len(nn.compress(bytearray(flat_new)))  # compress() mutates its input
    xor = np.bitwise_xor(flat_new.view(np.uint16), _flat(old, names).view(np.uint16))
    res.sizes["xor_zstd"] = len(zstd.compress(xor))


def step_pairs(n_pairs: int | None) -> dict[str, list[tuple]]:
    """(label, old dir, new dir) per trajectory, building missing trajectories first."""
    out = {}
    for label, lr in TRAJECTORIES.items():
        dirs = common.build_cached(f"moe-lr{lr:g}", lr, STEPS)
        pairs = [(f"{a.name}->{b.name}", a, b) for a, b in itertools.pairwise(dirs)]
        out[label] = pairs[:n_pairs]
    return out


def measure_pair(a, b, pair: str, variants: dict = VARIANTS) -> PairResult:
    old, new = common.load_checkpoint(a), common.load_checkpoint(b)
    res = PairResult(pair, common.raw_bytes(new))
    measure_ours(old, new, res, variants)
    return res


def run(n_pairs: int | None, large: bool = True) -> dict:
    """All measurements; the `ours` pass runs first so its peak RSS is not the bounds' or baselines'.
    ``n_pairs == 0``: only the large pair's throughput, without ``ac`` (``--large-only``)."""
    plan = step_pairs(n_pairs) if n_pairs != 0 else {}
    rss_start = common.peak_rss_mib()
    results: dict[str, list[PairResult]] = {label: [] for label in plan}
    for label, pairs in plan.items():
        for pair, a, b in pairs:
            results[label].append(measure_pair(a, b, pair))
    rss_ours = common.peak_rss_mib()
    speed_only = {}
    if large:  # a bigger model's tensors: throughput only (its sizes are in benchmarks/e2e.py's table)
        dirs = e2e.trajectory("full", 3)
        variants = VARIANTS if plan else {k: v for k, v in VARIANTS.items() if k != "ac_"}  # ac: 0.04x, minutes
        speed_only[LARGE] = [asdict(measure_pair(dirs[1], dirs[2], f"{dirs[1].name}->{dirs[2].name}", variants))]
    for label, pairs in plan.items():
        for res, (_, a, b) in zip(results[label], pairs):
            old, new = common.load_checkpoint(a), common.load_checkpoint(b)
            analyse_change(old, new, res)
            measure_baselines(old, new, res)
    return {
        "trajectories": {k: [asdict(r) for r in v] for k, v in results.items()},
        "speed_only": speed_only,
        "memcpy_gbps": common.memcpy_gbps(),
        "memcpy_all_gbps": common.memcpy_gbps(threads=CORES),
        "fresh_gbps": common.memcpy_gbps(fresh=True),
        "fresh_all_gbps": common.memcpy_gbps(threads=CORES, fresh=True),
        "xor_gbps": common.xor_gbps(),
        "cores": CORES,
        "load_average_1min": os.getloadavg()[0],
        "cpu": cpu_line(),
        "peak_rss_mib_start": rss_start,
        "peak_rss_mib_after_ours": rss_ours,
        "peak_rss_mib": common.peak_rss_mib(),
    }


# --- report ------------------------------------------------------------------------------------------
ROWS = [
    ("raw", "raw bf16 tensor data"),
    ("bound", "entropy bound of change, per tensor (headline)"),
    ("bound_pooled", "entropy bound of change, pooled"),
    ("bound_exp", "bound given old exponent, per tensor"),
    ("bound_exp_pooled", "bound given old exponent, pooled"),
    ("zstd", "zstd-3, full checkpoint"),
    ("zipnn", "ZipNN, full checkpoint"),
    ("xor_zstd", "XOR + zstd-3"),
    ("ours", "ours (weightsync.codec: `ans`, the default)"),
    ("ours_ac", "ours, `--entropy-coder ac`"),
    ("ours_sparse", "ours, entropy coder off (`sparse`, --fast-codec)"),
]


def _size_cells(pairs: list[dict], key: str) -> list[str]:
    """Mean MB per step, and the aggregate ratio to raw with its range over single pairs."""
    raw = sum(p["raw"] for p in pairs)
    if key == "raw":
        return [f"{raw / len(pairs) / 1e6:,.3f}", "1.0x"]
    size = _sum(pairs, key)
    per_pair = [p["raw"] / p["sizes"][key] for p in pairs]
    return [f"{size / len(pairs) / 1e6:,.3f}", f"{raw / size:.1f}x ({min(per_pair):.1f}-{max(per_pair):.1f})"]


def _sum(pairs: list[dict], key: str) -> float:
    return sum(p["sizes"][key] for p in pairs)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def size_table(report: dict) -> str:
    trajs = report["trajectories"].values()
    head = [c for k in report["trajectories"] for c in (f"{k}: MB / step", f"{k}: ratio (range)")]
    lines = [_row(["method", *head]), _row(["---"] * (1 + len(head)))]
    for key, title in ROWS:
        if not all(key == "raw" or key in p["sizes"] for ps in trajs for p in ps):
            continue  # zipnn not installed (the report says so below the table)
        lines.append(_row([title, *(c for p in trajs for c in _size_cells(p, key))]))
    for ours, name in (("ours", "ans"), ("ours_ac", "ac"), ("ours_sparse", "sparse")):
        for key, title in (("bound", f"{name} / bound"), ("bound_exp", f"{name} / bound given exponent")):
            lines.append(_row([title, *(c for p in trajs for c in ("", f"{_sum(p, ours) / _sum(p, key):.3f}"))]))
    return "\n".join(lines)


def pair_table(report: dict) -> str:
    lines = [
        "| trajectory | pair | changed | of which +-1 ulp | codecs | ours ratio | ans / bound | ac / bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, pairs in report["trajectories"].items():
        for p in pairs:
            n = p["raw"] // 2
            codecs = ", ".join(f"{k} {v}" for k, v in sorted(p["codecs"].items()))
            lines.append(
                f"| {label} | {p['pair']} | {p['changed'] / n:.2%} | {p['ulp1'] / max(p['changed'], 1):.1%} "
                f"| {codecs} | {p['raw'] / p['sizes']['ours']:.1f}x "
                f"| {p['sizes']['ours'] / p['sizes']['bound']:.3f} "
                f"| {p['sizes']['ours_ac'] / p['sizes']['bound']:.3f} |"
            )
    return "\n".join(lines)


def speed_table(report: dict) -> str:
    """GB/s of raw tensor bytes on one core and on all cores, and ours as a fraction of memcpy."""
    trajs = {**report["trajectories"], **report.get("speed_only", {})}
    cores = report["cores"]
    lines = [
        "| throughput, GB/s of raw tensor bytes | "
        + " | ".join(f"{k}: 1 core | {k}: {cores} core{'s' if cores > 1 else ''}" for k in trajs)
        + " |",
        "|---" * (1 + 2 * len(trajs)) + "|",
    ]
    speeds = {}
    rows = (
        ("encode", "`ans` encode (diff + code; the default)"),
        ("decode", "`ans` decode (decode + apply + xxh3 verify)"),
        ("ac_encode", "`ac` encode"),
        ("ac_decode", "`ac` decode (+ xxh3 verify)"),
        ("sparse_encode", "`sparse` encode"),
        ("sparse_decode", "`sparse` decode (+ xxh3 verify)"),
        ("memcpy", "memcpy of the same tensors (np.copyto, timed beside them)"),
    )
    rows = tuple(
        r for r in rows if all(p[r[0] + "_s"] for ps in trajs.values() for p in ps)
    )  # ac: not with --large-only
    for key, title in rows:
        cells = []
        for label, pairs in trajs.items():
            raw = sum(p["raw"] for p in pairs)
            for suffix in ("_s", "_all_s"):
                speeds[(key, label, suffix)] = raw / sum(p[key + suffix] for p in pairs) / 1e9
                cells.append(f"{speeds[(key, label, suffix)]:.2f}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    mem = {"_s": report["memcpy_gbps"], "_all_s": report["memcpy_all_gbps"]}
    lines.append(
        "| memcpy (np.copyto, 128 MiB) | " + " | ".join(f"{mem['_s']:.2f} | {mem['_all_s']:.2f}" for _ in trajs) + " |"
    )
    if "fresh_gbps" in report:  # reports written before this row existed lack it
        lines.append(
            "| memcpy into fresh arrays (pages zeroed on first touch) | "
            + " | ".join(f"{report['fresh_gbps']:.2f} | {report['fresh_all_gbps']:.2f}" for _ in trajs)
            + " |"
        )
    lines.append("| uint16 XOR (128 MiB) | " + " | ".join(f"{report['xor_gbps']:.2f} | -" for _ in trajs) + " |")
    for key, title in rows[:-1]:  # memcpy last
        lines.append(
            f"| {title.split(' (')[0]} / memcpy of the same tensors | "
            + " | ".join(
                f"{speeds[(key, label, suffix)] / speeds[('memcpy', label, suffix)]:.3f}"
                for label in trajs
                for suffix in ("_s", "_all_s")
            )
            + " |"
        )
    return "\n".join(lines)


def cpu_line() -> str:
    """The CPU as LLVM names it and the kind of ``ans`` kernel it gets (their speed depends on both)."""
    from weightsync.codec import simd

    has = lambda f: "yes" if simd._FEATURES.get(f) else "no"  # noqa: E731
    slow = " (microcoded)" if simd.HAS_BMI2 and simd._HOST_CPU in simd.SLOW_PDEP_CPUS else ""
    return (
        f"CPU: {simd._HOST_CPU or 'unknown'} (LLVM's name); BMI2 {has('bmi2')}{slow}, AVX-512 VBMI2 "
        f"{has('avx512vbmi2')}: `ans` runs its {simd.KIND_NAMES[simd.NATIVE]} kernels."
    )


def render(report: dict) -> str:
    n = {k: len(v) for k, v in report["trajectories"].items()}
    sizes = []
    if n:
        raw = next(iter(report["trajectories"].values()))[0]["raw"]
        sizes = [
            (
                f"## Delta size per step ({raw / 1e6:.1f} MB raw checkpoint; step pairs: {n}; "
                "ratio = raw / size over all pairs, range over single pairs)"
            ),
            size_table(report),
            "## Per step pair",
            pair_table(report),
        ]
    return "\n\n".join(
        [
            *sizes,
            "## Throughput",
            speed_table(report),
            *(
                [f"{LARGE}: one step pair of benchmarks/e2e.py's checkpoints, throughput only."]
                if report.get("speed_only")
                else []
            ),
            report.get("cpu", ""),
            *(
                []
                if all("zipnn" in p["sizes"] for ps in report["trajectories"].values() for p in ps)
                else ["No ZipNN row: `zipnn` >= 0.5 is not installed (`pip install zipnn`)."]
            ),
            (
                f"1-minute load average at the end: {report['load_average_1min']:.2f} "
                f"on {os.cpu_count()} cores (other processes slow the timings)."
            ),
            (
                f"Peak RSS: {report['peak_rss_mib_start']:.0f} MiB after imports, "
                f"{report['peak_rss_mib_after_ours']:.0f} MiB after the `ours` pass (two checkpoints loaded), "
                f"{report['peak_rss_mib']:.0f} MiB at the end (bounds, baselines, memcpy/XOR buffers incl.)."
                if n
                else f"Peak RSS: {report['peak_rss_mib']:.0f} MiB (the pair and memcpy/XOR buffers)."
            ),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only the first {QUICK_PAIRS} pairs per trajectory")
    ap.add_argument(
        "--no-large",
        action="store_true",
        help=f"skip the throughput on {LARGE} checkpoints (built once by e2e.py's generator, ~90 s)",
    )
    ap.add_argument(
        "--large-only",
        action="store_true",
        help=f"only the throughput on {LARGE} checkpoints, on one core and all of them (a many-core host)",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the raw measurements as JSON")
    args = ap.parse_args()
    if args.large_only and (args.quick or args.no_large):
        ap.error("--large-only goes with neither --quick nor --no-large")
    pairs = 0 if args.large_only else QUICK_PAIRS if args.quick else None
    try:
        report = run(pairs, large=not (args.quick or args.no_large))
    except CodecMismatch as exc:
        sys.exit(f"FAIL: our codec is not bit-exact: {exc}")
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
