"""Prometheus metrics of the daemons: one :class:`Metrics` class over a caller's registry.

Names carry the ``weightsync_`` prefix and base-unit suffixes. Every series of a daemon carries the
same constant labels (``region``, ``cluster``; subscribers also ``subscriber``), so one Prometheus
can scrape a whole fleet. Versions are ``-1`` until known.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PHASES = ("read", "diff", "encode", "upload", "commit")
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_PAUSE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The metrics of one daemon (``role`` is ``publisher`` or ``subscriber``) in ``registry``."""

    def __init__(self, registry: CollectorRegistry, role: str, *, region: str = "", cluster: str = "", subscriber: str = ""):
        if role not in ("publisher", "subscriber"):
            raise ValueError(f"role must be publisher or subscriber, not {role!r}")
        self.registry, self.role = registry, role
        self.labels = {"region": region, "cluster": cluster}
        if role == "subscriber":
            self.labels["subscriber"] = subscriber
        names = tuple(self.labels)

        def gauge(name: str, doc: str, initial: float | None = None) -> Gauge:
            g = Gauge(name, doc, names, registry=registry).labels(**self.labels)
            if initial is not None:
                g.set(initial)
            return g

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets=_SECONDS) -> Histogram:
            return Histogram(name, doc, names, registry=registry, buckets=buckets).labels(**self.labels)

        self.store_retries = counter("weightsync_store_retries_total", "Store operations retried after a retryable error.")
        self.loop_errors = counter("weightsync_loop_errors_total", "Failed iterations of the daemon loop (logged, then backed off).")
        if role == "publisher":
            self.published_version = gauge("weightsync_published_version", "Newest version this publisher committed.", -1)
            self._publish_seconds = Histogram(
                "weightsync_publish_seconds", "Seconds per publish phase.", (*names, "phase"), registry=registry, buckets=_SECONDS
            )
            self.upload_bytes = counter("weightsync_upload_bytes_total", "Chunk bytes uploaded to the store.")
            self.checkpoint_bytes = gauge("weightsync_checkpoint_bytes", "Size of the last published checkpoint.")
            self.delta_bytes = gauge("weightsync_delta_bytes", "Encoded payload bytes of the last published version.")
            self.changed_fraction = gauge("weightsync_changed_fraction", "Fraction of elements that changed in the last version.")
            self.publish_failures = counter("weightsync_publish_failures_total", "Publish attempts that failed.")
        else:
            self.current_version = gauge("weightsync_current_version", "Version the current symlink points at.", -1)
            self.latest_version = gauge("weightsync_latest_version", "Head version of the store at the last check.", -1)
            self.version_lag = gauge("weightsync_version_lag", "Latest minus current version.", 0)
            self.staleness = gauge("weightsync_staleness_seconds", "Seconds since a newer version than the current one appeared.", 0)
            self.download_bytes = counter("weightsync_download_bytes_total", "Chunk bytes fetched from the store.")
            self.download_seconds = histogram("weightsync_download_seconds", "Seconds spent fetching chunks per sync.")
            self.apply_seconds = histogram("weightsync_apply_seconds", "Seconds spent decoding and writing a version per sync.")
            self.swap_pause = histogram("weightsync_swap_pause_seconds", "Seconds the swap itself took (symlink flip or in-place patch).", _PAUSE)
            self.checksum_failures = counter("weightsync_checksum_failures_total", "Data that failed checksum verification.")
            self.hook_failures = counter("weightsync_swap_hook_failures_total", "Failed swap hook attempts.")
            self.swaps = counter("weightsync_swaps_total", "Completed swaps.")

    def publish_phase(self, phase: str, seconds: float) -> None:
        self._publish_seconds.labels(**self.labels, phase=phase).observe(seconds)

    def observe_publish(self, result) -> None:
        """Record a :class:`~weightsync.publishing.PublishResult`."""
        for phase in PHASES:
            if phase in result.seconds:
                self.publish_phase(phase, result.seconds[phase])
        self.published_version.set(result.version)
        self.upload_bytes.inc(result.uploaded_bytes)
        self.checkpoint_bytes.set(result.raw_bytes)
        self.delta_bytes.set(result.payload_bytes)
        self.changed_fraction.set(result.changed_fraction)

    def on_retry(self, op: str, key: str, exc: Exception) -> None:
        """``on_retry`` callback of :class:`~weightsync.store.retry.RetryingStore`."""
        self.store_retries.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
