"""The mirror's Prometheus metrics, from a real ``weightsync mirror --follow --metrics-listen`` process.

The mirror runs as ``python -m weightsync.cli mirror`` between two file stores, binds port 0 on
127.0.0.1 and logs the port it got (no race for a free port). Versions are published into the
source with the CLI while it runs; every check reads ``/metrics`` over HTTP and compares it with
what is on disk (chunk files and their sizes in the regional store). ``promtool check metrics``
lints the real output, and the alert rules of deploy/prometheus/alerts.yml are run by ``promtool
test rules`` over series made of real scrapes: a mirror stuck on a version (a source chunk went
missing) must raise WeightsyncMirrorBehind and WeightsyncMirrorStalled after 10 minutes, the same
mirror after it recovered must not. Chunks and bytes are counted as each chunk lands, so a pass
that fails half-way through a version still shows what it copied; ``weightsync_mirror_version_seconds``
is observed once the regional head is at the version.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import weightsync
from weightsync.demo import make_trajectory
from weightsync.format.keys import HEAD_KEY, version_key
from weightsync.format.manifest import head_to_json, manifest_from_json
from weightsync.service.metrics import Metrics
from weightsync.service.progress import human_bytes
from weightsync.store import FileStore
from weightsync.sync.mirror import MirrorObserver
from weightsync.sync.mirror import mirror as run_mirror

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
LABELS = {"region": "region-b", "cluster": "infer-b"}
SCRAPE = {"job": "weightsync-mirror", "instance": "mirror:8472"}  # what Prometheus adds to every series
M = "weightsync_mirror_"
EXTRA_LABELS = {"weightsync_store_retries_total": {"op", "reason"}, "weightsync_build_info": {"version"}}


class Mirror:
    """``weightsync mirror --follow`` as a subprocess with its metrics on a port of its choosing."""

    def __init__(self, src: Path, dst: Path, log: Path, env: dict, *extra: str):
        self.argv = [
            sys.executable,
            "-m",
            "weightsync.cli",
            "mirror",
            "--from",
            f"file://{src}",
            "--to",
            f"file://{dst}",
            "--follow",
            "--interval",
            "0.1",
            "--metrics-listen",
            "127.0.0.1:0",
            "--region",
            LABELS["region"],
            "--cluster",
            LABELS["cluster"],
            *extra,
        ]
        self.log_path, self.env = log, env
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> Mirror:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=self.env, text=True
            )
        bound = self.wait(
            lambda: re.search(r"listening on (http://127\.0\.0\.1:\d+/metrics)", self.log()), "the metrics port"
        )
        self.url = bound.group(1)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def stop(self) -> str:
        """SIGTERM; the mirror must exit 0. Returns its stdout (the destination head)."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, self.log()
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def scrape(self) -> tuple[str, float]:
        """The text of ``/metrics`` and the time it was read."""
        with urllib.request.urlopen(self.url, timeout=10) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            return resp.read().decode(), time.time()

    def values(self) -> dict[str, float]:
        """name -> value (summed over the series of a name) of every ``weightsync_*`` sample; each
        carries the mirror's constant labels and no other, but for the fixed extra ones of the retry
        counter and the build info."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.scrape()[0]):
            for s in family.samples:
                if s.name.startswith("weightsync_") and not s.name.endswith("_bucket"):
                    extra = set(s.labels) - set(LABELS)
                    assert {k: s.labels.get(k) for k in LABELS} == LABELS and extra <= EXTRA_LABELS.get(
                        s.name, set()
                    ), s
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def wait(self, pred, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the mirror exited with {self.proc.returncode} waiting for {what}:\n{self.log()}")
            try:
                if result := pred():
                    return result
            except OSError:  # not listening yet
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")

    def wait_values(self, pred, what: str) -> dict[str, float]:
        return self.wait(lambda: (v := self.values()) and pred(v) and v, what)


def chunk_files(store: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store / "chunks").rglob("*") if p.is_file()}


def refs(store: Path, version: int) -> list:
    data = (store / version_key(version)).read_bytes()
    return list(manifest_from_json(data, version_key(version)).chunks)


def summary(log: str) -> tuple[int, int, int]:
    """(chunks copied, bytes copied as shown, chunks already there) from the mirror's summary on stderr."""
    m = re.search(r"(\d+) chunks?, (\S+ \S+) copied, (\d+) chunks? already there", log)
    assert m, log
    return int(m.group(1)), m.group(2), int(m.group(3))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found: apt-get install prometheus (scripts/test installs it)")
    return path


def check_metrics(text: str) -> None:
    r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


RUNTIME_METRICS = (
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "python_info",
    "python_gc_collections_total",
)


def check_conventions(text: str) -> None:
    """A scrape of a weightsync process: process, platform and GC collectors, ``weightsync_build_info``
    of the running version at 1, no ``*_created`` series, retries by a fixed ``op``/``reason`` only."""
    from weightsync.store.retry import RETRY_OPS, RETRY_REASONS

    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    names = {s.name for s in samples}
    assert set(RUNTIME_METRICS) <= names, set(RUNTIME_METRICS) - names
    assert not {n for n in names if n.endswith("_created")}, sorted(n for n in names if n.endswith("_created"))
    build = [s for s in samples if s.name == "weightsync_build_info"]
    assert [(s.labels["version"], s.value) for s in build] == [(weightsync.__version__, 1.0)], build
    retries = {(s.labels["op"], s.labels["reason"]) for s in samples if s.name == "weightsync_store_retries_total"}
    assert retries == {(op, reason) for op in RETRY_OPS for reason in RETRY_REASONS}, retries


def frozen_series(text: str, scraped_at: float, minutes: int = 30) -> list[dict]:
    """promtool input series holding one real scrape for ``minutes``; test time 0 is the scrape.

    Timestamps (``*_timestamp_seconds``, ``*_time_seconds``) are shifted by the scrape time, as
    promtool's ``time()`` starts at 0; a 0 (never) stays 0. A mirror's lag in seconds above 0
    grows by 60 a minute, as it does while the mirror stays where it was scraped.
    """
    series = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("weightsync_") or s.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            value, step = s.value, 0
            if s.name.endswith(("_timestamp_seconds", "_time_seconds")) and value > 0:
                value -= scraped_at
            if s.name == f"{M}lag_seconds" and value > 0:
                step = 60  # behind: the lag grows with the clock (one-minute samples)
            labels = ", ".join(f'{k}="{v}"' for k, v in {**s.labels, **SCRAPE}.items())
            values = f"{value!r}+{step}x{minutes}" if step else f"{value!r}x{minutes}"
            series.append({"series": f"{s.name}{{{labels}}}", "values": values})
    return series


def run_alert_tests(tmp: Path, cases: list[tuple[str, list[dict], list[tuple[str, str, bool]]]]) -> None:
    """``promtool test rules`` over alerts.yml: (name, series, [(eval time, alert, fires)])."""
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # checked by `promtool check rules` in test_deploy_files.py
    (tmp / "rules.yml").write_text(yaml.safe_dump(doc))
    labels = {**LABELS, **SCRAPE, "severity": "warning"}
    tests = [
        {
            "interval": "1m",
            "name": name,
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": labels}] if fires else []}
                for at, alert, fires in checks
            ],
        }
        for name, series, checks in cases
    ]
    (tmp / "tests.yml").write_text(
        yaml.safe_dump({"rule_files": [str(tmp / "rules.yml")], "evaluation_interval": "1m", "tests": tests})
    )
    r = subprocess.run(
        [promtool(), "test", "rules", str(tmp / "tests.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


# --- tests -----------------------------------------------------------------------------------------
def test_metrics_follow_versions_published_while_the_mirror_runs(tmp_path, ok_cli, cli_env):
    traj = make_trajectory(tmp_path / "traj", steps=3, hidden=32, layers=1, experts=2, vocab=128)
    src, dst = tmp_path / "src", tmp_path / "regional"
    for ckpt in traj[:2]:
        ok_cli("publish", ckpt, "--store", f"file://{src}", "--no-cache")

    with Mirror(src, dst, tmp_path / "mirror.log", cli_env) as mirror:
        v = mirror.wait_values(
            lambda v: v[f"{M}destination_version"] == 1 and v[f"{M}last_success_timestamp_seconds"] > 0,
            "version 1 in the region, and a poll that ends without an error",
        )
        assert v[f"{M}source_version"] == 1
        assert v[f"{M}copied_versions_total"] == 2 and v[f"{M}version_seconds_count"] == 2
        on_disk = chunk_files(dst)
        assert v[f"{M}copied_chunks_total"] == len(on_disk) > 0
        assert v[f"{M}copied_bytes_total"] == sum(on_disk.values())
        assert v[f"{M}skipped_chunks_total"] == 0
        assert v["weightsync_loop_errors_total"] == 0 and v["weightsync_store_retries_total"] == 0
        assert 0 < v[f"{M}start_time_seconds"] <= v[f"{M}last_success_timestamp_seconds"] <= time.time()
        first = v

        for ckpt in traj[2:]:
            ok_cli("publish", ckpt, "--store", f"file://{src}", "--no-cache")
        last = len(traj) - 1
        v = mirror.wait_values(lambda v: v[f"{M}destination_version"] == last, f"version {last} in the region")
        assert v[f"{M}source_version"] == last
        assert v[f"{M}copied_versions_total"] == len(traj) and v[f"{M}version_seconds_count"] == len(traj)
        on_disk = chunk_files(dst)
        assert v[f"{M}copied_chunks_total"] == len(on_disk)
        assert v[f"{M}copied_bytes_total"] == sum(on_disk.values()) > first[f"{M}copied_bytes_total"]
        assert v[f"{M}start_time_seconds"] == first[f"{M}start_time_seconds"]
        # idle passes keep succeeding: the last success moves on while nothing is copied
        later = mirror.wait_values(
            lambda w: w[f"{M}last_success_timestamp_seconds"] > v[f"{M}last_success_timestamp_seconds"],
            "another successful pass",
        )
        assert later[f"{M}copied_bytes_total"] == v[f"{M}copied_bytes_total"]
        check_metrics(mirror.scrape()[0])
        check_conventions(mirror.scrape()[0])
        assert mirror.stop().strip() == str(last)
    assert weightsync.open_repo(f"file://{dst}").versions() == list(range(len(traj)))


def test_a_stuck_mirror_counts_failed_passes_and_raises_its_alerts(published, tmp_path, ok_cli, cli_env):
    """A source chunk of version 5 goes missing: every pass fails on it until it is back."""
    src, _ = published
    dst = tmp_path / "regional"
    ok_cli("mirror", "--from", f"file://{src}", "--to", f"file://{dst}")  # versions 0..5, then undo 4 and 5:
    regional = weightsync.open_repo(f"file://{dst}").store
    for version in (4, 5):  # as if an earlier pass was stopped before their manifests
        regional.delete(version_key(version))
    regional.put(HEAD_KEY, head_to_json(3), mode="overwrite")
    older = {r.id for v in range(5) for r in refs(src, v)}
    lost = next(r for r in refs(src, 5) if r.id not in older)
    lost_path = next(p for p in (src / "chunks").rglob(lost.id))
    aside = tmp_path / "aside"
    lost_path.rename(aside)  # gone from the source ...
    next(p for p in (dst / "chunks").rglob(lost.id)).unlink()  # ... and not yet in the region

    with Mirror(src, dst, tmp_path / "mirror.log", cli_env) as mirror:
        # 0, or the end of the first pass: on a loaded machine it may end before the lost chunk's first try
        # does, and a pass with no failure known is a success (a long copy must not look stuck)
        v = mirror.wait_values(lambda v: v["weightsync_loop_errors_total"] >= 1, "a failed pass")
        first = v[f"{M}last_success_timestamp_seconds"]
        v = mirror.wait_values(lambda v: v["weightsync_loop_errors_total"] >= 3, "three failed passes")
        assert (v[f"{M}source_version"], v[f"{M}destination_version"]) == (5, 4)
        assert v[f"{M}lag_versions"] == 1 and v[f"{M}lag_seconds"] > 0  # version 5, seen at the first poll
        assert v[f"{M}copied_versions_total"] == 1  # version 4: its manifest, every chunk already there
        assert v[f"{M}copied_chunks_total"] == 0 and v[f"{M}copied_bytes_total"] == 0
        assert v[f"{M}last_success_timestamp_seconds"] == first  # none since the chunk failed
        assert "mirror pass failed, retrying" in mirror.log()
        stuck = mirror.scrape()
        check_metrics(stuck[0])

        aside.rename(lost_path)
        v = mirror.wait_values(
            lambda v: v[f"{M}destination_version"] == 5 and v[f"{M}last_success_timestamp_seconds"] > 0,
            "version 5 in the region, and a poll that ends without an error",
        )
        assert v[f"{M}source_version"] == 5 and v[f"{M}copied_versions_total"] == 2
        assert (v[f"{M}copied_chunks_total"], v[f"{M}copied_bytes_total"]) == (1, lost.size)
        assert v[f"{M}skipped_chunks_total"] >= len(refs(src, 4)) + len(refs(src, 5)) - 1
        assert v[f"{M}last_success_timestamp_seconds"] >= v[f"{M}start_time_seconds"] > 0
        errors = v["weightsync_loop_errors_total"]
        assert (v[f"{M}lag_versions"], v[f"{M}lag_seconds"], v[f"{M}chunks_in_flight"]) == (0, 0, 0)
        ends = {v[f"{M}last_success_timestamp_seconds"]}  # each successful pass stamps its end

        def five_more_passes(v: dict[str, float]) -> bool:
            assert v["weightsync_loop_errors_total"] == errors  # passes go on every 0.1 s, and succeed
            ends.add(v[f"{M}last_success_timestamp_seconds"])
            return len(ends) > 5

        v = mirror.wait_values(five_more_passes, "five more successful passes")
        assert v["weightsync_loop_errors_total"] == errors
        recovered = mirror.scrape()
        check_metrics(recovered[0])
        assert mirror.stop().strip() == "5"
    skipped = re.search(r"(\d+) chunks? already there", mirror.log())
    assert skipped and int(skipped.group(1)) == v[f"{M}skipped_chunks_total"]

    run_alert_tests(
        tmp_path,
        [
            (
                "stuck",
                frozen_series(*stuck),
                [
                    ("9m", "WeightsyncMirrorBehind", False),
                    ("9m", "WeightsyncMirrorStalled", False),
                    ("11m", "WeightsyncMirrorBehind", True),
                    ("11m", "WeightsyncMirrorStalled", True),
                    ("11m", "WeightsyncTargetDown", False),
                ],
            ),
            (
                "recovered",
                frozen_series(*recovered),
                [
                    ("9m", "WeightsyncMirrorBehind", False),
                    ("9m", "WeightsyncMirrorStalled", False),
                    ("29m", "WeightsyncMirrorBehind", False),
                ],
            ),
        ],
    )


def test_chunks_are_counted_as_they_land_even_in_passes_that_fail(tmp_path, ok_cli, cli_env):
    """Version 0 is several 1 MiB chunks, the last missing at the source: with one chunk at a time, the
    mirror copies the others (and version 1's) and every poll fails on the last, before any manifest
    lands. The chunk and byte counters move anyway, and match the chunk files in the region."""
    traj = make_trajectory(tmp_path / "traj", steps=1, hidden=256, layers=2, experts=2, vocab=1024)  # 5 MiB each
    src, dst = tmp_path / "src", tmp_path / "regional"
    for ckpt in traj:
        ok_cli("publish", ckpt, "--store", f"file://{src}", "--no-cache", "--chunk-mib", "1")
    first = list({r.id: r for r in refs(src, 0)}.values())  # the order the mirror copies them in
    assert len(first) >= 3
    lost = first[-1]
    lost_path = next(p for p in (src / "chunks").rglob(lost.id))
    aside = tmp_path / "aside"
    lost_path.rename(aside)

    # pipelined: version 1's chunks are copied too, while version 0 waits for the lost one
    others = {r.id: r for w in (0, 1) for r in refs(src, w) if r.id != lost.id}
    with Mirror(src, dst, tmp_path / "mirror.log", cli_env, "--concurrency", "1") as mirror:
        v = mirror.wait_values(
            lambda v: v["weightsync_loop_errors_total"] >= 2 and v[f"{M}copied_chunks_total"] == len(others),
            "two failed passes, every other chunk copied",
        )
        assert not (dst / version_key(0)).exists() and not (dst / HEAD_KEY).exists()
        assert (v[f"{M}destination_version"], v[f"{M}copied_versions_total"], v[f"{M}version_seconds_count"]) == (
            -1,
            0,
            0,
        )
        on_disk = chunk_files(dst)
        assert set(on_disk) == set(others)
        assert v[f"{M}copied_chunks_total"] == len(on_disk) == len(others) > 0
        assert v[f"{M}copied_bytes_total"] == sum(on_disk.values()) == sum(r.size for r in others.values())
        assert v[f"{M}last_success_timestamp_seconds"] == 0

        aside.rename(lost_path)
        v = mirror.wait_values(lambda v: v[f"{M}destination_version"] == 1, "version 1 in the region")
        on_disk = chunk_files(dst)
        assert v[f"{M}copied_chunks_total"] == len(on_disk) == len({r.id for w in (0, 1) for r in refs(src, w)})
        assert v[f"{M}copied_bytes_total"] == sum(on_disk.values())
        assert v[f"{M}copied_versions_total"] == v[f"{M}version_seconds_count"] == 2
        assert mirror.stop().strip() == "1"
    chunks, copied, skipped = summary(mirror.log())  # the process is gone: its summary against the last scrape
    assert (chunks, copied) == (v[f"{M}copied_chunks_total"], human_bytes(v[f"{M}copied_bytes_total"]))
    assert skipped == v[f"{M}skipped_chunks_total"]


def test_version_seconds_are_observed_once_the_head_moved(published, tmp_path):
    """Each observation covers the version's chunks, its manifest and the head move (here slow)."""
    src, _ = published
    delay = 0.3

    class SlowHead(FileStore):
        def put_if_match(self, key, data, etag):
            time.sleep(delay)
            super().put_if_match(key, data, etag)

    dst = weightsync.Repo(SlowHead(tmp_path / "regional"))
    metrics = Metrics(CollectorRegistry(), "mirror")
    seen = []

    class Report(MirrorObserver):  # as the mirror command's, with the head each version saw
        def on_heads(self, source, destination):
            metrics.mirror_heads(source, destination)

        def on_chunk(self, copied, nbytes):
            metrics.mirror_chunk(copied, nbytes)

        def on_version(self, version, chunks, nbytes, seconds):
            seen.append((version, dst.head_version()))
            metrics.mirror_version(version, chunks, nbytes, seconds)

        def on_pass(self, result):
            metrics.mirror_pass(result)

    res = run_mirror(weightsync.open_repo(f"file://{src}"), dst, observer=Report())
    assert seen == [(v, v) for v in range(6)]  # called with the head already there

    def value(name: str, **extra: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"region": "", "cluster": "", **extra})

    assert value(f"{M}version_seconds_count") == 6
    assert value(f"{M}version_seconds_bucket", le="0.25") == 0  # every one includes its head move
    assert value(f"{M}version_seconds_sum") >= 6 * delay
    assert value(f"{M}copied_versions_total") == len(res.copied_versions) == 6
    assert value(f"{M}copied_chunks_total") == res.copied_chunks == len(chunk_files(tmp_path / "regional"))
    assert value(f"{M}copied_bytes_total") == res.copied_bytes == sum(chunk_files(tmp_path / "regional").values())
    assert value(f"{M}skipped_chunks_total") == res.skipped_chunks
    assert value(f"{M}destination_version") == res.head == 5


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(
    "address",
    [
        "nonsense",
        "127.0.0.1:",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:80x",
        "no-such-host.invalid:9103",
        "in-use",
    ],
)
def test_bad_metrics_listen_is_one_line_and_touches_no_store(address, published, tmp_path, run_cli, ws):
    src, _ = published
    sock = _listening_socket() if address == "in-use" else None
    try:
        if sock is not None:
            address = f"127.0.0.1:{sock.getsockname()[1]}"
        rc, out, err = run_cli(
            "mirror",
            "--from",
            f"file://{src}",
            "--to",
            f"file://{tmp_path / 'regional'}",
            "--follow",
            "--metrics-listen",
            address,
            timeout=60,
        )
    finally:
        if sock is not None:
            sock.close()
    assert rc == 2 and out == ""
    assert "--metrics-listen" in ws.error_line(err)
    assert not (tmp_path / "regional").exists()
