"""Four regions on one machine: rank publishers, one mirror and two subscribers per region, every
cross-region link shaped (bandwidth, RTT) and counted; per version, the time from the trainer's
COMPLETE to every subscriber swapped, stage by stage, the bytes on each link and the S3 requests by
kind (issue 19).

Topology (one SeaweedFS, one bucket per region, a ``linkproxy.LinkProxy`` on every path):

    trainer -> watch/step_N/  <- W rank publishers (rank 0 commits) --[train]--> bucket ws-train
    ws-train --[link-rK: shaped]--> mirror of region K --[dst-rK]--> bucket ws-rK
    ws-rK --[sub-rK-I]--> subscriber I of region K (A/B slots, swap hook ``true``)

The ``link-rK`` proxies carry what crosses an ocean (the mirror's reads of the training bucket);
the others are in-region paths, counted and not shaped. Every version is a checkpoint of a real
MoE trained at lr 1e-6 (``benchmarks/trajectory.py``, 2-3.5% of bf16 elements changed per step),
split into one safetensors file per rank; ``--quick`` uses a tiny ``SyntheticTrainer`` checkpoint.
The trainer's write is hard links of the cached files, then the ``COMPLETE`` marker: that is t0.
The next version comes once every subscriber serves this one, the subscribers' standby slots hold
a version, and every region's lazy-chunks note (docs/FORMAT.md) is gone or its link has carried no
chunk for a few seconds (a mirror that never copies a keyframe's full payloads: the row lists the
regions in ``lazy_notes_left``). Then, outside the
timed window, every subscriber's ``current`` folder is compared with the checkpoint byte for byte;
a difference ends the run with exit 1.

Stages, in seconds after t0, each the latest over the ranks, regions or subscribers (from the
proxies' request records and the subscribers' ``last_sync.time``):
``parts`` last part PUT, ``commit`` training HEAD PUT, ``notice`` the mirror's first read over the
link of the version's manifest, parts (listing included) or chunks (a pipelined mirror may start
before the commit), ``regional`` regional HEAD PUT, ``sub`` a subscriber's first
read of the manifest, ``swapped`` every subscriber swapped, ``lazy`` the note of lazily copied
chunks removed (a mirror that copies everything first writes none).

Configurations: the mirror of this checkout, or of ``--mirror-checkout PATH`` (``current``;
``--mirror-shards N`` runs N processes per region with ``--shard I/N``, ``--commit`` on the first),
and with ``--baseline-checkout PATH`` first the mirror of that checkout (``baseline``, one per
region), same inputs; each on fresh stores and daemons. Publishers and subscribers always run from
this checkout.
``--mirror-args`` / ``--baseline-mirror-args`` pass flags to the mirrors (none by default, so a
mirror that lacks a flag still runs; one that refuses a flag given stops the run with its message).

    python benchmarks/regions.py [--quick] [--regions 4] [--ranks 8] [--subscribers 2] [--versions 6]
        [--keyframe-interval 3] [--link-mbit 80] [--rtt-ms 150] [--jitter 5] [--mirror-args "--interval 1"]
        [--baseline-checkout PATH [--baseline-mirror-args ...]] [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO / "tests"))  # seaweed.py
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from linkproxy import LinkProxy, Record  # noqa: E402

TOKEN = "regions-benchmark-token"
MARKER = "COMPLETE"
TRAIN_BUCKET = "ws-train"
MB = 1e6
QUICK_MODEL = {"hidden": 128, "layers": 2, "experts": 4, "vocab": 1024}


class HarnessError(Exception):
    """The run cannot go on: a daemon died or refused its flags, a version never arrived."""


def log(msg: str) -> None:
    print(f"[regions {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- checkpoints ---------------------------------------------------------------------------------
def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in items}


def reshard(src: Path, dst: Path, files: int) -> None:
    """Write ``src``'s tensors as ``files`` safetensors files of about equal size into ``dst``
    (greedy by size, deterministic), with an index and the other files of ``src``."""
    from weightsync.demo import write_safetensors

    tensors: dict = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(_tensors(f))
    groups: list[dict] = [{} for _ in range(files)]
    sizes = [0] * files
    for name, t in sorted(tensors.items(), key=lambda kv: (-len(kv[1][2]), kv[0])):
        i = sizes.index(min(sizes))
        groups[i][name] = t
        sizes[i] += len(t[2])
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        write_safetensors(tmp / fname, dict(sorted(g.items())), {"format": "pt"})
        index.update({n: fname for n in g})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != MARKER:
            shutil.copyfile(extra, tmp / extra.name)
    (tmp / MARKER).touch()
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def checkpoints(args: argparse.Namespace) -> list[Path]:
    """The trajectory's step folders, each split into ``args.files`` files (cached)."""
    if args.quick:
        from weightsync.demo import SyntheticTrainer

        root = BENCH_DIR / ".cache" / f"regions-quick-{args.versions}v"
        dirs = [root / f"raw_{i:06d}" for i in range(args.versions)]
        if not all((d / "config.json").exists() for d in dirs):
            trainer = SyntheticTrainer(lr=1e-6, seed=0, **QUICK_MODEL)
            for i, d in enumerate(dirs):
                if i:
                    trainer.step()
                trainer.save(d)
    else:
        import common

        dirs = common.build_cached("moe-lr1e-06", 1e-6, max(6, args.versions))[: args.versions]
        root = BENCH_DIR / ".cache" / f"regions-{dirs[0].parent.name}"
    out = []
    for i, d in enumerate(dirs):
        dst = root / f"files{args.files}" / f"step_{i:06d}"
        if not (dst / MARKER).exists():
            reshard(d, dst, args.files)
        out.append(dst)
    return out


def files_of(ckpt: Path) -> list[str]:
    """The checkpoint's files (relative paths), without the marker."""
    return sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.relative_to(ckpt).parts != (MARKER,)
    )


def stage(src: Path, dst: Path) -> None:
    """The trainer's write without the trainer: ``src``'s files linked into ``dst`` (no marker)."""
    dst.mkdir(parents=True)
    for name in files_of(src):
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / name, dst / name)
        except OSError:
            shutil.copyfile(src / name, dst / name)


def differs(ckpt: Path, folder: Path) -> str | None:
    """How ``folder`` (a subscriber's ``current``) differs from checkpoint ``ckpt``, byte for byte;
    None if it holds exactly its files."""
    want = files_of(ckpt)
    have = sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).parts[0] != ".weightsync"
    )
    if have != want:
        return f"files {have} instead of {want}"
    for name in want:
        if not filecmp.cmp(ckpt / name, folder / name, shallow=False):
            return f"{name} differs"
    return None


# --- processes -----------------------------------------------------------------------------------
_LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG: never outlive the harness
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent died before the daemon started")
os.execv(sys.argv[2], sys.argv[2:])
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Daemon:
    """A ``weightsync`` daemon of a given checkout (cwd and PYTHONPATH), in its own process group,
    killed with the harness, logging to a file; its HTTP port is given by the flag ``listen``."""

    def __init__(
        self, name: str, group: str, args: list[str], listen: str, env: dict, logdir: Path, checkout: Path, port: int
    ):
        self.name, self.group = name, group
        self.target: Path | None = None  # a subscriber's folder
        self.logfile = logdir / f"{name}.log"
        self._args, self._listen, self._checkout = args, listen, checkout
        self._env = {**env, "PYTHONPATH": str(checkout)}
        self.spawn(port)

    def spawn(self, port: int) -> None:
        """Start the process, listening on ``port`` (again: after it lost a race for its port)."""
        self.port = port
        with open(self.logfile, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _LAUNCHER,
                    str(os.getpid()),
                    sys.executable,
                    "-m",
                    "weightsync.cli",
                    *self._args,
                    self._listen,
                    f"127.0.0.1:{port}",
                ],
                env=self._env,
                cwd=self._checkout,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def lost_port(self) -> bool:
        """It exited because another process took its port between the pick and its bind."""
        return not self.alive() and "address already in use" in self.tail(3)

    def get(self, path: str, timeout: float = 10.0) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        text = self.logfile.read_text(errors="replace") if self.logfile.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def check(self) -> None:
        if self.alive():
            return
        text = self.tail()
        if self.proc.returncode == 2 and ("unrecognized arguments" in text or "invalid choice" in text):
            refused = text.strip().splitlines()[-1]
            raise HarnessError(f"{self.name} refused its flags ({refused}); drop them from --mirror-args")
        raise HarnessError(f"{self.name} exited with {self.proc.returncode}:\n{text}")

    def stop(self, grace: float = 5.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue


def checkout_of(path: Path) -> Path:
    """``path`` if a daemon started there imports weightsync from it; else a HarnessError."""
    path = path.resolve()
    if not (path / "weightsync" / "cli.py").is_file():
        raise HarnessError(f"{path} is not a weightsync checkout (no weightsync/cli.py)")
    out = subprocess.run(
        [sys.executable, "-c", "import weightsync; print(weightsync.__file__)"],
        cwd=path,
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        check=False,
    )
    where = Path(out.stdout.strip() or "/nonexistent").resolve()
    if out.returncode != 0 or path not in where.parents:
        raise HarnessError(f"weightsync does not import from {path}: {out.stdout.strip()} {out.stderr.strip()[-300:]}")
    return path


def compile_kernels(checkout: Path) -> None:
    """Compile (or load) the codec's numba kernels into the checkout's on-disk cache once, so the
    daemons load them instead of each compiling them at once on shared CPUs."""
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.codec.jit"],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise HarnessError(f"compiling the codec kernels of {checkout} failed: {out.stderr.strip()[-500:]}")


WARM = ("codec kernels ready", "codec warm-up failed")  # what publishers and subscribers log once warm


def wait_healthy(daemons: list[Daemon], timeout: float) -> None:
    """Every daemon answers /healthz, and publishers and subscribers have their kernels loaded (the
    first version must not measure a compile)."""
    from seaweed import _free_ports  # below the ephemeral range: no outgoing connection takes them

    deadline = time.monotonic() + timeout
    for d in daemons:
        while True:
            if d.lost_port():
                log(f"{d.name} lost its port {d.port} to another process; starting it again on another")
                d.spawn(_free_ports(1)[0])
            d.check()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/healthz", timeout=2):
                    pass
                if d.group == "mirror" or any(w in d.tail(10_000) for w in WARM):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise HarnessError(f"{d.name} not healthy and warm after {timeout:.0f} s:\n{d.tail()}") from None
            time.sleep(0.2)


# --- one configuration ---------------------------------------------------------------------------
@dataclass
class Region:
    name: str
    bucket: str
    link: LinkProxy  # the cross-region link: the mirror reads the training bucket through it
    dst: LinkProxy  # the mirror's writes (and reads) of its regional bucket
    mirrors: list[Daemon] = field(default_factory=list)
    subs: list[tuple[Daemon, LinkProxy]] = field(default_factory=list)


def _version_of(body: bytes | None) -> int | None:
    try:
        return int(json.loads(body)["version"])
    except (TypeError, ValueError, KeyError):
        return None


def _first(records: list[Record], pred, attr: str = "start") -> float | None:
    times = [getattr(r, attr) for r in records if pred(r)]
    return min(times) if times else None


def _last(records: list[Record], pred) -> float | None:
    times = [r.end for r in records if pred(r)]
    return max(times) if times else None


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def _latest(xs: list[float | None]) -> float | None:
    """The latest of per-actor times; None if any actor has none (the stage did not happen for all)."""
    return None if not xs or any(x is None for x in xs) else max(xs)


class Configuration:
    """One configuration's stores, proxies and daemons, and its versions' measurements."""

    def __init__(self, args, label: str, checkout: Path, mirror_args: list[str], shards: int, server, work: Path):
        self.args, self.label, self.checkout, self.mirror_args = args, label, checkout, mirror_args
        self.shards = shards
        self.server, self.work = server, work
        self.prefix = f"{label}-{int(time.time())}"
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.proxies: list[LinkProxy] = []
        self.daemons: list[Daemon] = []
        self.direct = server.client()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEIGHTSYNC_"))},
            **{k: v for k, v in server.env().items() if k != "AWS_ENDPOINT_URL"},
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "WEIGHTSYNC_API_TOKEN": TOKEN,
        }
        self.regions: list[Region] = []
        self.publishers: list[Daemon] = []
        self.rng = random.Random(0)  # the same waits in every configuration
        self.ports: set[int] = set()  # the daemons' HTTP ports

    def _proxy(self, name: str, shaped: bool) -> LinkProxy:
        a = self.args
        opts = {"bandwidth": a.link_mbit * 1e6 / 8, "rtt": a.rtt_ms / 1e3} if shaped else {}
        p = LinkProxy(self.server.endpoint, name=name, **opts).start()
        self.proxies.append(p)
        return p

    def _daemon(self, name: str, group: str, args: list[str], checkout: Path | None = None) -> Daemon:
        from seaweed import _free_ports  # below the ephemeral range: no outgoing connection takes them

        port = next((p for p in _free_ports(4) if p not in self.ports), None) or _free_ports(1)[0]
        self.ports.add(port)
        flag = "--metrics-listen" if group == "mirror" else "--listen"
        d = Daemon(name, group, args, flag, self.env, self.logs, checkout or REPO, port)
        self.daemons.append(d)
        return d

    def start(self) -> None:
        a = self.args
        train_url = f"s3://{TRAIN_BUCKET}/{self.prefix}"
        self.train = self._proxy("train", shaped=False)
        self.watch = self.work / "watch"
        self.watch.mkdir(parents=True)
        for r in range(a.ranks):
            self.publishers.append(
                self._daemon(
                    f"publisher-{r}",
                    "publishers",
                    [
                        "publisher",
                        "--store",
                        train_url,
                        "--endpoint-url",
                        self.train.endpoint,
                        "--watch",
                        str(self.watch),
                        "--state-dir",
                        str(self.work / f"publisher-{r}"),
                        "--rank",
                        str(r),
                        "--world",
                        str(a.ranks),
                        *(["--commit"] if r == 0 else []),
                        "--keyframe-interval",
                        str(a.keyframe_interval),
                        "--chunk-mib",
                        str(a.chunk_mib),
                        "--poll-interval",
                        str(a.publisher_poll),
                        "--grace",
                        "5",
                        "--id",
                        f"publisher-{r}",
                        "--region",
                        "train",
                        *(["--fast-codec"] if a.fast_codec else []),
                    ],
                )
            )
        for k in range(1, a.regions + 1):
            name = f"r{k}"
            reg = Region(
                name, f"ws-{name}", self._proxy(f"link-{name}", shaped=True), self._proxy(f"dst-{name}", False)
            )
            shards = self.shards
            for j in range(shards):
                extra = ["--shard", f"{j}/{shards}", *(["--commit"] if j == 0 else [])] if shards > 1 else []
                reg.mirrors.append(
                    self._daemon(
                        f"mirror-{name}" + (f"-{j}" if shards > 1 else ""),
                        "mirror",
                        [
                            "mirror",
                            "--follow",
                            "--from",
                            train_url,
                            "--to",
                            f"s3://{reg.bucket}/{self.prefix}",
                            "--from-endpoint-url",
                            reg.link.endpoint,
                            "--to-endpoint-url",
                            reg.dst.endpoint,
                            "--region",
                            name,
                            *extra,
                            *self.mirror_args,
                        ],
                        self.checkout,
                    )
                )
            for i in range(a.subscribers):
                proxy = self._proxy(f"sub-{name}-{i}", shaped=False)
                sub = self._daemon(
                    f"subscriber-{name}-{i}",
                    "subscribers",
                    [
                        "subscriber",
                        "--store",
                        f"s3://{reg.bucket}/{self.prefix}",
                        "--endpoint-url",
                        proxy.endpoint,
                        "--target",
                        str(self.work / f"sub-{name}-{i}"),
                        "--id",
                        f"{name}-{i}",
                        "--region",
                        name,
                        "--poll-interval",
                        str(a.subscriber_poll),
                        "--hook-command",
                        "true",
                        "--grace",
                        "5",
                        *([] if a.fsync else ["--no-fsync"]),
                        *shlex.split(a.subscriber_args),
                    ],
                )
                sub.target = self.work / f"sub-{name}-{i}"
                reg.subs.append((sub, proxy))
            self.regions.append(reg)
        log(f"{self.label}: {len(self.daemons)} daemons and {len(self.proxies)} proxies started")
        wait_healthy(self.daemons, a.start_timeout)

    def stop(self) -> None:
        for d in self.daemons:  # all at once, then wait for each
            if d.alive():
                try:
                    os.killpg(d.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for d in self.daemons:
            d.stop()
        for p in self.proxies:
            p.stop()

    def subscribers(self) -> list[Daemon]:
        return [s for reg in self.regions for s, _ in reg.subs]

    def _alive(self) -> None:
        for d in self.daemons:
            d.check()

    def _has(self, bucket: str, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.direct.head_object(Bucket=bucket, Key=f"{self.prefix}/{key}")
            return True
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _quiet_seconds(self) -> float:
        """How long a link must carry no chunk for a mirror to count as idle: a few seconds more
        than one chunk takes to cross it, both ways of a round trip included."""
        a = self.args
        return 3.0 + 2 * (a.chunk_mib * (1 << 20)) / (a.link_mbit * 1e6 / 8) + 2 * a.rtt_ms / 1e3

    def _wait(self, v: int, t0: float) -> tuple[dict[str, dict], list[str]]:
        """Every subscriber's ``last_sync`` of version ``v``, once every region is whole and settled,
        and the regions whose lazy-chunks note stays while their link carries no chunk (a mirror
        that leaves a keyframe's full payloads behind: ``--keyframe-payloads never``)."""
        deadline = time.monotonic() + self.args.timeout
        subs = self.subscribers()
        lazy = f"lazy/{v:020d}.json"
        quiet = self._quiet_seconds()
        while True:
            self._alive()
            statuses = {s.name: s.get("/v1/status") for s in subs}
            done = all(st["current_version"] == v for st in statuses.values())
            if done:
                done = all(st["standby_version"] is not None for st in statuses.values())  # the idle copy of v0
            if done:
                now = time.time()
                noted = [reg for reg in self.regions if self._has(reg.bucket, lazy)]
                idle = [
                    reg.name
                    for reg in noted
                    if now - max([t0, *(r.end for r in reg.link.records(t0) if r.kind.startswith("GET chunks"))])
                    > quiet
                ]
                if len(idle) == len(noted):
                    return {n: st["last_sync"] for n, st in statuses.items()}, idle
            if time.monotonic() > deadline:
                states = {n: (st["current_version"], st["state"], st["reason"]) for n, st in statuses.items()}
                raise HarnessError(f"version {v} not everywhere after {self.args.timeout:.0f} s: {states}")
            time.sleep(0.2)

    def _manifest(self, v: int) -> dict:
        body = self.direct.get_object(Bucket=TRAIN_BUCKET, Key=f"{self.prefix}/versions/{v:020d}.json")["Body"].read()
        return json.loads(body)

    def _cpu(self) -> dict[str, float]:
        out: Counter[str] = Counter()
        for d in self.daemons:
            out[d.group] += cpu_seconds(d.proc.pid)
        out["seaweedfs"] = cpu_seconds(self.server._proc.pid) if self.server._proc else 0.0
        out["harness"] = cpu_seconds(os.getpid())
        return dict(out)

    def version(self, v: int, ckpt: Path) -> dict:
        dst = self.watch / f"step_{v:06d}"
        stage(ckpt, dst)
        time.sleep(self.rng.uniform(0, self.args.jitter))
        cpu0 = self._cpu()
        t0 = time.time()
        (dst / MARKER).touch()  # the trainer's COMPLETE
        syncs, notes_left = self._wait(v, t0)
        time.sleep(self.args.settle)
        t1 = time.time()
        cpu1 = self._cpu()
        for sub in self.subscribers():  # outside the timed window: every subscriber serves the trainer's bytes
            wrong = differs(ckpt, sub.target / "current")
            if wrong is not None:
                raise HarnessError(f"{sub.name} serves wrong bytes at version {v}: {wrong}")
        m = self._manifest(v)
        row = self._row(v, t0, t1, m, syncs, {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1})
        row["lazy_notes_left"] = notes_left  # regions holding the version without some of its chunks
        return row

    def _row(self, v: int, t0: float, t1: float, m: dict, syncs: dict, cpu: dict) -> dict:
        man = f"versions/{v:020d}.json"
        parts = f"parts/{v:020d}/"
        lazy = f"lazy/{v:020d}.json"

        def window(p: LinkProxy) -> list[Record]:
            return [r for r in p.records(since=t0) if r.end < t1]

        def names(r: Record) -> bool:  # a read of the version's manifest or of its parts (a listing too)
            return r.method == "GET" and (man in r.path or parts in r.path)

        tr = window(self.train)
        row: dict = {
            "version": v,
            "keyframe": bool(m["keyframe"]),
            "parent": m.get("parent"),
            "changed_fraction": m["stats"].get("changed", 0) / max(1, m["stats"].get("elements", 1)),
            "chunks": len(m["chunks"]),
            "chunk_bytes": sum(c["size"] for c in m["chunks"]),
            "uploaded_bytes": m["stats"].get("uploaded_bytes"),
            "parts": _rel(_last(tr, lambda r: r.method == "PUT" and parts in r.path), t0),
            "commit": _rel(_first(tr, lambda r: r.kind == "PUT HEAD-key" and _version_of(r.body) == v, "end"), t0),
            "regions": {},
            "cpu_s": cpu,
            "window_s": round(t1 - t0, 3),
            "verified": True,  # every subscriber's current folder equals the checkpoint byte for byte
        }
        train_requests: Counter[str] = Counter(self.train.snapshot(t0, t1)["requests"])
        regional_requests: Counter[str] = Counter()
        for reg in self.regions:
            lk, ds = window(reg.link), window(reg.dst)
            link_snap, dst_snap = reg.link.snapshot(t0, t1), reg.dst.snapshot(t0, t1)
            train_requests.update(link_snap["requests"])
            regional_requests.update(dst_snap["requests"])
            lazy_put = any(r.method == "PUT" and lazy in r.path for r in ds)
            subs = {}
            for sub, proxy in reg.subs:
                sw = window(proxy)
                snap = proxy.snapshot(t0, t1)
                regional_requests.update(snap["requests"])
                sync = syncs[sub.name]
                subs[sub.name] = {
                    "notice": _rel(_first(sw, lambda r: r.method == "GET" and man in r.path), t0),
                    "swapped": _rel(sync["time"], t0) if sync and sync["version"] == v else None,
                    "fetched_bytes": snap["bytes_down"],
                    "requests": snap["requests"],
                }
            head_at = _first(ds, lambda r: r.kind == "PUT HEAD-key" and _version_of(r.body) == v, "end")
            before = sum(r.down + r.up for r in lk if head_at is not None and r.end <= head_at)
            row["regions"][reg.name] = {
                "notice": _rel(_first(lk, lambda r: names(r) or r.kind.startswith("GET chunks")), t0),
                "manifest": _rel(_first(ds, lambda r: r.method == "PUT" and man in r.path, "end"), t0),
                "regional": _rel(head_at, t0),
                "link_bytes_before_commit": before,  # what crossed before the regional head moved
                "lazy": _rel(_first(ds, lambda r: r.method == "DELETE" and lazy in r.path, "end"), t0)
                if lazy_put
                else None,
                "last_chunk": _rel(_last(lk, lambda r: r.kind.startswith("GET chunks")), t0),
                "link_bytes_down": link_snap["bytes_down"],
                "link_bytes_up": link_snap["bytes_up"],
                "link_requests": link_snap["requests"],
                "link_by_kind": link_snap["by_kind"],
                "regional_puts": sum(n for k, n in dst_snap["requests"].items() if k.startswith("PUT")),
                "subscribers": subs,
            }
        regs = list(row["regions"].values())
        subs_all = [s for reg in regs for s in reg["subscribers"].values()]
        row["notice"] = _latest([reg["notice"] for reg in regs])
        row["regional"] = _latest([reg["regional"] for reg in regs])
        row["sub"] = _latest([s["notice"] for s in subs_all])
        row["swapped"] = _latest([s["swapped"] for s in subs_all])
        row["first_swapped"] = min((s["swapped"] for s in subs_all if s["swapped"] is not None), default=None)
        lazies = [reg["lazy"] for reg in regs if reg["lazy"] is not None]
        row["lazy"] = max(lazies) if lazies else None
        row["link_bytes"] = [reg["link_bytes_down"] + reg["link_bytes_up"] for reg in regs]
        row["train_requests"] = dict(sorted(train_requests.items()))
        row["regional_requests"] = dict(sorted(regional_requests.items()))
        return row


def run_configuration(
    args, label: str, checkout: Path, mirror_args: list[str], shards: int, server, ckpts, work: Path
) -> dict:
    conf = Configuration(args, label, checkout, mirror_args, shards, server, work)
    t_start = time.perf_counter()
    rows = []
    try:
        conf.start()
        log(f"{label}: daemons up in {time.perf_counter() - t_start:.0f} s")
        for v, ckpt in enumerate(ckpts):
            row = conf.version(v, ckpt)
            rows.append(row)
            kind = "keyframe" if row["keyframe"] else "delta"
            log(
                f"{label} v{v} ({kind}): every subscriber swapped at +{row['swapped']:.2f} s; "
                f"{sum(row['link_bytes']) / len(row['link_bytes']) / MB:.2f} MB per link"
                + (f"; lazy copy done at +{row['lazy']:.2f} s" if row["lazy"] is not None else "")
            )
    finally:
        conf.stop()
    return {
        "label": label,
        "checkout": str(checkout),
        "mirror_args": mirror_args,
        "mirror_shards": shards,
        "rows": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }


# --- report --------------------------------------------------------------------------------------
def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _req(reqs: dict, *prefixes: str) -> int:
    return sum(n for k, n in reqs.items() if k.startswith(prefixes))


def lazy_cell(r: dict) -> str:
    """When the lazy copy of a version ended, or in how many regions its note stayed."""
    left = r.get("lazy_notes_left") or []
    return f"note stays in {len(left)}" if left else _s(r["lazy"])


def table(conf: dict) -> str:
    out = [
        f"Configuration **{conf['label']}** ({conf.get('mirror_shards', 1)} mirror process(es) per region from "
        f"{conf['checkout']}, mirror args "
        f"`{' '.join(conf['mirror_args']) or '(defaults)'}`); seconds after COMPLETE, latest over ranks, "
        "regions, subscribers:",
        "",
        "| v | kind | changed | parts | commit | mirror notice | regional commit | subscriber notice | "
        "all swapped | lazy copy done | MB per link | link GETs: chunk / other / HEAD-key / LIST | "
        "regional: chunk PUTs / chunk GETs / HEAD-key reads |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in conf["rows"]:
        links = [reg["link_requests"] for reg in r["regions"].values()]
        per = lambda *p: round(sum(_req(x, *p) for x in links) / len(links))  # noqa: E731
        rr = r["regional_requests"]
        kind = "keyframe" if r["keyframe"] else "delta"
        if r["keyframe"] and r["parent"] is None:
            kind = "first keyframe"
        out.append(
            f"| {r['version']} | {kind} | {100 * r['changed_fraction']:.2f}% | {_s(r['parts'])} | {_s(r['commit'])} | "
            f"{_s(r['notice'])} | {_s(r['regional'])} | {_s(r['sub'])} | **{_s(r['swapped'])}** | {lazy_cell(r)} | "
            f"{sum(r['link_bytes']) / len(r['link_bytes']) / MB:.2f} | "
            f"{per('GET chunks')} / {per('GET versions', 'GET parts', 'GET lazy', 'GET signatures', 'GET marker')} / "
            f"{per('GET HEAD-key', 'HEAD HEAD-key')} / {per('LIST')} | "
            f"{_req(rr, 'PUT chunks')} / {_req(rr, 'GET chunks')} / {_req(rr, 'GET HEAD-key', 'HEAD HEAD-key')} |"
        )
    return "\n".join(out)


def summary(conf: dict) -> str:
    later = [r for r in conf["rows"] if r["parent"] is not None]

    def stat(rows: list[dict], key: str) -> str:
        xs = [r[key] for r in rows if r[key] is not None]
        return "-" if not xs else f"{sum(xs) / len(xs):.2f} s mean, {max(xs):.2f} s max"

    deltas = [r for r in later if not r["keyframe"]]
    keys = [r for r in later if r["keyframe"]]
    mb = lambda rows: sum(sum(r["link_bytes"]) / len(r["link_bytes"]) for r in rows) / max(1, len(rows)) / MB  # noqa: E731
    return (
        f"{conf['label']}: COMPLETE -> all swapped: deltas {stat(deltas, 'swapped')} ({mb(deltas):.2f} MB per link); "
        f"keyframes {stat(keys, 'swapped')} ({mb(keys):.2f} MB per link); lazy copy done {stat(keys, 'lazy')}; "
        f"run {conf['seconds']:.0f} s"
    )


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def stage_means(rows: list[dict]) -> dict[str, float | None]:
    """Mean durations of each stage over ``rows``: each region's and subscriber's own intervals
    (a mirror's copy is its notice to its regional commit, a subscriber's wait is its region's
    commit to its own notice), then averaged."""

    def per_row(r: dict) -> dict[str, float | None]:
        regs = list(r["regions"].values())
        waits, applies = [], []
        for reg in regs:
            for sub in reg["subscribers"].values():
                if None not in (sub["notice"], reg["regional"], sub["swapped"]):
                    waits.append(sub["notice"] - reg["regional"])
                    applies.append(sub["swapped"] - sub["notice"])
        before = _mean([x.get("link_bytes_before_commit") for x in regs])
        both = lambda a, b: [x[b] - x[a] if None not in (x[a], x[b]) else None for x in regs]  # noqa: E731
        return {
            "publish": r["parts"],
            "commit": None if None in (r["parts"], r["commit"]) else r["commit"] - r["parts"],
            "mirror_wait": _mean([None if x["notice"] is None else x["notice"] - r["commit"] for x in regs]),
            "copy": _mean(both("notice", "regional")),
            "subscriber_wait": _mean(waits),
            "fetch_apply": _mean(applies),
            "swapped": r["swapped"],
            "lazy": r["lazy"],
            "mb_per_link": sum(r["link_bytes"]) / len(r["link_bytes"]) / MB,
            "mb_before_commit": None if before is None else before / MB,
            "link_requests": sum(sum(x["link_requests"].values()) for x in regs) / len(regs),
        }

    per = [per_row(r) for r in rows]
    return {k: _mean([p[k] for p in per]) for k in (per[0] if per else {})}


STAGES = (
    ("publish", "publish (parts)"),
    ("commit", "merge commit"),
    ("mirror_wait", "commit -> mirror notice"),
    ("copy", "mirror copy -> regional commit"),
    ("subscriber_wait", "regional commit -> subscriber notice"),
    ("fetch_apply", "subscriber fetch + apply + swap"),
    ("swapped", "**COMPLETE -> all swapped**"),
    ("lazy", "COMPLETE -> lazy copy done"),
    ("mb_per_link", "MB per link"),
    ("mb_before_commit", "MB per link before the regional commit"),
    ("link_requests", "requests per link"),
)


def comparison(res: dict) -> str:
    """Mean stage durations (seconds) of deltas and of keyframes after the first, per configuration."""
    cols, data = [], []
    for conf in res["configurations"]:
        later = [r for r in conf["rows"] if r["parent"] is not None]
        for kind, rows in (
            ("deltas", [r for r in later if not r["keyframe"]]),
            ("keyframes", [r for r in later if r["keyframe"]]),
        ):
            if rows:
                cols.append(f"{conf['label']}: {kind} ({len(rows)})")
                data.append(stage_means(rows))
    out = ["| stage (mean) | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for key, name in STAGES:
        fmt = "{:.0f}" if key == "link_requests" else "{:.2f}"
        out.append(f"| {name} | " + " | ".join("-" if d.get(key) is None else fmt.format(d[key]) for d in data) + " |")
    return "\n".join(out)


def requests_table(conf: dict) -> str:
    """Requests by kind per version: the training bucket (publishers and mirrors) and the regional
    buckets (mirrors and subscribers), all regions together."""
    kinds = sorted({k for r in conf["rows"] for k in (*r["train_requests"], *r["regional_requests"])})
    out = [
        f"Requests by kind, {conf['label']} (training bucket / all regional buckets):",
        "",
        "| kind | " + " | ".join(f"v{r['version']}" for r in conf["rows"]) + " |",
        "|---|" + "---:|" * len(conf["rows"]),
    ]
    for k in kinds:
        cells = [f"{r['train_requests'].get(k, 0)} / {r['regional_requests'].get(k, 0)}" for r in conf["rows"]]
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# --- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny run: 2 regions, 2 ranks, 1 subscriber each, 3 versions")
    ap.add_argument("--regions", type=int, help="inference regions (default 4; quick 2)")
    ap.add_argument("--ranks", type=int, help="rank publishers, each one file of every version (default 8; quick 2)")
    ap.add_argument("--subscribers", type=int, help="subscribers per region (default 2; quick 1)")
    ap.add_argument("--versions", type=int, help="versions published, the first a keyframe (default 6; quick 3)")
    ap.add_argument("--keyframe-interval", type=int, help="a keyframe every K versions (default 3; quick 2)")
    ap.add_argument("--files", type=int, help="safetensors files per checkpoint (default: one per rank)")
    ap.add_argument("--chunk-mib", type=int, default=1, help="publishers' chunk size in MiB (default 1)")
    ap.add_argument("--fast-codec", action="store_true", help="publishers code deltas with `sparse`")
    ap.add_argument("--link-mbit", type=float, default=80.0, help="bandwidth of each cross-region link (default 80)")
    ap.add_argument("--rtt-ms", type=float, default=150.0, help="round trip of each cross-region link (default 150)")
    ap.add_argument("--publisher-poll", type=float, default=0.5, help="publishers' --poll-interval (default 0.5)")
    ap.add_argument("--subscriber-poll", type=float, default=1.0, help="subscribers' --poll-interval (default 1)")
    ap.add_argument("--subscriber-args", default="", help="extra subscriber flags, shell-quoted")
    ap.add_argument("--mirror-args", default="", help="extra flags of this checkout's mirrors, shell-quoted")
    ap.add_argument(
        "--mirror-checkout",
        type=Path,
        help="run the current configuration's mirrors from this checkout (default: this one)",
    )
    ap.add_argument(
        "--mirror-shards",
        type=int,
        default=1,
        help="mirror processes per region in the current configuration: --shard I/N each, --commit on shard 0 "
        "(default 1: one mirror, no --shard)",
    )
    ap.add_argument("--baseline-checkout", type=Path, help="also run the mirrors of this checkout first, same inputs")
    ap.add_argument("--baseline-mirror-args", default="", help="extra flags of the baseline's mirrors")
    ap.add_argument("--fsync", action="store_true", help="subscribers fsync what they write (default: --no-fsync)")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds between one version done and the next")
    ap.add_argument(
        "--jitter",
        type=float,
        help="up to this many more seconds (seeded, uniform) before each COMPLETE, so that polls of a fixed "
        "interval meet versions at random phases (default 5; quick 0)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one version may take (default 300)")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds for the daemons to start")
    ap.add_argument("--workdir", type=Path, help="server data, folders, logs (default: a temp dir, removed after)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    quick = args.quick
    for name, full, small in (
        ("regions", 4, 2),
        ("ranks", 8, 2),
        ("subscribers", 2, 1),
        ("versions", 6, 3),
        ("keyframe_interval", 3, 2),
        ("jitter", 5.0, 0.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.files = args.files or args.ranks
    if min(args.regions, args.ranks, args.subscribers, args.files) < 1 or args.versions < 2:
        ap.error("regions, ranks, subscribers and files must be at least 1, versions at least 2")
    if args.mirror_shards < 1:
        ap.error("--mirror-shards must be at least 1")
    if args.jitter < 0 or args.settle < 0:
        ap.error("--jitter and --settle must not be negative")
    if args.keyframe_interval < 1 or args.chunk_mib < 1 or args.link_mbit <= 0 or args.rtt_ms < 0:
        ap.error("--keyframe-interval and --chunk-mib must be at least 1, --link-mbit positive, --rtt-ms >= 0")
    if args.ranks > args.files:
        ap.error(f"--ranks {args.ranks} needs at least as many files (--files {args.files}): a rank owns whole files")
    for flag in ("mirror_args", "baseline_mirror_args", "subscriber_args"):
        try:
            shlex.split(getattr(args, flag))
        except ValueError as exc:
            ap.error(f"--{flag.replace('_', '-')}: {exc}")
    return args


def run(args: argparse.Namespace) -> dict:
    """Every configuration on one SeaweedFS; returns the results (also what ``--json`` writes)."""
    from seaweed import SeaweedServer

    configs = []
    if args.baseline_checkout is not None:
        configs.append(("baseline", checkout_of(args.baseline_checkout), shlex.split(args.baseline_mirror_args), 1))
    mirror_checkout = REPO if args.mirror_checkout is None else checkout_of(args.mirror_checkout)
    configs.append(("current", mirror_checkout, shlex.split(args.mirror_args), args.mirror_shards))
    if args.workdir is not None and any((args.workdir / label).exists() for label, *_ in configs):
        raise HarnessError(f"{args.workdir} already holds a run: give a new --workdir")
    ckpts = checkpoints(args)
    compile_kernels(REPO)
    raw = sum((ckpts[0] / f).stat().st_size for f in files_of(ckpts[0]))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ws-regions-"))
    work.mkdir(parents=True, exist_ok=True)
    server = SeaweedServer(work / "seaweed")
    results = []
    try:
        server.start()
        for b in (TRAIN_BUCKET, *(f"ws-r{k}" for k in range(1, args.regions + 1))):
            server.make_bucket(b)
        for label, checkout, margs, shards in configs:
            log(f"{label}: mirrors from {checkout}, args {margs or '(defaults)'}, {shards} per region")
            results.append(run_configuration(args, label, checkout, margs, shards, server, ckpts, work / label))
    finally:
        server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "checkpoint_bytes": raw,
        "files": len(files_of(ckpts[0])),
        "cpus": os.cpu_count(),
        "configurations": results,
    }


def report(res: dict) -> str:
    a = res["args"]
    head = (
        f"### Regions: {a['regions']} regions x {a['subscribers']} subscribers, {a['ranks']} rank publishers, "
        f"{res['checkpoint_bytes'] / MB:.1f} MB checkpoints in {res['files']} files, {a['versions']} versions, "
        f"keyframe every {a['keyframe_interval']}, {a['chunk_mib']} MiB chunks, links {a['link_mbit']:g} Mbit/s and "
        f"{a['rtt_ms']:g} ms RTT, polls: publishers {a['publisher_poll']:g} s, subscribers {a['subscriber_poll']:g} s, "
        f"0-{a['jitter']:g} s before each COMPLETE; "
        f"{res['cpus']} CPUs"
    )
    parts = [head, ""]
    for conf in res["configurations"]:
        parts += [table(conf), "", requests_table(conf), ""]
    parts += [comparison(res), ""]
    parts += [summary(conf) for conf in res["configurations"]]
    return "\n".join(parts)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        res = run(args)
    except HarnessError as exc:
        print(f"regions: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("regions: interrupted; every daemon and server it started is stopped", file=sys.stderr)
        return 130
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
