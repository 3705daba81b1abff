"""End to end: a trajectory of >= 2 GiB bf16 checkpoints through a real publisher daemon, SeaweedFS
and two subscriber daemons over loopback; the time from "checkpoint ready" to "both subscribers
swapped and verified", beside reading the checkpoint once from the page cache and beside shipping
the whole checkpoint with boto3 (full-copy sync), all measured in the same run.

Per version N: the checkpoint's files appear in the publisher's watch folder as ``step_00000N/``
(hard links to a cached copy written by :class:`weightsync.demo.SyntheticTrainer`, lr 1e-6, read
once so they sit in the page cache as a trainer's fresh write would), then the ``COMPLETE`` marker
is written last: that is t0. The publisher daemon diffs, encodes and uploads; both subscriber
daemons pull into their standby slot (every checksum verified) and flip ``current``; a swap hook
(the command ``true``, standing in for the server confirming it loaded the version) lets the next
sync refill the standby in place. t1 is when
``GET /v1/status`` of both reports ``current_version == N`` (polled every 50 ms). Outside the timed
window ``weightsync verify`` checks that both ``current`` folders are byte-identical to version N.

Baselines, same run, same files: (a) reading the checkpoint from the page cache (read twice, the
second timed: 64 MiB ``readinto`` a reused buffer, one thread); (b) full-copy sync: boto3
``upload_file`` of the files, then two ``download_file`` runs in parallel (one per subscriber), with
the daemons' concurrency (TransferConfig.max_concurrency), no checksums, no fsync.

All of it (SeaweedFS, three daemons, boto3) shares this machine's CPUs.

    python benchmarks/e2e.py [--quick] [--versions 4] [--concurrency 16] [--poll 0.2] [--no-fsync]
                             [--fast-codec | --entropy-coder ac] [--standby-hold S|never] [--workdir DIR]
                             [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # tests/seaweed.py: the SeaweedFS launcher
sys.path.insert(0, str(BENCH_DIR.parent))

BUCKET = "weightsync-e2e"
GiB, MiB = 1 << 30, 1 << 20
SIZES = {  # SyntheticTrainer shapes: 2.03 GiB of bf16 in 4 shards, and 68 MiB in 2
    "full": ({"hidden": 1024, "layers": 4, "experts": 40, "vocab": 32768}, 4),
    "quick": ({"hidden": 512, "layers": 2, "experts": 8, "vocab": 8192}, 2),
}
LR = 1e-6
TOKEN = "e2e-benchmark-token"
MARKER = "COMPLETE"

# boto3 side of the full-copy baseline; prints {"seconds", "bytes"} as its last line.
CHILD = r"""
import json, os, sys, time
import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
op, cfg = sys.argv[1], json.loads(sys.argv[2])
s3 = boto3.session.Session().client("s3", endpoint_url=cfg["endpoint"], config=Config(
    signature_version="s3v4", s3={"addressing_style": "path"}, max_pool_connections=cfg["concurrency"]))
s3.list_buckets()  # connect before the clock starts
tc = TransferConfig(max_concurrency=cfg["concurrency"])
moved = 0
start, t0 = time.time(), time.perf_counter()
for rel in cfg["files"]:
    key, path = cfg["prefix"] + "/" + rel, os.path.join(cfg["dir"], rel)
    if op == "upload":
        s3.upload_file(path, cfg["bucket"], key, Config=tc)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        s3.download_file(cfg["bucket"], key, path, Config=tc)
    moved += os.path.getsize(path)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "bytes": moved, "start": start, "end": start + seconds}))
"""


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- checkpoints ---------------------------------------------------------------------------------
def trajectory(size: str, versions: int) -> list[Path]:
    """Checkpoints step_000000..step_<versions-1>, written once by SyntheticTrainer into benchmarks/.cache."""
    from weightsync.demo import SyntheticTrainer

    kw, shards = SIZES[size]
    name = "e2e-" + "-".join(f"{k}{v}" for k, v in kw.items()) + f"-shards{shards}-lr{LR:g}"
    dirs = [BENCH_DIR / ".cache" / name / f"step_{i:06d}" for i in range(versions)]
    if all((d / MARKER).exists() for d in dirs):
        return dirs
    log(f"generating {versions} checkpoints into {dirs[0].parent} (once; about a minute per GiB and step on 2 cores)")
    t0 = time.perf_counter()
    trainer = SyntheticTrainer(lr=LR, seed=0, **kw)
    for i, d in enumerate(dirs):
        if i:
            trainer.step()
        if not (d / MARKER).exists():
            shutil.rmtree(d, ignore_errors=True)
            trainer.save(d, shards=shards)
            (d / MARKER).touch()
    log(f"generated in {time.perf_counter() - t0:.0f}s")
    return dirs


def files_of(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.name != MARKER)


def checkpoint_bytes(ckpt: Path) -> int:
    return sum((ckpt / f).stat().st_size for f in files_of(ckpt))


def read_seconds(ckpt: Path, block: int = 64 * MiB) -> float:
    """Read every file of ``ckpt`` twice (64 MiB readinto a reused buffer); seconds of the second pass."""
    buf = bytearray(block)
    view = memoryview(buf)
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        for name in files_of(ckpt):
            with open(ckpt / name, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
        best = time.perf_counter() - t0
    return best


def stage(src: Path, dst: Path) -> None:
    """The trainer's write, without the trainer: the files of ``src`` linked into ``dst`` (no marker)."""
    dst.mkdir(parents=True)
    for name in files_of(src):
        try:
            os.link(src / name, dst / name)
        except OSError:
            shutil.copyfile(src / name, dst / name)


# --- processes -----------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Daemon:
    """A weightsync daemon in its own process group, logging to a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path, port: int):
        self.name, self.port = name, port
        self.logfile = logdir / f"{name}.log"
        with open(self.logfile, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.cli", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def get(self, path: str, timeout: float = 10.0) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        text = self.logfile.read_text(errors="replace") if self.logfile.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def wait_healthy(daemons: list[Daemon], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for d in daemons:
        while True:
            if not d.alive():
                raise RuntimeError(f"{d.name} exited:\n{d.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/healthz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{d.name} not healthy after {timeout:.0f}s:\n{d.tail()}") from None
                time.sleep(0.1)


def settle(subs: list[Daemon], timeout: float) -> float:
    """Seconds until every subscriber's standby slot holds a version (after a start the daemon
    copies the current version into its empty standby while idle, so that the next delta refills
    it in place): the next checkpoint comes minutes later in training, not at once."""
    t0 = time.perf_counter()
    while any(s.get("/v1/status")["standby_version"] is None for s in subs):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"standby slots still empty after {timeout:.0f}s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def wait_version(pub: Daemon, subs: list[Daemon], version: int, timeout: float) -> float:
    """perf_counter when every subscriber's status reports ``current_version == version``."""
    deadline = time.perf_counter() + timeout
    while True:
        now = time.perf_counter()
        if all(s.get("/v1/status")["current_version"] == version for s in subs):
            return now
        for d in (pub, *subs):
            if not d.alive():
                raise RuntimeError(f"{d.name} exited:\n{d.tail()}")
        if now > deadline:
            states = {
                d.name: {k: d.get("/v1/status").get(k) for k in ("state", "reason", "last_error")} for d in (pub, *subs)
            }
            raise TimeoutError(f"version {version} not on every subscriber after {timeout:.0f}s: {states}")
        time.sleep(0.05)


def boto3_op(op: str, env: dict[str, str], **cfg) -> dict:
    return json.loads(
        subprocess.run(
            [sys.executable, "-c", CHILD, op, json.dumps(cfg, default=str)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )


def full_copy(env: dict[str, str], endpoint: str, ckpt: Path, work: Path, concurrency: int) -> dict:
    """boto3: upload the checkpoint's files once, then download them twice in parallel."""
    base = {"endpoint": endpoint, "concurrency": concurrency, "bucket": BUCKET, "files": files_of(ckpt)}
    up = boto3_op("upload", env, **base, prefix="full-copy", dir=ckpt)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD,
                "download",
                json.dumps({**base, "prefix": "full-copy", "dir": str(work / f"full-copy-{s}")}),
            ],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for s in ("a", "b")
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("boto3 download failed")
    downs = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    wall = max(d["end"] for d in downs) - min(
        d["start"] for d in downs
    )  # first request to last byte, no interpreter start
    for s in ("a", "b"):
        shutil.rmtree(work / f"full-copy-{s}", ignore_errors=True)
    return {
        "upload_s": up["seconds"],
        "download_s": wall,
        "downloads_s": [d["seconds"] for d in downs],
        "total_s": up["seconds"] + wall,
        "bytes": up["bytes"],
    }


def verify(env: dict[str, str], store: str, version: int, folder: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "verify", "--store", store, "--version", str(version), str(folder)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"verify of {folder} at version {version} failed: {proc.stderr.strip()}")
    return time.perf_counter() - t0


# --- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace, ckpts: list[Path], work: Path) -> dict:
    from seaweed import SeaweedServer, free_port

    server = SeaweedServer(work / "seaweed")
    server.start()
    daemons: list[Daemon] = []
    try:
        server.make_bucket(BUCKET)
        env = {
            **os.environ,
            **server.env(),
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "WEIGHTSYNC_API_TOKEN": TOKEN,
        }
        store = f"s3://{BUCKET}/run"
        log("warm-up upload (SeaweedFS allocates volumes on the first writes)")
        boto3_op(
            "upload",
            env,
            endpoint=server.endpoint,
            concurrency=args.concurrency,
            bucket=BUCKET,
            prefix="warm-up",
            dir=ckpts[0],
            files=files_of(ckpts[0])[:1],
        )
        read_seconds(ckpts[-1])
        log("baseline: full-copy sync with boto3")
        full = full_copy(env, server.endpoint, ckpts[-1], work, args.concurrency)
        log(f"full copy: upload {full['upload_s']:.2f}s + 2 parallel downloads {full['download_s']:.2f}s")

        watch, logs = work / "watch", work / "logs"
        watch.mkdir()
        logs.mkdir()
        common = [
            "--store",
            store,
            "--poll-interval",
            str(args.poll),
            "--concurrency",
            str(args.concurrency),
            "--grace",
            "5",
        ]
        pub = Daemon(
            "publisher",
            [
                "publisher",
                *common,
                "--watch",
                str(watch),
                "--state-dir",
                str(work / "publisher-state"),
                "--listen",
                f"127.0.0.1:{(pp := free_port())}",
                "--region",
                "r0",
                *(["--fast-codec"] if args.fast_codec else ["--entropy-coder", args.entropy_coder]),
            ],
            env,
            logs,
            pp,
        )
        daemons.append(pub)
        subs = []
        for s in ("a", "b"):
            # the hook stands in for an inference server confirming that it loaded the new version,
            # which releases the standby slot for an in-place refill (weightsync.service.slots)
            extra = ["--no-fsync"] if args.no_fsync else []
            extra += ["--hook-command", "true", "--standby-hold", args.standby_hold]
            subs.append(
                Daemon(
                    f"subscriber-{s}",
                    [
                        "subscriber",
                        *common,
                        "--target",
                        str(work / f"sub-{s}"),
                        "--id",
                        f"sub-{s}",
                        "--region",
                        f"r{s}",
                        "--listen",
                        f"127.0.0.1:{(sp := free_port())}",
                        *extra,
                    ],
                    env,
                    logs,
                    sp,
                )
            )
        daemons += subs
        wait_healthy(daemons)

        rows = []
        for v, ckpt in enumerate(ckpts):
            dst = watch / f"step_{v:06d}"
            stage(ckpt, dst)
            t_read = read_seconds(dst)  # the first pass warms the page cache, as the trainer's write would
            pids = [d.proc.pid for d in daemons] + [server._proc.pid]
            cpu0 = [cpu_seconds(p) for p in pids]
            t0_wall, t0 = time.time(), time.perf_counter()
            (dst / MARKER).touch()  # checkpoint ready
            t1 = wait_version(pub, subs, v, args.timeout)
            t_sync = t1 - t0
            cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
            pst = pub.get("/v1/status")["last_publish"]
            sst = [s.get("/v1/status")["last_sync"] for s in subs]
            t_verify = [verify(env, store, v, work / f"sub-{s}" / "current") for s in ("a", "b")]
            t_settle = settle(subs, args.timeout) if args.standby_hold != "never" else 0.0
            row = {
                "version": v,
                "keyframe": pst["keyframe"],
                "raw_bytes": pst["raw_bytes"],
                "payload_bytes": pst["payload_bytes"],
                "uploaded_bytes": pst["uploaded_bytes"],
                "changed_fraction": pst["changed_fraction"],
                "publish_seconds": pst["seconds"],
                "published_at_s": pst["time"] - t0_wall,
                "fetched_bytes": [s["fetched_bytes"] for s in sst],
                "from_version": [s["from_version"] for s in sst],
                "fetch_s": [s["fetch_seconds"] for s in sst],
                "build_s": [s["build_seconds"] for s in sst],
                "swap_s": [s["swap_seconds"] for s in sst],
                "in_place": [s.get("in_place", False) for s in sst],
                "swapped_at_s": [s["time"] - t0_wall for s in sst],
                "t_sync_s": t_sync,
                "read_s": t_read,
                "verify_s": t_verify,
                "verified": True,
                "settle_s": t_settle,
                "cpu_s": dict(zip(("publisher", "subscriber-a", "subscriber-b", "seaweedfs"), cpu, strict=True)),
            }
            rows.append(row)
            log(
                f"v{v}: t_sync {t_sync:.2f}s (published at +{row['published_at_s']:.2f}s, swapped at "
                f"{', '.join(f'+{x:.2f}s' for x in row['swapped_at_s'])}); page-cache read {t_read:.3f}s; "
                f"uploaded {pst['uploaded_bytes'] / MiB:.1f} MiB; both verified; standby slots settled "
                f"{t_settle:.2f}s later"
            )
        return {"full_copy": full, "rows": rows}
    finally:
        for d in daemons:
            d.stop()
        server.stop()


def _pair(xs, fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(x) for x in xs)


def tables(res: dict, args: argparse.Namespace) -> str:
    full, rows = res["full_copy"], res["rows"]
    head = (
        "| version | kind | checkpoint | changed | uploaded | fetched per subscriber | published at | t_sync | "
        "page-cache read | t_sync / read | full copy | delta speed-up |"
    )
    out = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kind = "keyframe" if r["keyframe"] else "delta"
        changed = "-" if r["version"] == 0 else f"{100 * r['changed_fraction']:.2f}%"
        fetched = _pair([b / MiB for b in r["fetched_bytes"]], "{:,.1f}") + " MiB"
        out.append(
            f"| {r['version']} | {kind} | {r['raw_bytes'] / GiB:.2f} GiB | {changed} | "
            f"{r['uploaded_bytes'] / MiB:,.1f} MiB | {fetched} | {r['published_at_s']:.2f} s | "
            f"**{r['t_sync_s']:.2f} s** | "
            f"{r['read_s']:.3f} s | {r['t_sync_s'] / r['read_s']:.1f}x | {full['total_s']:.2f} s | "
            f"{full['total_s'] / r['t_sync_s']:.2f}x |"
        )
    note = (
        "Where the time goes (publisher phases are thread-seconds summed over its encode threads; "
        "subscriber figures are a / b):"
    )
    out += [
        "",
        note,
        "",
        (
            "| version | pulled from | publish read | diff | encode | upload | commit | publish total | fetch | "
            "build+verify | swap | "
            "CPU-s publisher | CPU-s subscribers | CPU-s SeaweedFS |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, c = r["publish_seconds"], r["cpu_s"]
        src = _pair(["empty" if x is None else f"v{x}" for x in r["from_version"]], "{}")
        src += " (in place)" if all(r.get("in_place", [False])) else ""
        out.append(
            f"| {r['version']} | {src} | {p.get('read', 0):.2f} | {p.get('diff', 0):.2f} | {p.get('encode', 0):.2f} | "
            f"{p.get('upload', 0):.2f} | {p.get('commit', 0):.2f} | {p.get('total', 0):.2f} | {_pair(r['fetch_s'])} | "
            f"{_pair(r['build_s'])} | {_pair([1e3 * x for x in r['swap_s']], '{:.1f}')} ms | "
            f"{c['publisher']:.1f} | {c['subscriber-a']:.1f} / {c['subscriber-b']:.1f} | {c['seaweedfs']:.1f} |"
        )
    copy = (
        f"Full copy (boto3, concurrency {args.concurrency}): upload_file {full['upload_s']:.2f} s, then two "
        "download_file "
        f"runs in parallel {full['download_s']:.2f} s (each {_pair(full['downloads_s'])} s); "
        f"{full['bytes'] / GiB:.2f} GiB up, twice that down; no checksums, no fsync, no atomic swap."
    )
    out += ["", copy]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="68 MiB checkpoints instead of 2.03 GiB (a smoke run)")
    ap.add_argument("--versions", type=int, default=4, help="checkpoints: one keyframe, then deltas (default 4)")
    ap.add_argument(
        "--concurrency", type=int, default=16, help="chunks / parts in flight, for the daemons and boto3 (default 16)"
    )
    ap.add_argument("--poll", type=float, default=0.2, help="daemons' --poll-interval in seconds (default 0.2)")
    ap.add_argument("--no-fsync", action="store_true", help="subscribers skip fsync of written files")
    ap.add_argument(
        "--fast-codec", action="store_true", help="the publisher codes deltas with `sparse`, not its entropy coder"
    )
    ap.add_argument(
        "--entropy-coder", choices=("ans", "ac"), default="ans", help="the publisher's entropy coder (default ans)"
    )
    ap.add_argument(
        "--standby-hold",
        default="30",
        help="subscribers' --standby-hold; with their swap hook only 'never' (always write new files) changes anything",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one version (default 600)")
    ap.add_argument("--workdir", help="server data, watch folder, slots (default: a temp dir, removed after)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--render", type=Path, help="only print the tables of a --json file written earlier")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        print(tables(saved, argparse.Namespace(**saved["args"])))
        return 0
    if args.versions < 2:
        ap.error("--versions must be at least 2 (a keyframe and a delta)")

    ckpts = trajectory("quick" if args.quick else "full", args.versions)
    raw = checkpoint_bytes(ckpts[0])
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ws-e2e-", dir=BENCH_DIR / ".cache"))
    work.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    try:
        res = run(args, ckpts, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()[0]
    print(
        f"\n### End to end on SeaweedFS (loopback): publisher + 2 subscribers, {raw / GiB:.2f} GiB bf16 checkpoints "
        f"({len(files_of(ckpts[0]))} files), lr {LR:g}, {args.versions} versions, {os.cpu_count()} CPUs\n"
    )
    print(tables(res, args))
    print(
        f"\nt_sync: COMPLETE written -> both subscribers' /v1/status report the version (daemon poll "
        f"{args.poll:g} s, status poll 50 ms); every version then passed `weightsync verify` on both `current` "
        "folders, "
        f"and the next checkpoint came once both standby slots held a version (after v0 the subscribers copy it into "
        f"their empty standby while idle: {res['rows'][0].get('settle_s', 0.0):.1f} s). "
        f"Codec: {'sparse (--fast-codec)' if args.fast_codec else args.entropy_coder}. "
        f"Subscribers {'without' if args.no_fsync else 'with'} fsync, swap hook `true`, --standby-hold "
        f"{args.standby_hold}. SeaweedFS, the publisher, both subscribers and "
        f"the boto3 baseline share {os.cpu_count()} CPUs; 1-minute load average {load0:.2f} at the start, "
        f"{load1:.2f} at "
        f"the end; run took {time.perf_counter() - t_start:.0f} s."
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"checkpoint_bytes": raw, "args": vars(args) | {"json": str(args.json)}, **res}, indent=2, default=str
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
