"""A real Prometheus scrapes a publisher, a mirror and two subscribers; every dashboard query returns data.

The daemons run as real processes (``python -m weightsync.cli``, the ``Daemon`` helper of
tests/functional/test_daemons.py) on file stores, as in deploy/compose.yaml: the publisher and
subscriber a use region a's store, a ``weightsync mirror --follow --metrics-listen`` process (the
``Mirror`` helper of tests/functional/test_mirror_metrics.py) copies it into region b's store, which
subscriber b reads. A tiny synthetic trainer drops checkpoints into the publisher's watched folder.
Prometheus (Debian's ``prometheus`` package) runs with deploy/prometheus/prometheus.yml, changed
only where a test must: every interval is 1 s, the compose targets are the processes' loopback
addresses (mapped by their port: 8470 publisher, 8471 subscriber, 8472 mirror), the rule file is
deploy/prometheus/alerts.yml by absolute path. Job names and labels
stay as deployed, so the dashboard's selectors (``up{job=~"weightsync.*"}``, ``sum by (job, ...)``)
see what they see in production.

Three versions are published before Prometheus starts and one more while it scrapes, so
``rate()``, ``increase()`` and the latency quantiles have a change inside their window. Every
panel target and annotation of every dashboard under deploy/grafana/dashboards is then sent through
``/api/v1/query`` (Grafana variables replaced as Grafana would: ``$__rate_interval`` by 30s,
multi-value variables by their "All" value) at one fixed evaluation time, and must return at least
one series with a finite value. A query that cannot have data in this setup by its nature must be
listed in ``NO_DATA`` with the reason (it is then an expected failure, and a strict one: once it
returns data the entry has to go). The alert rules must load and evaluate with health ``ok``, and a
healthy fleet fires no alert. The promtool checks of the same files are in test_deploy_files.py.

Every metric name the alert rules, the dashboards (targets, annotations, variables) and any
recording rules use must be in the scrape, with series from a weightsync job: a rename in
weightsync/metrics.py that the deploy files do not follow fails here. Every process (publisher,
subscribers, mirror) exports the process and Python collectors and ``weightsync_build_info`` of the
running version, and no ``*_created`` series; each one's own ``/metrics`` passes ``promtool check
metrics``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from promserver import PrometheusServer, prometheus_binary

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "functional"))
from test_daemons import Daemon, wait_for  # noqa: E402
from test_mirror_metrics import LABELS as MIRROR_LABELS  # noqa: E402
from test_mirror_metrics import (  # noqa: E402
    RUNTIME_METRICS,
    Mirror,
    check_conventions,
    check_metrics,
)

import weightsync  # noqa: E402
from weightsync.demo import SyntheticTrainer  # noqa: E402

pytestmark = pytest.mark.integration

if prometheus_binary() is None:
    pytest.skip(
        "prometheus binary not found: apt-get install prometheus (scripts/test installs it)", allow_module_level=True
    )

PROM = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
TINY = {"hidden": 32, "layers": 1, "experts": 2, "vocab": 128}
TOKEN = "prometheus-scrape-test-token"
ROLE_PORTS = {8470: "publisher", 8471: "subscriber", 8472: "mirror"}  # the deployed targets' ports say which process
PROMETHEUS_PORT = 9090
SUBSCRIBERS = (("sub-a", "region-a", "infer-a"), ("sub-b", "region-b", "infer-b"))  # sub-b reads the mirrored store
PUBLISHER = ("pub", "region-a", "train")
VERSIONS_BEFORE = 3  # versions 0..2 published before Prometheus starts; version 3 while it scrapes
INTERVAL = 1.0  # scrape and rule evaluation interval, seconds
# What Grafana puts in place of its macros (a rate window of several scrape intervals, as
# $__rate_interval is); template variables become their "All" value (see dashboard_queries).
MACROS = {"__rate_interval": "30s", "__interval": "5s", "__range": "2m", "__range_s": "120", "__interval_ms": "5000"}

# Dashboard queries that cannot return data in this setup by nature, "<dashboard>: <type> <title> [refId]"
# -> why. Each is an expected failure (strict): remove the entry when the query returns data.
NO_DATA: dict[str, str] = {}


# --- the dashboards' queries -----------------------------------------------------------------------
def _panels(panels: list[dict]) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    return [q for p in panels for q in (p, *_panels(p.get("panels", [])))]


def _substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$name``, ``${name}`` and ``${name:format}`` of known variables; leave others."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def dashboard_queries() -> list[tuple[str, str]]:
    """(id, expr) of every panel target and annotation of every dashboard, variables replaced."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        values = dict(MACROS)
        for var in dashboard.get("templating", {}).get("list", []):
            if var.get("type") in ("query", "custom", "constant", "textbox"):
                values[var["name"]] = var.get("allValue") or ".*"
        for panel in _panels(dashboard.get("panels", [])):
            for target in panel.get("targets", []):
                out.append(
                    (
                        f"{path.stem}: {panel['type']} {panel['title']} [{target['refId']}]",
                        _substitute(target["expr"], values),
                    )
                )
        for ann in dashboard.get("annotations", {}).get("list", []):
            if ann.get("expr"):
                out.append((f"{path.stem}: annotation {ann['name']}", _substitute(ann["expr"], values)))
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """(id, metric, label) of every ``label_values(metric, label)`` template variable."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for var in json.loads(path.read_text()).get("templating", {}).get("list", []):
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else query or ""
            if var.get("type") == "query" and (m := re.fullmatch(r"\s*label_values\((\w+)\s*,\s*(\w+)\)\s*", query)):
                out.append((f"{path.stem}: ${var['name']}", m.group(1), m.group(2)))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    """(id, expr) of every alerting and recording rule of the rule files prometheus.yml loads."""
    out = []
    for name in yaml.safe_load((PROM / "prometheus.yml").read_text()).get("rule_files", []):
        for group in yaml.safe_load((PROM / name).read_text())["groups"]:
            out += [(f"{name}: {r.get('alert') or r.get('record')}", r["expr"]) for r in group["rules"]]
    return out


# A metric name in PromQL: ours and the process collectors' (label values such as job=~"weightsync.*"
# hold no underscore after the prefix, so they do not match).
METRIC_NAME = re.compile(r"\b(?:weightsync|process|python)_[a-z0-9_]+\b")


def used_metric_names() -> dict[str, list[str]]:
    """metric name -> where it is used (alerts, recording rules, dashboard targets, annotations, variables)."""
    used: dict[str, list[str]] = {}
    for where, expr in [*rule_exprs(), *QUERIES, *((vid, metric) for vid, metric, _ in variable_queries())]:
        for name in METRIC_NAME.findall(expr):
            used.setdefault(name, []).append(where)
    return used


QUERIES = dashboard_queries()
assert QUERIES, f"no dashboard queries under {DASHBOARDS}"
assert len({qid for qid, _ in QUERIES}) == len(QUERIES), "two targets with one id: give them distinct titles or refIds"
assert set(NO_DATA) <= {qid for qid, _ in QUERIES}, (
    f"NO_DATA names unknown queries: {set(NO_DATA) - {q for q, _ in QUERIES}}"
)


# --- the daemons and Prometheus ------------------------------------------------------------------
class Trainer:
    """Drops tiny synthetic checkpoints into the publisher's watched folder (folder, then marker)."""

    def __init__(self, watch: Path):
        self.watch, self.model, self.step = watch, SyntheticTrainer(**TINY, seed=0), -1

    def drop(self) -> int:
        if self.step >= 0:
            self.model.step()
        self.step += 1
        folder = self.model.save(self.watch / f"step_{self.step:06d}")
        (folder / "COMPLETE").write_text("")
        return self.step


def ident(id_: str, region: str, cluster: str) -> list[str]:
    return ["--id", id_, "--region", region, "--cluster", cluster]


def _stop(daemon: Daemon) -> None:
    proc = daemon.proc
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A publisher, a mirror into region b and two subscribers (other regions, clusters and ids) serving version 2."""
    tmp = tmp_path_factory.mktemp("prom-fleet")
    stores = {"region-a": tmp / "store-a", "region-b": tmp / "store-b"}
    watch = tmp / "watch"
    watch.mkdir()
    env = {"WEIGHTSYNC_API_TOKEN": TOKEN, "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_STATE_HOME": str(tmp / "state")}
    pub = Daemon(
        "publisher",
        [
            "--store",
            f"file://{stores['region-a']}",
            "--watch",
            watch,
            "--state-dir",
            tmp / "pubstate",
            *ident(*PUBLISHER),
        ],
        tmp,
        env=env,
        token=TOKEN,
    )
    subs = [
        Daemon(
            "subscriber",
            ["--store", f"file://{stores[region]}", "--target", tmp / id_, "--no-fsync", *ident(id_, region, cluster)],
            tmp,
            env=env,
            token=TOKEN,
        )
        for id_, region, cluster in SUBSCRIBERS
    ]
    assert PUBLISHER[1] == "region-a" and MIRROR_LABELS["region"] == "region-b"
    mirror = Mirror(stores["region-a"], stores["region-b"], tmp / "mirror.log", {**os.environ, **env})
    daemons = [pub, *subs]
    try:
        with ThreadPoolExecutor(2) as pool:  # the imports overlap
            list(pool.map(Daemon.start, daemons[:2]))
        trainer = Trainer(watch)
        for _ in range(VERSIONS_BEFORE):
            trainer.drop()
        wait_for(lambda: pub.status()["head_version"] == trainer.step, 60, f"the publisher to publish {trainer.step}")
        mirror.__enter__()  # the source store exists now; the mirror creates region b's before sub-b starts
        mirror.wait_values(
            lambda v: v["weightsync_mirror_destination_version"] == trainer.step, f"version {trainer.step} in region b"
        )
        subs[1].start()
        for sub in subs:
            sub.wait_version(trainer.step, timeout=60)
        yield SimpleNamespace(publisher=pub, subscribers=subs, mirror=mirror, trainer=trainer)
    finally:
        for d in daemons:
            _stop(d)
        if mirror.proc is not None:
            mirror.__exit__(None, None, None)


def scrape_config(own_address: str, addresses: dict[str, list[str]]) -> dict:
    """deploy/prometheus/prometheus.yml with 1 s intervals, our targets and an absolute rule path."""
    deployed = yaml.safe_load((PROM / "prometheus.yml").read_text())
    cfg = copy.deepcopy(deployed)
    cfg["global"] = {
        **cfg.get("global", {}),
        "scrape_interval": f"{INTERVAL:g}s",
        "scrape_timeout": f"{INTERVAL:g}s",
        "evaluation_interval": f"{INTERVAL:g}s",
    }
    cfg["rule_files"] = [str(PROM / f) for f in deployed.get("rule_files", [])]
    left = {role: list(addrs) for role, addrs in addresses.items()}
    for job in cfg["scrape_configs"]:
        for key in ("scrape_interval", "scrape_timeout"):
            job.pop(key, None)
        for static in job.get("static_configs", []):
            targets = []
            for target in static["targets"]:
                port = int(target.rsplit(":", 1)[1])
                if port == PROMETHEUS_PORT:
                    targets.append(own_address)
                else:
                    assert port in ROLE_PORTS, f"prometheus.yml scrapes {target}: not a weightsync daemon port"
                    assert left[ROLE_PORTS[port]], (
                        f"prometheus.yml has more {ROLE_PORTS[port]} targets than this test runs"
                    )
                    targets.append(left[ROLE_PORTS[port]].pop(0))
            static["targets"] = targets
    assert not any(left.values()), f"prometheus.yml does not scrape {left}"
    return cfg


@pytest.fixture(scope="module")
def prom(fleet, tmp_path_factory):
    """Prometheus scraping the fleet; one more version is published while it scrapes.

    ``at`` is the evaluation time for the dashboard's queries: a few scrapes after every daemon
    reported the new version, so each rate window of ``MACROS`` holds samples before and after it.
    """
    pub, subs, mirror, trainer = fleet.publisher, fleet.subscribers, fleet.mirror, fleet.trainer
    addresses = {
        "publisher": [pub.url.removeprefix("http://")],
        "subscriber": [s.url.removeprefix("http://") for s in subs],
        "mirror": [mirror.url.removeprefix("http://").removesuffix("/metrics")],
    }
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), lambda own: scrape_config(own, addresses))
    try:
        server.start()

        def logs() -> str:
            tails = [f"--- {d.role} {d.url}\n{d.log()[-2000:]}" for d in (pub, *subs)]
            tails.append(f"--- mirror {mirror.url}\n{mirror.log()[-2000:]}")
            return "\n".join([f"--- prometheus\n{server.log_tail()}", *tails])

        def wait(pred, what: str):
            try:
                return wait_for(pred, 30, what, interval=0.25)
            except AssertionError as exc:  # the logs as they are now, not as they were before waiting
                raise AssertionError(f"{exc}\n{logs()}") from None

        wanted = sum(map(len, addresses.values()))
        wait(
            lambda: len(server.query('count_over_time(up{job=~"weightsync.*"}[1m]) >= 3 and up == 1')) == wanted,
            f"{wanted} weightsync targets up and scraped 3 times before the change",
        )
        version = trainer.drop()
        wait(lambda: pub.status()["head_version"] == version, f"the publisher to publish {version}")
        for sub in subs:
            wait(lambda sub=sub: sub.status()["current_version"] == version, f"{sub.url} to serve {version}")
        seen = (
            f"max(weightsync_published_version) == {version}"
            f" and on() count(weightsync_current_version == {version}) == {len(subs)}"
            f" and on() max(weightsync_mirror_destination_version) == {version}"
        )
        wait(lambda: server.query(seen), f"Prometheus to scrape version {version} from every daemon")
        time.sleep(3 * INTERVAL)  # a few samples after the change
        yield SimpleNamespace(
            server=server, at=time.time(), version=version, subscribers=len(subs), logs=logs, subs=[s.url for s in subs]
        )
    finally:
        server.stop()


# --- tests -----------------------------------------------------------------------------------------
def test_prometheus_scrapes_the_publisher_the_mirror_and_both_subscribers_with_the_deployed_job_names(prom):
    targets = prom.server.api("targets", state="active")["activeTargets"]
    assert all(t["health"] == "up" for t in targets), [(t["scrapeUrl"], t["lastError"]) for t in targets]
    deployed_jobs = [j["job_name"] for j in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]]
    jobs = sorted(t["labels"]["job"] for t in targets)
    assert set(jobs) == set(deployed_jobs)
    up = {
        (s["metric"]["job"], s["metric"]["instance"]): s["value"][1]
        for s in prom.server.query('up{job=~"weightsync.*"}', prom.at)
    }
    assert sorted(job for job, _ in up) == [
        "weightsync-mirror",
        "weightsync-publisher",
        "weightsync-subscriber",
        "weightsync-subscriber",
    ]
    assert set(up.values()) == {"1"}
    current = {
        (s["metric"]["subscriber"], s["metric"]["region"], s["metric"]["cluster"]): float(s["value"][1])
        for s in prom.server.query("weightsync_current_version", prom.at)
    }
    assert current == {ident: prom.version for ident in SUBSCRIBERS}
    heads = {
        (s["metric"]["__name__"], s["metric"]["region"], s["metric"]["cluster"], s["metric"]["job"]): float(
            s["value"][1]
        )
        for s in prom.server.query('{__name__=~"weightsync_mirror_(source|destination)_version"}', prom.at)
    }
    mirror = (MIRROR_LABELS["region"], MIRROR_LABELS["cluster"], "weightsync-mirror")
    assert heads == {(f"weightsync_mirror_{side}_version", *mirror): prom.version for side in ("source", "destination")}


def test_the_mirror_alert_expressions_see_a_healthy_mirror(prom):
    """Without their thresholds, the mirror rules' expressions compute what they should on a healthy mirror."""
    rules = {
        r["alert"]: r["expr"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]
    }
    for side in rules["WeightsyncMirrorBehind"].split(" or "):  # the lag in seconds, and in versions
        lag = side.split(" > ")[0]
        assert [float(s["value"][1]) for s in prom.server.query(lag, prom.at)] == [0.0], lag
    since = rules["WeightsyncMirrorStalled"].removesuffix(" > 600")
    values = [float(s["value"][1]) for s in prom.server.query(since, prom.at)]
    assert len(values) == 1 and 0 <= values[0] < 10 * INTERVAL + 5, (since, values)
    down = rules["WeightsyncMirrorDown"].removesuffix(" == 0")
    assert [s["value"][1] for s in prom.server.query(down, prom.at)] == ["1"], down


@pytest.mark.parametrize(
    "expr",
    [
        pytest.param(
            expr, id=qid, marks=[pytest.mark.xfail(strict=True, reason=NO_DATA[qid])] if qid in NO_DATA else []
        )
        for qid, expr in QUERIES
    ],
)
def test_dashboard_query_returns_data(prom, expr):
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    result = prom.server.query(expr, prom.at)
    assert result, f"no data for {expr}\n{prom.logs()}"
    values = [float(s["value"][1]) for s in result]
    assert any(math.isfinite(v) for v in values), f"only NaN/Inf for {expr}: {result}"


@pytest.mark.parametrize("metric, label", [pytest.param(m, label, id=vid) for vid, m, label in variable_queries()])
def test_dashboard_variable_lists_every_value(prom, metric, label):
    values = prom.server.api(f"label/{label}/values", **{"match[]": metric})
    expected = {s["metric"][label] for s in prom.server.query(metric, prom.at)}
    assert values and set(values) == expected, (values, expected)


def test_overview_panels_agree_with_the_daemons(prom):
    """The headline numbers, computed by the dashboard's own queries, match the fleet's state."""
    queries = dict(QUERIES)
    expected = {"Published version": prom.version, "Subscribers": prom.subscribers, "Max version lag": 0}
    for title, value in expected.items():
        qid = f"weightsync: stat {title} [A]"
        assert qid in queries, f"the dashboard has no stat panel {title!r}"
        result = prom.server.query(queries[qid], prom.at)
        assert [float(s["value"][1]) for s in result] == [value], (title, result)


def test_mirror_panels_show_the_version_copied_while_prometheus_scraped(prom):
    """The Mirror row, by the dashboard's own queries: both heads at the new version, bytes moving."""
    queries = dict(QUERIES)

    def panel(title: str, ref: str = "A") -> dict[str, float]:
        qid = f"weightsync: timeseries {title} [{ref}]"
        assert qid in queries, f"the dashboard has no panel {title!r}"
        return {s["metric"].get("region", ""): float(s["value"][1]) for s in prom.server.query(queries[qid], prom.at)}

    region = MIRROR_LABELS["region"]
    assert (
        panel("Regional head vs source head", "A")
        == panel("Regional head vs source head", "B")
        == {region: prom.version}
    )
    throughput = panel("Mirror throughput")
    assert set(throughput) == {region} and throughput[region] > 0, throughput
    for ref in ("A", "B"):
        seconds = panel("Seconds per mirrored version", ref)
        assert set(seconds) == {region} and 0 < seconds[region] < 60, seconds


def test_alert_rules_load_evaluate_ok_and_stay_quiet_on_a_healthy_fleet(prom):
    deployed = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    expected = {g["name"]: sorted(r["alert"] for r in g["rules"]) for g in deployed}

    def evaluated():
        groups = prom.server.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return (
            len(rules) == sum(map(len, expected.values())) and all(r["health"] != "unknown" for r in rules) and groups
        )

    groups = wait_for(evaluated, 10 * INTERVAL + 10, f"the rules to be evaluated\n{prom.logs()}", interval=0.25)
    assert {g["name"]: sorted(r["name"] for r in g["rules"]) for g in groups} == expected
    bad = [(r["name"], r["health"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not bad, bad
    active = [(a["labels"]["alertname"], a["state"]) for a in prom.server.api("alerts")["alerts"]]
    assert not active, f"alerts on a healthy fleet: {active}"


def test_every_metric_the_alerts_and_dashboards_name_is_scraped_from_a_weightsync_job(prom):
    used = used_metric_names()
    alerting = {n for _, expr in rule_exprs() for n in METRIC_NAME.findall(expr)}
    assert alerting and set(used) > alerting, used  # the dashboards name more than the alerts
    pattern = "|".join(sorted(used))
    scraped = {
        s["metric"]["__name__"]
        for s in prom.server.query(f'count by (__name__) ({{__name__=~"{pattern}", job=~"weightsync.*"}})', prom.at)
    }
    engines_only = {"weightsync_engine_version"}  # a series per registered engine rank: this fleet has none
    missing = {name: where for name, where in used.items() if name not in scraped and name not in engines_only}
    assert not missing, f"named by the deploy files, not in a real scrape of the daemons: {missing}"
    with urllib.request.urlopen(f"{prom.subs[0]}/metrics", timeout=10) as r:  # declared all the same
        text = r.read().decode()
    assert all(f"# TYPE {name} " in text for name in engines_only), engines_only


def test_every_process_exports_runtime_metrics_and_its_build_info_and_no_created_series(prom):
    expected = {"weightsync-publisher": 1, "weightsync-subscriber": prom.subscribers, "weightsync-mirror": 1}
    for name in (*RUNTIME_METRICS, f'weightsync_build_info{{version="{weightsync.__version__}"}}'):
        selector = name.replace("{", '{job=~"weightsync.*", ') if "{" in name else f'{name}{{job=~"weightsync.*"}}'
        counts = {
            s["metric"]["job"]: int(float(s["value"][1]))
            for s in prom.server.query(f"count by (job) (group by (job, instance) ({selector}))", prom.at)
        }
        assert counts == expected, (name, counts)
    created = prom.server.query('count by (__name__, job) ({__name__=~".+_created", job=~"weightsync.*"})', prom.at)
    assert not created, [s["metric"] for s in created]


def test_each_process_scrape_passes_promtool_check_metrics(fleet):
    texts = {d.url: d.get("/metrics", token=None) for d in (fleet.publisher, *fleet.subscribers)}
    for url, (code, text, _) in texts.items():
        assert code == 200, (url, text)
    texts = {url: text for url, (_, text, _) in texts.items()}
    texts[fleet.mirror.url] = fleet.mirror.scrape()[0]
    for url, text in texts.items():
        try:
            check_metrics(text)
            check_conventions(text)
        except AssertionError as exc:
            raise AssertionError(f"{url}: {exc}") from None
