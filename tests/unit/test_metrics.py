"""Metric idioms of :class:`weightsync.service.metrics.Metrics`: runtime collectors, build info, low-cardinality
retry labels, ``_ratio`` names, and docs/OPERATIONS.md listing every metric.

A real scrape of running daemons (no ``*_created`` series, every name used by the dashboards and the
alerts present) is checked in tests/integration/test_prometheus_scrape.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, IncompleteReadError, ReadTimeoutError
from prometheus_client import REGISTRY, CollectorRegistry

import weightsync
from weightsync.errors import StoreError
from weightsync.service.metrics import ROLES, Metrics
from weightsync.store import s3
from weightsync.store.retry import RETRY_OPS, RETRY_REASONS, retry_op, retry_reason

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"
RUNTIME = (
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
    "python_info",
    "python_gc_collections_total",
)


def metrics(role: str, registry: CollectorRegistry | None = None) -> Metrics:
    return Metrics(
        registry or CollectorRegistry(), role, region="r", cluster="c", subscriber="s" if role == "subscriber" else ""
    )


def samples(m: Metrics) -> list:
    return [s for family in m.registry.collect() for s in family.samples]


@pytest.mark.parametrize("role", ROLES)
def test_every_role_has_the_runtime_collectors_and_build_info(role):
    m = metrics(role)
    names = {s.name for s in samples(m)}
    assert set(RUNTIME) <= names, set(RUNTIME) - names
    build = [s for s in samples(m) if s.name == "weightsync_build_info"]
    assert len(build) == 1 and build[0].value == 1
    assert build[0].labels == {**m.labels, "version": weightsync.__version__}


def test_runtime_collectors_are_optional_and_never_doubled_on_the_default_registry():
    assert not {s.name for s in samples(Metrics(CollectorRegistry(), "mirror", runtime=False))} & set(RUNTIME)
    m = Metrics(CollectorRegistry(), "mirror")
    assert {s.name for s in samples(m)} >= set(RUNTIME)
    # the default registry has them already: registering again would raise "Duplicated timeseries"
    from weightsync.service.metrics import register_runtime_collectors

    register_runtime_collectors(REGISTRY)


@pytest.mark.parametrize("role", ROLES)
def test_retries_are_counted_by_a_fixed_op_and_reason_never_by_key_or_message(role):
    m = metrics(role)

    def retry_series() -> dict[tuple[str, str], float]:
        out = {}
        for s in samples(m):
            if s.name == "weightsync_store_retries_total":
                assert set(s.labels) == {*m.labels, "op", "reason"}, s.labels
                out[s.labels["op"], s.labels["reason"]] = s.value
        return out

    fixed = {(op, reason) for op in RETRY_OPS for reason in RETRY_REASONS}
    assert retry_series() == dict.fromkeys(fixed, 0.0)  # every combination there from the start
    for i in range(50):  # many keys and messages, a few kinds
        err = StoreError(f"s3://b: GET chunks/{i:040x}: SlowDown (503) request id {i}", key=f"chunks/{i:040x}")
        err.retry_reason = "throttled" if i % 2 else f"something new {i}"
        m.on_retry("GET" if i % 3 else "PUT", err.key, err)
    m.on_retry("RENAME", "x", StoreError("plain"))
    counted = retry_series()
    assert set(counted) == fixed | {("other", "other")}
    assert counted["get", "throttled"] + counted["put", "throttled"] == 25
    assert counted["get", "other"] + counted["put", "other"] == 25 and counted["other", "other"] == 1
    assert sum(counted.values()) == 51


def test_retry_op_and_reason_map_to_their_fixed_sets():
    assert [retry_op(op) for op in ("GET", "PUT", "HEAD", "LIST", "DELETE", "COPY", "PATCH")] == [*RETRY_OPS, "other"]
    assert retry_reason(StoreError("x")) == "other"
    assert retry_reason(ValueError("x")) == "other"
    err = StoreError("x")
    err.retry_reason = "timeout"
    assert retry_reason(err) == "timeout"


@pytest.mark.parametrize(
    "code, status, reason",
    [
        ("SlowDown", 503, "throttled"),
        ("TooManyRequests", 429, "throttled"),
        ("Throttling", 400, "throttled"),
        ("RequestTimeout", 400, "timeout"),
        ("InternalError", 500, "server_error"),
        ("ServiceUnavailable", 503, "server_error"),
        ("BadGateway", 502, "server_error"),
        ("GatewayTimeout", 504, "server_error"),
    ],
)
def test_s3_error_responses_carry_their_retry_reason(code, status, reason):
    assert s3._status_reason(code, status) == reason
    assert reason in RETRY_REASONS


@pytest.mark.parametrize(
    "exc, reason",
    [
        (ReadTimeoutError(endpoint_url="http://x"), "timeout"),
        (ConnectTimeoutError(endpoint_url="http://x"), "timeout"),
        (TimeoutError(), "timeout"),
        (EndpointConnectionError(endpoint_url="http://x"), "connection"),
        (ConnectionResetError(), "connection"),
        (IncompleteReadError(actual_bytes=1, expected_bytes=2), "truncated"),
    ],
)
def test_s3_transport_failures_carry_their_retry_reason(exc, reason):
    assert s3._transport_reason(exc) == reason


def test_fractions_are_named_ratio():
    m = metrics("publisher")
    m.observe_publish(
        SimpleNamespace(
            seconds={"read": 0.1}, version=3, uploaded_bytes=10, raw_bytes=100, payload_bytes=10, changed_fraction=0.25
        )
    )
    values = {s.name: s.value for s in samples(m)}
    assert values["weightsync_changed_ratio"] == 0.25
    assert "weightsync_changed_fraction" not in values
    for family in (f for role in ROLES for f in metrics(role).registry.collect()):
        if family.name.startswith("weightsync_") and re.search(r"\b(fraction|ratio)\b", family.documentation, re.I):
            assert family.name.endswith("_ratio"), family.name


def test_operations_guide_lists_every_metric():
    text = OPERATIONS.read_text()
    listed = set(re.findall(r"`((?:weightsync|process|python)_[a-z_]+)", text))
    for role in ROLES:
        m = metrics(role)
        if role == "publisher":
            m.publish_phase("read", 0.1)
        for family in m.registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert name in listed, f"docs/OPERATIONS.md does not list {name}"
