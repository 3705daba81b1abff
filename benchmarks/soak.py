"""Soak: many versions through a publisher daemon, SeaweedFS and several subscriber daemons, with
random S3 faults injected by ``tests/faultproxy.py`` (and SeaweedFS restarted now and then).

A trainer thread writes one checkpoint per ``--interval`` seconds into the publisher's watched
folder (folder first, then ``COMPLETE``) and deletes old ones once published. Every daemon reaches
S3 through the fault proxy, which answers a share ``--fault-rate`` of all requests with a fault
(503 SlowDown, 500, reset, truncated body, lost answer, delay), split evenly between the kinds.
While it runs, a sampler reads each daemon's RSS from ``/proc/PID/status`` and compares what each
subscriber's ``current`` serves, file by file, with the checkpoint of the version it claims
(``wrong bytes served`` counts the bytes of every file that differs). At the end every subscriber
must serve the last version byte for byte, and each daemon's RSS in the last quarter of the run is
compared with the first quarter (both after the warm-up: from the moment every subscriber serves
version ``versions // 5`` or later). The first checkpoint is written once every daemon has loaded
its codec kernels: on a loaded machine that load ended several versions into a run, and a CI run
measured it (52 MiB) as growth.

    python benchmarks/soak.py                                  # 200 versions, 3 subscribers, <= 10 min
    python benchmarks/soak.py --versions 50 --fault-rate 0.05 --json soak.json

Exits 1 unless every check passed. The short variant runs in the test suite
(``tests/integration/test_soak.py``, which imports :func:`run_soak`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # seaweed.py, faultproxy.py
sys.path.insert(0, str(BENCH_DIR.parent))

from faultproxy import FaultProxy, Rule  # noqa: E402

import weightsync  # noqa: E402
from weightsync.demo import SyntheticTrainer

MODEL = dict(hidden=64, layers=2, experts=2, vocab=256)  # ~0.4 MB per checkpoint
FAULT_KINDS = ("503", "500", "reset", "truncate", "drop", "delay")


@dataclass
class SoakConfig:
    versions: int = 200
    subscribers: int = 3
    fault_rate: float = 0.02  # share of all S3 requests answered with a fault
    interval: float = 1.0  # seconds between checkpoints
    deadline: float = 600.0  # the whole run, seconds
    store_restarts: int = 1  # SeaweedFS stopped for 2 s this many times, evenly spread
    sample_every: float = 0.5
    seed: int = 0


@dataclass
class SoakResult:
    config: dict
    seconds: float = 0.0
    published: int = 0  # versions committed
    delivered: int = 0  # swaps across all subscribers
    final_versions: dict = field(default_factory=dict)  # subscriber -> version served at the end
    requests: int = 0
    faults: dict = field(default_factory=dict)  # kind -> injected
    faults_total: int = 0
    store_restarts: int = 0
    retries: dict = field(default_factory=dict)  # daemon -> weightsync_store_retries_total
    loop_errors: dict = field(default_factory=dict)
    checksum_failures: int = 0
    samples: int = 0  # served folders compared with their checkpoint
    bytes_compared: int = 0
    wrong_bytes: int = 0
    wrong_examples: list = field(default_factory=list)
    rss_mib: dict = field(default_factory=dict)  # daemon -> {first_quarter, last_quarter, max, samples}
    warm_seconds: float = 0.0  # RSS quarters are taken after this: every subscriber serves a fifth of the run
    identical_at_end: bool = False
    exit_codes: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and self.identical_at_end
            and self.wrong_bytes == 0
            and self.checksum_failures == 0
            and self.published == self.config["versions"]
            and set(self.exit_codes.values()) <= {0}
        )


WARM = ("codec kernels ready", "codec warm-up failed")  # what each daemon logs once its kernels are loaded


# --- small process and HTTP helpers -------------------------------------------------------------------------
def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Daemon:
    def __init__(self, name: str, role: str, args: list, work: Path, env: dict):
        self.name, self.role = name, role
        self.url = ""  # port 0: the daemon logs the port it got
        self.log_path = work / f"{name}.log"
        argv = [sys.executable, "-m", "weightsync.cli", role, *map(str, args), "--listen", "127.0.0.1:0"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.rss: list[tuple[float, float]] = []

    def wait_up(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            if not self.url and (m := re.search(r"listening url=(http://127\.0\.0\.1:\d+)", self.log())):
                self.url = m.group(1)
            try:
                if self.url and _get(self.url + "/healthz", 1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not come up:\n{self.log()}")

    def wait_warm(self, deadline: float) -> None:
        """Until the daemon's background warm-up has loaded its codec kernels (it serves meanwhile):
        a run whose first versions overlap that load measures it as growth after the warm-up."""
        while not any(w in self.log() for w in WARM):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not load its codec kernels:\n{self.log()}")
            time.sleep(0.05)

    def status(self) -> dict:
        return json.loads(_get(self.url + "/v1/status")[1])

    def metrics(self) -> str:
        return _get(self.url + "/metrics")[1]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


# --- the run ---------------------------------------------------------------------------------------------------
def _digest(folder: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and ".weightsync" not in rel.split("/") and rel != "COMPLETE":
            data = p.read_bytes()
            out[rel] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def _served(target: Path) -> tuple[int, dict[str, tuple[int, str]]] | None:
    """(version, files) of what ``target/current`` serves, read consistently; None if it moved."""
    for _ in range(3):
        try:
            link = os.readlink(target / "current")
            slot = target / link
            state = (slot / ".weightsync" / "state.json").read_bytes()
            files = _digest(slot)
            if os.readlink(target / "current") == link and (slot / ".weightsync" / "state.json").read_bytes() == state:
                return json.loads(state)["version"], files
        except (OSError, ValueError, KeyError):
            pass
    return None


def run_soak(cfg: SoakConfig, work: Path, server, bucket: str, prefix: str = "soak", log=print) -> SoakResult:
    """Run the soak against a started ``SeaweedServer`` (``server``), in ``work``."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    res = SoakResult(config=asdict(cfg))
    url = f"s3://{bucket}/{prefix}"
    proxy = FaultProxy(server.endpoint, seed=cfg.seed).start()
    share = cfg.fault_rate / len(FAULT_KINDS)
    for kind in FAULT_KINDS:
        proxy.add(Rule(kind, probability=share / (1 - share * FAULT_KINDS.index(kind)), delay=0.2))
    env = {**os.environ, **server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    direct = {**server.env()}
    os.environ.update({k: v for k, v in direct.items() if k != "AWS_ENDPOINT_URL"})  # boto3's chain, for our own reads
    watch = work / "watch"
    watch.mkdir(exist_ok=True)
    expected: dict[int, dict[str, tuple[int, str]]] = {}
    t0 = time.monotonic()
    deadline = t0 + cfg.deadline
    daemons: list[_Daemon] = []
    stop = threading.Event()
    lock = threading.Lock()

    def repo() -> weightsync.Repo:
        return weightsync.open_repo(url, endpoint_url=direct["AWS_ENDPOINT_URL"])

    try:
        pub = _Daemon(
            "publisher",
            "publisher",
            [
                "--store",
                url,
                "--watch",
                watch,
                "--state-dir",
                work / "pubstate",
                "--poll-interval",
                0.2,
                "--id",
                "soak-pub",
            ],
            work,
            env,
        )
        daemons.append(pub)
        subs = [
            _Daemon(
                f"subscriber-{i}",
                "subscriber",
                [
                    "--store",
                    url,
                    "--target",
                    work / f"sub-{i}",
                    "--no-fsync",
                    "--poll-interval",
                    0.2,
                    "--id",
                    f"soak-sub-{i}",
                    "--ledger-interval",
                    5,
                ],
                work,
                env,
            )
            for i in range(cfg.subscribers)
        ]
        daemons += subs
        for d in daemons:
            d.wait_up()
        for d in daemons:
            d.wait_warm(deadline)
            if WARM[0] not in d.log():  # it goes on, loading kernels as deltas need them: in its RSS
                res.errors.append(f"{d.name}: the codec warm-up failed (its log says why)")

        def trainer() -> None:
            t = SyntheticTrainer(seed=cfg.seed, **MODEL)
            store = repo()
            for i in range(cfg.versions):
                if stop.is_set():
                    return
                if i:
                    t.step()
                d = t.save(watch / f"step_{i:06d}")
                with lock:
                    expected[i] = _digest(d)
                (d / "COMPLETE").write_text("")
                try:
                    head = store.head_version() if i % 5 == 0 else None
                except weightsync.WeightsyncError:  # the store may be down (restarts)
                    head = None
                if head is not None:  # keep the last few checkpoints on disk
                    for old in sorted(watch.iterdir()):
                        step = int(old.name.split("_")[1])
                        if step < head - 1:
                            shutil.rmtree(old, ignore_errors=True)
                stop.wait(cfg.interval)

        def sampler() -> None:
            while not stop.is_set():
                now = time.monotonic() - t0
                if not res.warm_seconds and all(
                    (g := _served(work / f"sub-{i}")) and g[0] >= cfg.versions // 5 for i in range(len(subs))
                ):
                    res.warm_seconds = round(now, 1)
                for d in daemons:
                    rss = _rss_mib(d.proc.pid)
                    if rss is not None:
                        d.rss.append((now, rss))
                for i, s in enumerate(subs):
                    got = _served(work / f"sub-{i}")
                    if got is None:
                        continue
                    version, files = got
                    with lock:
                        want = expected.get(version)
                    res.samples += 1
                    if want is None:
                        res.wrong_bytes += sum(n for n, _ in files.values())
                        res.wrong_examples.append(f"sub-{i} serves version {version}, never published")
                        continue
                    for path in set(files) | set(want):
                        size = (files.get(path) or want.get(path))[0]
                        res.bytes_compared += size
                        if files.get(path) != want.get(path):
                            res.wrong_bytes += size
                            res.wrong_examples.append(f"sub-{i} version {version}: {path}")
                stop.wait(cfg.sample_every)

        threads = [threading.Thread(target=trainer, daemon=True), threading.Thread(target=sampler, daemon=True)]
        for th in threads:
            th.start()
        last = cfg.versions - 1
        restarts_at = [round(cfg.versions * (k + 1) / (cfg.store_restarts + 1)) for k in range(cfg.store_restarts)]
        store = repo()
        next_report = 0.0
        while time.monotonic() < deadline:
            try:
                head = store.head_version()
            except weightsync.WeightsyncError:
                head = None
            if restarts_at and head is not None and head >= restarts_at[0]:
                restarts_at.pop(0)
                log(f"  [{time.monotonic() - t0:6.1f}s] head {head}: stopping SeaweedFS for 2 s")
                server.stop()
                time.sleep(2.0)
                server.start()
                res.store_restarts += 1
            if head == last and all(s.status().get("current_version") == last for s in subs):
                break
            if time.monotonic() - t0 >= next_report:
                cur = [s.status().get("current_version") for s in subs]
                log(f"  [{time.monotonic() - t0:6.1f}s] head {head}, subscribers {cur}, faults {proxy.total_injected}")
                next_report += 30.0
            time.sleep(0.5)
        else:
            res.errors.append(f"deadline of {cfg.deadline:.0f} s reached before every subscriber served version {last}")
        stop.set()
        for th in threads:
            th.join(30)
        res.seconds = round(time.monotonic() - t0, 1)
        store = repo()
        res.published = len(store.versions()) if store.head_version() is not None else 0
        with lock:
            want = expected.get(last)
        finals = {}
        for i, s in enumerate(subs):
            got = _served(work / f"sub-{i}")
            finals[s.name] = None if got is None else got[0]
            if got is None or got[0] != last or got[1] != want:
                res.errors.append(f"{s.name} does not serve version {last} byte for byte at the end")
        res.final_versions = finals
        res.identical_at_end = all(v == last for v in finals.values()) and not any(
            "byte for byte" in e for e in res.errors
        )
        for d in daemons:
            m = d.metrics()
            res.retries[d.name] = _metric(m, "weightsync_store_retries_total")
            res.loop_errors[d.name] = _metric(m, "weightsync_loop_errors_total")
            if d.role == "subscriber":
                res.delivered += int(_metric(m, "weightsync_swaps_total"))
                res.checksum_failures += int(_metric(m, "weightsync_checksum_failures_total"))
    finally:
        stop.set()
        for d in daemons:
            res.exit_codes[d.name] = d.stop()
        proxy.stop()
        if not server.running:
            server.start()
    res.faults = proxy.counts()
    res.faults_total = sum(res.faults.values())
    res.requests = sum(proxy.requests.values())
    for d in daemons:
        values = [r for t, r in d.rss if res.warm_seconds and t >= res.warm_seconds]
        q = max(1, len(values) // 4)
        if values:
            res.rss_mib[d.name] = {
                "first_quarter": round(sum(values[:q]) / q, 1),
                "last_quarter": round(sum(values[-q:]) / q, 1),
                "max": round(max(values), 1),
                "samples": len(values),
                "mib_per_100_versions": round(
                    _slope([(t, r) for t, r in d.rss if t >= res.warm_seconds])
                    * 100
                    * res.seconds
                    / max(1, res.published),
                    2,
                ),
            }
    res.wrong_examples = res.wrong_examples[:10]
    return res


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two points)."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in points) / var


def report(res: SoakResult) -> str:
    c = res.config
    lines = [
        f"soak: {c['versions']} versions, {c['subscribers']} subscribers, fault rate {c['fault_rate']:.1%}, "
        f"{res.store_restarts} SeaweedFS restarts, {res.seconds:.0f} s",
        f"  versions published          {res.published}",
        f"  versions delivered (swaps)  {res.delivered}  (final: {res.final_versions})",
        f"  S3 requests through proxy   {res.requests}",
        f"  faults injected             {res.faults_total}  {dict(sorted(res.faults.items()))}",
        f"  store retries (metrics)     {dict(sorted((k, int(v)) for k, v in res.retries.items()))}",
        f"  loop errors (backed off)    {dict(sorted((k, int(v)) for k, v in res.loop_errors.items()))}",
        f"  checksum failures           {res.checksum_failures}",
        f"  served folders compared     {res.samples} ({res.bytes_compared / 2**20:.0f} MiB)",
        f"  wrong bytes served          {res.wrong_bytes}",
        f"  byte-identical at the end   {res.identical_at_end}",
        f"  RSS MiB after the warm-up ({res.warm_seconds:.0f} s), first quarter -> last quarter (max):",
    ]
    for name, r in res.rss_mib.items():
        lines.append(
            f"    {name:<14} {r['first_quarter']:7.1f} -> {r['last_quarter']:7.1f}  (max {r['max']:.1f}, "
            f"{r['mib_per_100_versions']:+.2f} MiB per 100 versions, {r['samples']} samples)"
        )
    lines.append(f"  exit codes                  {res.exit_codes}")
    for e in res.errors:
        lines.append(f"  ERROR: {e}")
    lines.append("  PASS" if res.ok else "  FAIL")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=200)
    p.add_argument("--subscribers", type=int, default=3)
    p.add_argument("--fault-rate", type=float, default=0.02)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between checkpoints (default 1)")
    p.add_argument("--seconds", type=float, default=600.0, help="deadline for the whole run (default 600)")
    p.add_argument("--store-restarts", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = p.parse_args(argv)
    from seaweed import SeaweedServer

    cfg = SoakConfig(
        args.versions,
        args.subscribers,
        args.fault_rate,
        args.interval,
        args.seconds,
        args.store_restarts,
        seed=args.seed,
    )
    # A cold numba cache would have four daemons compile the same kernels at once, past the deadline.
    if subprocess.run([sys.executable, "-m", "weightsync.codec.jit"], stdout=subprocess.DEVNULL).returncode:
        return 1  # it said why on stderr
    work = Path(tempfile.mkdtemp(prefix="weightsync-soak-"))
    server = SeaweedServer(work / "seaweed")
    server.start()
    try:
        server.make_bucket("weightsync-soak")
        print(f"soak in {work}")
        res = run_soak(cfg, work / "run", server, "weightsync-soak")
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(res), "ok": res.ok}, indent=2, default=str))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
