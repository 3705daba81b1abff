"""Publish and pull throughput on a real S3 server (SeaweedFS over loopback), beside boto3's own
``upload_file`` / ``download_file`` of the same checkpoint files, and the time to sync a version as
a delta versus as a full copy.

The trajectory comes from :class:`weightsync.demo.SyntheticTrainer` (bf16, lr 1e-6): about
1.05 GiB per checkpoint by default, ~70 MB with ``--quick``; it is cached in benchmarks/.cache.
Every measured operation runs in a fresh subprocess that reports its own wall time (of the
operation, not of Python's start) and peak RSS (VmHWM). weightsync and boto3 get the same
``--concurrency`` (upload_concurrency / fetch_concurrency vs TransferConfig.max_concurrency).
Checkpoint files are in the page cache for both; the server shares the 2 CPUs with the client.

    python benchmarks/transfer.py [--quick] [--concurrency 16] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # tests/seaweed.py: the SeaweedFS launcher
sys.path.insert(0, str(BENCH_DIR.parent))

BUCKET = "weightsync-bench"
GiB, MiB = 1 << 30, 1 << 20
SIZES = {  # SyntheticTrainer shapes: ~1.05 GiB and ~68 MiB of bf16
    "full": {"hidden": 1024, "layers": 4, "experts": 20, "vocab": 32768},
    "quick": {"hidden": 512, "layers": 2, "experts": 8, "vocab": 8192},
}
LR = 1e-6

# One measured operation; prints {"seconds", "rss", ...} as its last line.
CHILD = r"""
import json, os, sys, time
op, cfg = sys.argv[1], json.loads(sys.argv[2])
import boto3, weightsync
from boto3.s3.transfer import TransferConfig
from weightsync import PublishConfig, PullConfig

def client():
    from botocore.config import Config
    return boto3.session.Session().client("s3", endpoint_url=cfg["endpoint"], config=Config(
        signature_version="s3v4", s3={"addressing_style": "path"}, max_pool_connections=cfg["concurrency"]))

extra = {}
if op in ("publish", "pull"):
    repo = weightsync.open_repo(cfg["store"], endpoint_url=cfg["endpoint"], max_concurrency=max(64, cfg["concurrency"]))
    repo.head()  # connect before the clock starts, as the boto3 rows do
t0 = time.perf_counter()
if op == "publish":
    r = weightsync.publish(cfg["src"], repo, cfg["version"], base_dir=cfg.get("base"),
                           config=PublishConfig(upload_concurrency=cfg["concurrency"]))
    extra = {"moved": r.uploaded_bytes, "payload": r.payload_bytes, "raw": r.raw_bytes, "keyframe": r.keyframe,
             "changed": r.changed_fraction}
elif op == "pull":
    r = weightsync.pull(repo, cfg["out"], cfg["version"], config=PullConfig(fetch_concurrency=cfg["concurrency"]))
    extra = {"moved": r.fetched_bytes}
else:
    s3 = client()
    s3.list_buckets()
    t0 = time.perf_counter()
    tc = TransferConfig(max_concurrency=cfg["concurrency"])
    files = cfg["files"]
    for rel in files:
        key = cfg["prefix"] + "/" + rel
        path = os.path.join(cfg["dir"], rel)
        if op == "upload":
            s3.upload_file(path, cfg["bucket"], key, Config=tc)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            s3.download_file(cfg["bucket"], key, path, Config=tc)
    extra = {"moved": sum(os.path.getsize(os.path.join(cfg["dir"], rel)) for rel in files)}
seconds = time.perf_counter() - t0
if op == "pull" and cfg.get("verify"):
    weightsync.verify(repo, cfg["out"], cfg["version"])
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "rss": hwm, **extra}))
"""


def trajectory(size: str, steps: int) -> list[Path]:
    """Checkpoints step_0..step_<steps> of the synthetic trainer, cached in benchmarks/.cache."""
    from weightsync.demo import SyntheticTrainer

    kw = SIZES[size]
    root = BENCH_DIR / ".cache" / ("transfer-" + "-".join(f"{k}{v}" for k, v in kw.items()) + f"-lr{LR:g}")
    dirs = [root / f"step_{i}" for i in range(steps + 1)]
    if all((d / "COMPLETE").exists() for d in dirs):
        return dirs
    t0 = time.perf_counter()
    trainer = SyntheticTrainer(lr=LR, seed=0, **kw)
    for i, d in enumerate(dirs):
        if i:
            trainer.step()
        if not (d / "COMPLETE").exists():
            shutil.rmtree(d, ignore_errors=True)
            trainer.save(d, shards=2)
            (d / "COMPLETE").touch()
    print(f"generated {len(dirs)} checkpoints in {time.perf_counter() - t0:.0f}s under {root}", file=sys.stderr)
    return dirs


def files_of(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.name != "COMPLETE")


def run(op: str, env: dict[str, str], **cfg) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, op, json.dumps(cfg, default=str)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{proc.stderr}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"  {op:8} {res['seconds']:7.2f}s  "
        f"{json.dumps({k: v for k, v in cfg.items() if k in ('version', 'out', 'prefix')}, default=str)}",
        file=sys.stderr,
    )
    return res


def table(rows: list[tuple[str, dict, dict | None]], raw: int) -> str:
    out = ["| operation | moved | seconds | raw GB/s | vs boto3 | peak RSS |", "|---|---:|---:|---:|---:|---:|"]
    for name, r, ref in rows:
        speed = raw / r["seconds"] / 1e9
        ratio = f"{ref['seconds'] / r['seconds']:.2f}x" if ref else "-"
        out.append(
            f"| {name} | {r['moved'] / MiB:,.1f} MiB | {r['seconds']:.2f} | {speed:.2f} | {ratio} | "
            f"{r['rss'] / MiB:,.0f} MiB |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~70 MB checkpoints instead of ~1.05 GiB")
    ap.add_argument("--concurrency", type=int, default=16, help="transfers in flight, for both (default 16)")
    ap.add_argument("--workdir", help="server data and pulled folders (default: a temp dir, removed after)")
    args = ap.parse_args()
    from seaweed import SeaweedServer

    ckpts = trajectory("quick" if args.quick else "full", steps=2)
    raw = sum((ckpts[0] / f).stat().st_size for f in files_of(ckpts[0]))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ws-bench-"))
    server = SeaweedServer(work / "seaweed")
    server.start()
    try:
        server.make_bucket(BUCKET)
        env = {**os.environ, **server.env(), "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        base = {"endpoint": server.endpoint, "concurrency": args.concurrency}
        store = f"s3://{BUCKET}/ws"
        print(
            f"checkpoint {raw / GiB:.3f} GiB in {len(files_of(ckpts[0]))} files; concurrency {args.concurrency}",
            file=sys.stderr,
        )
        run("upload", env, **base, bucket=BUCKET, prefix="warm-up", dir=ckpts[2], files=files_of(ckpts[2]))  # volumes
        up = run("upload", env, **base, bucket=BUCKET, prefix="raw0", dir=ckpts[0], files=files_of(ckpts[0]))
        down = run("download", env, **base, bucket=BUCKET, prefix="raw0", dir=work / "boto3", files=files_of(ckpts[0]))
        pub0 = run("publish", env, **base, store=store, src=ckpts[0], version=0)
        pub1 = run("publish", env, **base, store=store, src=ckpts[1], version=1, base=ckpts[0])
        pull0 = run("pull", env, **base, store=store, out=work / "replica", version=0, verify=True)
        pull1 = run("pull", env, **base, store=store, out=work / "replica", version=1, verify=True)
        fresh1 = run("pull", env, **base, store=store, out=work / "fresh", version=1, verify=True)
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n### weightsync vs boto3 on SeaweedFS (loopback), {raw / GiB:.2f} GiB bf16 checkpoint, "
        f"lr {LR:g}, concurrency {args.concurrency}, {os.cpu_count()} CPUs\n"
    )
    print(
        table(
            [
                ("boto3 upload_file (raw files)", up, None),
                ("weightsync publish v0 (keyframe)", pub0, up),
                (f"weightsync publish v1 (delta, {100 * pub1['changed']:.2f}% changed)", pub1, up),
                ("boto3 download_file (raw files)", down, None),
                ("weightsync pull v0 (empty folder)", pull0, down),
                ("weightsync pull v1 (delta onto v0)", pull1, down),
                ("weightsync pull v1 (empty folder)", fresh1, down),
            ],
            raw,
        )
    )
    delta = pub1["seconds"] + pull1["seconds"]
    full_ws = pub0["seconds"] + fresh1["seconds"]
    full_boto = up["seconds"] + down["seconds"]
    print("\n| sync one version | seconds | bytes over the wire | speed-up vs full boto3 copy |")
    print("|---|---:|---:|---:|")
    print(
        f"| as a delta (publish delta + pull delta) | {delta:.2f} | "
        f"{(pub1['moved'] + pull1['moved']) / MiB:,.1f} MiB | "
        f"{full_boto / delta:.1f}x |"
    )
    print(
        f"| as a full copy, weightsync (keyframe + fresh pull) | {full_ws:.2f} | "
        f"{(pub0['moved'] + fresh1['moved']) / MiB:,.1f} MiB | {full_boto / full_ws:.1f}x |"
    )
    print(
        f"| as a full copy, boto3 (upload_file + download_file) | {full_boto:.2f} | "
        f"{(up['moved'] + down['moved']) / MiB:,.1f} MiB | 1.0x |"
    )
    print(
        "\n'raw GB/s': checkpoint bytes / seconds (the bytes a full copy would move). 'vs boto3': boto3's "
        "seconds / ours for the same direction (> 1: faster). Peak RSS per process, interpreter included."
    )


if __name__ == "__main__":
    main()
