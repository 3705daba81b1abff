"""Generate deploy/grafana/dashboards/weightsync.json from code (plain Python, no dependencies).

    python deploy/grafana/generate.py          # rewrite the dashboard JSON
    python deploy/grafana/generate.py --check  # exit 1 if the committed JSON is out of date

Every query is PromQL over the metrics of the daemons and the mirror (``weightsync.service.metrics``, with
the process collectors' ``process_*`` series); a test runs each against a real Prometheus scrape.
Panels reference the Prometheus data source through the ``datasource`` template variable, so the
dashboard imports into any Grafana; provisioning (deploy/grafana/provisioning) names the compose
data source ``prometheus``.
Grafana replaces ``$__rate_interval`` and ``$region`` before sending a query; the test suite does
the same and then checks every expression with ``promtool``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "weightsync.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
REGION = 'region=~"$region"'
JOBS = 'job=~"weightsync.*"'
RATE = "$__rate_interval"


def _targets(queries: list[tuple[str, str]], **extra) -> list[dict]:
    return [
        {"datasource": DS, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "range": True, **extra}
        for i, (expr, legend) in enumerate(queries)
    ]


def _defaults(unit: str, **custom) -> dict:
    return {"defaults": {"unit": unit, "custom": custom} if custom else {"unit": unit}, "overrides": []}


def stat(
    title: str, expr: str, unit: str = "none", description: str = "", thresholds: list[tuple[str, float | None]] = ()
) -> dict:
    steps = [{"color": color, "value": value} for color, value in (thresholds or [("green", None)])]
    field = _defaults(unit)
    field["defaults"]["thresholds"] = {"mode": "absolute", "steps": steps}
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets([(expr, "")], instant=True, range=False),
        "fieldConfig": field,
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
        },
        "_w": 4,
        "_h": 4,
    }


def timeseries(
    title: str,
    queries: list[tuple[str, str]],
    unit: str = "none",
    description: str = "",
    width: int = 12,
    step: bool = False,
    bars: bool = False,
) -> dict:
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineInterpolation": "stepAfter" if step else "linear",
        "showPoints": "auto",
        "fillOpacity": 10,
    }
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries),
        "fieldConfig": _defaults(unit, **custom),
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "_w": width,
        "_h": 8,
    }


def table(title: str, queries: list[tuple[str, str]], description: str = "") -> dict:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _targets(queries, format="table", instant=True, range=False),
        "fieldConfig": {"defaults": {"unit": "none"}, "overrides": []},
        "options": {"showHeader": True, "sortBy": [{"displayName": "lag", "desc": True}]},
        "transformations": [
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True},
                    "renameByName": {
                        "Value #A": "current",
                        "Value #B": "latest",
                        "Value #C": "lag",
                        "Value #D": "staleness (s)",
                    },
                },
            },
        ],
        "_w": 12,
        "_h": 8,
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_w": 24, "_h": 1}


def quantiles(metric: str, by: str, selector: str = "", qs: tuple[float, ...] = (0.5, 0.99)) -> list[tuple[str, str]]:
    sel = f"{{{selector}}}" if selector else ""
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{sel}[{RATE}])))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in qs
    ]


def panels() -> list[dict]:
    return [
        row("Overview"),
        stat(
            "Published version",
            "max(weightsync_published_version)",
            description="Newest version committed by a publisher.",
        ),
        stat(
            "Subscribers",
            f"count(weightsync_current_version{{{REGION}}})",
            description="Subscribers reporting metrics.",
        ),
        stat(
            "Max version lag",
            f"max(weightsync_version_lag{{{REGION}}})",
            description="Largest latest-minus-current version over the subscribers.",
            thresholds=[("green", None), ("orange", 2), ("red", 4)],
        ),
        stat(
            "Max staleness",
            f"max(weightsync_staleness_seconds{{{REGION}}})",
            unit="s",
            description="Longest time a subscriber has served a version after a newer one appeared.",
            thresholds=[("green", None), ("orange", 300), ("red", 900)],
        ),
        stat(
            "Compression (last version)",
            "sum(weightsync_checkpoint_bytes) / sum(weightsync_delta_bytes > 0)",
            unit="suffix:x",
            description="Checkpoint bytes over stored delta bytes of the newest version.",
        ),
        stat(
            "Firing alerts",
            'count(ALERTS{alertname=~"Weightsync.*", alertstate="firing"}) or vector(0)',
            thresholds=[("green", None), ("red", 1)],
        ),
        row("Transfer"),
        timeseries(
            "Transfer throughput",
            [
                (
                    f"sum by (region, cluster) (rate(weightsync_upload_bytes_total[{RATE}]))",
                    "upload {{region}}/{{cluster}}",
                ),
                (f"sum by (region) (rate(weightsync_download_bytes_total{{{REGION}}}[{RATE}]))", "download {{region}}"),
            ],
            unit="Bps",
            description="Bytes per second the publishers upload and the subscribers download, per region.",
        ),
        timeseries(
            "Download per subscriber",
            [
                (
                    f"sum by (region, subscriber) (rate(weightsync_download_bytes_total{{{REGION}}}[{RATE}]))",
                    "{{region}} {{subscriber}}",
                ),
            ],
            unit="Bps",
        ),
        row("Versions: size and compression"),
        timeseries(
            "Checkpoint and delta size",
            [
                ("weightsync_checkpoint_bytes", "checkpoint {{region}}/{{cluster}}"),
                ("weightsync_delta_bytes", "delta {{region}}/{{cluster}}"),
            ],
            unit="bytes",
            width=8,
            step=True,
            description="Raw checkpoint bytes and encoded (stored) bytes of each version.",
        ),
        timeseries(
            "Compression ratio per version",
            [
                ("weightsync_checkpoint_bytes / (weightsync_delta_bytes > 0)", "{{region}}/{{cluster}}"),
            ],
            unit="suffix:x",
            width=8,
            step=True,
            description="checkpoint_bytes / delta_bytes: how many times smaller the delta is.",
        ),
        timeseries(
            "Changed elements",
            [
                ("weightsync_changed_ratio", "{{region}}/{{cluster}}"),
            ],
            unit="percentunit",
            width=8,
            step=True,
            description="Fraction of elements that changed from the parent version.",
        ),
        row("Latency"),
        timeseries(
            "Publish time by phase",
            quantiles("weightsync_publish_seconds", "phase"),
            unit="s",
            description="p50 and p99 of read, diff, encode, upload and commit per version.",
        ),
        timeseries("Download time per sync", quantiles("weightsync_download_seconds", "region", REGION), unit="s"),
        timeseries(
            "Apply time per sync",
            quantiles("weightsync_apply_seconds", "region", REGION),
            unit="s",
            description="Decoding and writing a version, p50 and p99 per region.",
        ),
        timeseries(
            "Swap pause",
            quantiles("weightsync_swap_pause_seconds", "region", REGION),
            unit="s",
            description="How long the swap itself took (symlink flip or in-place patch).",
        ),
        row("Fleet"),
        timeseries(
            "Version lag per region",
            [
                (f"max by (region) (weightsync_version_lag{{{REGION}}})", "max {{region}}"),
                (f"avg by (region) (weightsync_version_lag{{{REGION}}})", "avg {{region}}"),
            ],
            step=True,
            description="Latest minus current version; a pinned subscriber lags by design.",
        ),
        timeseries(
            "Staleness per region",
            [
                (f"max by (region) (weightsync_staleness_seconds{{{REGION}}})", "max {{region}}"),
            ],
            unit="s",
            description="Seconds since a newer version than the served one appeared.",
        ),
        timeseries(
            "Versions",
            [
                ("max(weightsync_published_version)", "published"),
                (f"max by (region) (weightsync_latest_version{{{REGION}}})", "latest in store {{region}}"),
                (f"weightsync_current_version{{{REGION}}}", "current {{subscriber}}"),
            ],
            step=True,
            description="Published version, newest version in each region's store, and each subscriber's version.",
        ),
        table(
            "Subscribers",
            [
                (f"weightsync_current_version{{{REGION}}}", ""),
                (f"weightsync_latest_version{{{REGION}}}", ""),
                (f"weightsync_version_lag{{{REGION}}}", ""),
                (f"weightsync_staleness_seconds{{{REGION}}}", ""),
            ],
        ),
        row("Mirror"),
        timeseries(
            "Regional head vs source head",
            [
                (f"max by (region) (weightsync_mirror_source_version{{{REGION}}})", "source {{region}}"),
                (f"max by (region) (weightsync_mirror_destination_version{{{REGION}}})", "regional {{region}}"),
            ],
            width=6,
            step=True,
            description="Head of the source store as the last mirror pass read it, and head of the region's store.",
        ),
        timeseries(
            "Mirror throughput",
            [
                (
                    f"sum by (region) (rate(weightsync_mirror_copied_bytes_total{{{REGION}}}[{RATE}]))",
                    "copied {{region}}",
                ),
            ],
            unit="Bps",
            width=6,
            description="Chunk bytes per second the mirror copies into each region.",
        ),
        timeseries(
            "Seconds per mirrored version",
            quantiles("weightsync_mirror_version_seconds", "region", REGION),
            unit="s",
            width=6,
            description="Time to copy one version (chunks, manifest, head), p50 and p99 per region.",
        ),
        timeseries(
            "Since the last successful mirror pass",
            [
                (
                    f"time() - (weightsync_mirror_last_success_timestamp_seconds{{{REGION}}} > 0"
                    f" or weightsync_mirror_start_time_seconds{{{REGION}}})",
                    "{{region}} {{instance}}",
                ),
            ],
            unit="s",
            width=6,
            description="Seconds since a mirror pass last succeeded (since the mirror started if none has); "
            "alert at 600.",
        ),
        timeseries(
            "Mirror lag",
            [
                (f"max by (region) (weightsync_mirror_lag_seconds{{{REGION}}})", "seconds {{region}}"),
                (f"max by (region) (weightsync_mirror_lag_versions{{{REGION}}})", "versions {{region}}"),
            ],
            width=6,
            description="Per region link: seconds since the oldest source version the region lacks was first seen, "
            "and source versions above the regional head; WeightsyncMirrorBehind at 300 s or 5 versions for 5 minutes.",
        ),
        timeseries(
            "Mirror chunks in flight",
            [
                (f"weightsync_mirror_chunks_in_flight{{{REGION}}}", "{{region}} {{instance}}"),
            ],
            width=6,
            description="Chunk copies (and a committer's checks of other shards' chunks) running now, per mirror "
            "process (shard); flat at --concurrency: the link is the limit.",
        ),
        timeseries(
            "Mirror chunks copied",
            [
                (
                    f"sum by (region) (rate(weightsync_mirror_copied_chunks_total{{{REGION}}}[{RATE}]))",
                    "copied {{region}}",
                ),
                (
                    f"sum by (region) (rate(weightsync_mirror_skipped_chunks_total{{{REGION}}}[{RATE}]))",
                    "already there {{region}}",
                ),
            ],
            unit="ops",
            width=6,
            description="Chunks per second copied into each region, and found there already.",
        ),
        timeseries(
            "Lazy keyframe chunks pending",
            [
                (f"max by (region) (weightsync_mirror_lazy_chunks{{{REGION}}})", "{{region}}"),
            ],
            width=6,
            description="Chunks of committed keyframes (full payloads) still to copy into the region after the head "
            "moved (--keyframe-payloads lazy; the committer's count).",
        ),
        row("Errors and retries"),
        timeseries(
            "Checksum failures",
            [
                (
                    f"sum by (region, subscriber) (increase(weightsync_checksum_failures_total{{{REGION}}}[{RATE}]))",
                    "{{region}} {{subscriber}}",
                ),
                (
                    f"sum by (job, region, subscriber) (increase(weightsync_signature_refusals_total[{RATE}]))",
                    "refused: {{job}} {{region}} {{subscriber}}",
                ),
            ],
            width=8,
            bars=True,
            description="Data rejected by checksum verification, and attempts to use a version no trusted key "
            "signed (refused:, with --trusted-key); both should stay zero.",
        ),
        timeseries(
            "Swap hook failures",
            [
                (
                    f"sum by (region, subscriber) (increase(weightsync_swap_hook_failures_total{{{REGION}}}[{RATE}]))",
                    "{{region}} {{subscriber}}",
                ),
                (
                    f"max by (region, subscriber) (weightsync_swap_hook_degraded{{{REGION}}})",
                    "degraded {{region}} {{subscriber}}",
                ),
            ],
            width=8,
            bars=True,
            description="Failed hook tries, and 1 (degraded) while the hook of the version served has not "
            "succeeded since one failed: the engine may serve older weights. POST /v1/hook calls it again.",
        ),
        timeseries(
            "Store retries",
            [
                (
                    f"sum by (job, region, reason) (rate(weightsync_store_retries_total[{RATE}]))",
                    "{{job}} {{region}} {{reason}}",
                ),
            ],
            unit="ops",
            width=8,
            description="Retried store requests per second by reason (throttled, server_error, timeout, "
            "connection, truncated, other); op= splits them by request kind.",
        ),
        timeseries(
            "Publish failures and loop errors",
            [
                (
                    f"sum by (region, cluster) (increase(weightsync_publish_failures_total[{RATE}]))",
                    "publish {{region}}/{{cluster}}",
                ),
                (f"sum by (job, region) (increase(weightsync_loop_errors_total[{RATE}]))", "loop {{job}} {{region}}"),
            ],
            width=8,
            bars=True,
        ),
        timeseries(
            "Stalled store requests",
            [
                ("sum by (job, instance) (weightsync_store_stalled_requests)", "{{job}} {{instance}}"),
            ],
            width=8,
            step=True,
            description="Store requests running past --stall-after (retries included): a store that hangs. "
            "The process logs each one (store request stalled) and /v1/status shows it.",
        ),
        timeseries(
            "Targets up",
            [
                ('up{job=~"weightsync.*"}', "{{job}} {{instance}}"),
            ],
            width=8,
            step=True,
        ),
        row("Processes"),
        timeseries(
            "Resident memory",
            [
                (f"process_resident_memory_bytes{{{JOBS}}}", "{{job}} {{instance}}"),
            ],
            unit="bytes",
            width=6,
            description="Resident set size of each publisher, subscriber and mirror process.",
        ),
        timeseries(
            "CPU",
            [
                (f"rate(process_cpu_seconds_total{{{JOBS}}}[{RATE}])", "{{job}} {{instance}}"),
            ],
            width=6,
            description="CPU seconds per second (cores busy) of each process.",
        ),
        timeseries(
            "Open file descriptors",
            [
                (f"process_open_fds{{{JOBS}}} / process_max_fds{{{JOBS}}}", "{{job}} {{instance}}"),
            ],
            unit="percentunit",
            width=6,
            description="Open file descriptors as a fraction of the process limit.",
        ),
        timeseries(
            "Versions running",
            [
                ("count by (version) (weightsync_build_info)", "{{version}}"),
            ],
            width=6,
            step=True,
            description="Processes per weightsync version (weightsync_build_info): more than one line "
            "during a rollout.",
        ),
    ]


def layout(items: list[dict]) -> list[dict]:
    """Place panels left to right in rows of width 24; give them ids and grid positions."""
    out, x, y, row_h = [], 0, 0, 0
    for pid, panel in enumerate(items, start=1):
        panel = dict(panel)
        w, h = panel.pop("_w"), panel.pop("_h")
        if x + w > 24 or panel["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        panel = {"id": pid, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel}
        if not panel.get("description"):
            panel.pop("description", None)
        out.append(panel)
        x, row_h = x + w, max(row_h, h)
    return out


def templating() -> dict:
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            {
                "name": "region",
                "label": "Region",
                "type": "query",
                "datasource": DS,
                "query": {"query": "label_values(weightsync_current_version, region)", "refId": "region"},
                "definition": "label_values(weightsync_current_version, region)",
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {},
                "hide": 0,
                "refresh": 2,
                "sort": 1,
                "options": [],
            },
        ]
    }


def build() -> dict:
    return {
        "uid": "weightsync",
        "title": "weightsync",
        "description": "Cross-region weight delta sync: publishing, transfer, fleet versions, latency, mirrors, "
        "errors.",
        "tags": ["weightsync"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "annotations": {
            "list": [
                {
                    "name": "New version",
                    "datasource": DS,
                    "enable": True,
                    "iconColor": "blue",
                    "expr": "changes(max(weightsync_published_version)[2m:]) > 0",
                    "step": "30s",
                    "titleFormat": "version published",
                },
            ]
        },
        "templating": templating(),
        "panels": layout(panels()),
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed dashboard differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
