"""Prometheus metrics of the daemons and the mirror: one :class:`Metrics` class over a caller's
registry, ``weightsync_`` names with unit suffixes, the same constant labels on every series
(docs/DESIGN.md; the list is in docs/OPERATIONS.md)."""

from __future__ import annotations

import contextlib
import time

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from weightsync.errors import SignatureError
from weightsync.store.retry import RETRY_OPS, RETRY_REASONS, retry_op, retry_reason

PHASES = ("read", "diff", "encode", "upload", "commit")
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_PAUSE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CONTENT_TYPE = CONTENT_TYPE_LATEST
ROLES = ("publisher", "subscriber", "mirror")
ENGINE_OUTCOMES = ("applied", "aborted", "apply_failed")  # how an engine transaction ends
HEAD_OUTCOMES = ("changed", "unchanged", "error", "leader")  # a subscriber's head reads (weightsync.service.heads)


def register_runtime_collectors(registry: CollectorRegistry) -> None:
    """Add the process, platform and GC collectors to ``registry`` (a fresh ``CollectorRegistry()``
    has none; prometheus_client's default ``REGISTRY`` has them already)."""
    if registry is REGISTRY:
        return
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)


class Metrics:
    """The metrics of one process (``role`` is ``publisher``, ``subscriber`` or ``mirror``) in ``registry``.

    A mirror's ``mirror_*`` methods are the observers of :func:`weightsync.sync.mirror.mirror`; a failed
    pass counts in ``weightsync_loop_errors_total``, as a failed daemon loop iteration does.
    ``runtime``: also register the process, platform and GC collectors on ``registry``.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        role: str,
        *,
        region: str = "",
        cluster: str = "",
        subscriber: str = "",
        clock=time.time,
        runtime: bool = True,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
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

        if runtime:
            register_runtime_collectors(registry)
        from weightsync._version import __version__

        Gauge(
            "weightsync_build_info",
            "Always 1; the version label is the weightsync version running.",
            (*names, "version"),
            registry=registry,
        ).labels(**self.labels, version=__version__).set(1)
        self._store_retries = Counter(
            "weightsync_store_retries_total",
            "Store operations retried after a retryable error, by operation and reason.",
            (*names, "op", "reason"),
            registry=registry,
        )
        for op in RETRY_OPS:
            for reason in RETRY_REASONS:
                self._store_retries.labels(**self.labels, op=op, reason=reason)
        self.loop_errors = counter(
            "weightsync_loop_errors_total", "Failed iterations of the daemon loop (logged, then backed off)."
        )
        self.store_stalled = gauge(
            "weightsync_store_stalled_requests",
            "Store requests (retries included) running for longer than --stall-after seconds now.",
            0,
        )
        self.store_stalls = counter(
            "weightsync_store_stalls_total", "Store requests that ran for longer than --stall-after seconds."
        )
        if role != "publisher":  # the readers: what --trusted-key made them refuse
            self.refused_version = gauge(
                "weightsync_refused_version",
                "Version refused for its signature (unsigned, unknown key, bad signature) and not yet "
                "superseded by a good one; -1: none.",
                -1,
            )
            self.refusals = counter(
                "weightsync_signature_refusals_total", "Attempts to use a version refused for its signature."
            )
        if role == "publisher":
            self.published_version = gauge(
                "weightsync_published_version",
                "Newest version committed to the store: its head as this publisher last read or moved it.",
                -1,
            )
            self._publish_seconds = Histogram(
                "weightsync_publish_seconds",
                "Seconds per publish phase.",
                (*names, "phase"),
                registry=registry,
                buckets=_SECONDS,
            )
            self.upload_bytes = counter("weightsync_upload_bytes_total", "Chunk bytes uploaded to the store.")
            self.checkpoint_bytes = gauge("weightsync_checkpoint_bytes", "Size of the last published checkpoint.")
            self.delta_bytes = gauge("weightsync_delta_bytes", "Encoded payload bytes of the last published version.")
            self.changed_ratio = gauge(
                "weightsync_changed_ratio", "Fraction (0..1) of elements that changed in the last version."
            )
            self.publish_failures = counter("weightsync_publish_failures_total", "Publish attempts that failed.")
        elif role == "mirror":
            self._clock = clock
            self._mark = time.monotonic()
            self._destination = -1
            self.source_version = gauge(
                "weightsync_mirror_source_version",
                "Head version of the source store, read at the start of the last pass.",
                -1,
            )
            self.destination_version = gauge(
                "weightsync_mirror_destination_version", "Head version of the destination (regional) store.", -1
            )
            self.copied_versions = counter(
                "weightsync_mirror_copied_versions_total", "Versions copied into the destination."
            )
            self.copied_chunks = counter(
                "weightsync_mirror_copied_chunks_total",
                "Chunks copied into the destination (counted as each lands, failed passes included).",
            )
            self.copied_bytes = counter(
                "weightsync_mirror_copied_bytes_total",
                "Chunk bytes copied into the destination (counted as each chunk lands).",
            )
            self.skipped_chunks = counter(
                "weightsync_mirror_skipped_chunks_total", "Chunks not copied: already in the destination."
            )
            self.version_seconds = histogram(
                "weightsync_mirror_version_seconds", "Seconds to mirror one version (chunks, manifest, head)."
            )
            self.last_success = gauge(
                "weightsync_mirror_last_success_timestamp_seconds",
                "Unix time at the end of the last successful pass (0: none yet).",
                0,
            )
            self.start_time = gauge("weightsync_mirror_start_time_seconds", "Unix time the mirror started.", clock())
            self.lag_versions = gauge(
                "weightsync_mirror_lag_versions",
                "Source versions above the destination head (0: caught up), at the last poll or commit.",
                0,
            )
            self._behind_since: float | None = None
            self.lag_seconds = gauge(
                "weightsync_mirror_lag_seconds",
                "Seconds since the oldest source head not yet at the destination was first seen (0: caught up).",
            )
            self.lag_seconds.set_function(
                lambda: 0.0 if self._behind_since is None else max(0.0, self._clock() - self._behind_since)
            )
            self.chunks_in_flight = gauge(
                "weightsync_mirror_chunks_in_flight", "Chunk copies and checks running now.", 0
            )
            self.lazy_chunks = gauge(
                "weightsync_mirror_lazy_chunks",
                "Chunks of committed keyframes (full payloads) still to copy to the destination.",
                0,
            )
        else:
            self.current_version = gauge("weightsync_current_version", "Version the current symlink points at.", -1)
            self.latest_version = gauge("weightsync_latest_version", "Head version of the store at the last check.", -1)
            self.target_version = gauge(
                "weightsync_target_version", "Version the subscriber is pinned to; -1 while it follows the head.", -1
            )
            self.pinned = gauge(
                "weightsync_pinned", "1 while the subscriber is pinned to a version, 0 while it follows the head.", 0
            )
            self.version_lag = gauge("weightsync_version_lag", "Latest minus current version.", 0)
            self.staleness = gauge(
                "weightsync_staleness_seconds", "Seconds since a newer version than the current one appeared.", 0
            )
            self.download_bytes = counter("weightsync_download_bytes_total", "Chunk bytes fetched from the store.")
            self.download_seconds = histogram("weightsync_download_seconds", "Seconds spent fetching chunks per sync.")
            self.apply_seconds = histogram(
                "weightsync_apply_seconds", "Seconds spent decoding and writing a version per sync."
            )
            self.swap_pause = histogram(
                "weightsync_swap_pause_seconds",
                "Seconds the swap itself took (symlink flip or in-place patch).",
                _PAUSE,
            )
            self.checksum_failures = counter(
                "weightsync_checksum_failures_total", "Data that failed checksum verification."
            )
            self.hook_failures = counter("weightsync_swap_hook_failures_total", "Failed swap hook attempts.")
            self.hook_degraded = gauge(
                "weightsync_swap_hook_degraded",
                "1 while the swap hook of the version served has not succeeded after a failed or cut-off try "
                "(the engine may serve older weights); 0 otherwise.",
                0,
            )
            self.swaps = counter("weightsync_swaps_total", "Completed swaps.")
            self._engine_version = Gauge(
                "weightsync_engine_version",
                "Version each registered engine rank says it holds (-1: unknown, e.g. after a failed apply).",
                (*names, "replica", "rank"),
                registry=registry,
            )
            self._engine_transactions = Counter(
                "weightsync_engine_transactions_total",
                "Engine transactions (prepare on every rank of a replica, then apply) by how they ended.",
                (*names, "outcome"),
                registry=registry,
            )
            for outcome in ENGINE_OUTCOMES:
                self._engine_transactions.labels(**self.labels, outcome=outcome)
            self.engine_transaction_seconds = histogram(
                "weightsync_engine_transaction_seconds",
                "Seconds from the prepare instructions to the last rank's applied report, per applied transaction.",
            )
            self._head_reads = Counter(
                "weightsync_head_reads_total",
                "Reads of the store's head by outcome: changed (read whole), unchanged (a conditional read, "
                "answered without a body), error; leader: news of a head from the --head-from leader (the "
                "subscriber then reads the head itself).",
                (*names, "outcome"),
                registry=registry,
            )
            for outcome in HEAD_OUTCOMES:
                self._head_reads.labels(**self.labels, outcome=outcome)
            self.head_leader_up = gauge(
                "weightsync_head_leader_up",
                "1 while the --head-from leader answers (the subscriber waits on it between polls); 0 while "
                "it polls the store itself (always, without --head-from).",
                0,
            )
            self.engine_dropped = counter(
                "weightsync_engine_ranks_dropped_total", "Engine ranks dropped because they stopped polling."
            )

    def target(self, target: int | str) -> None:
        """The subscriber's target: a pinned version, or ``"latest"`` (the head)."""
        pinned = type(target) is int
        self.target_version.set(target if pinned else -1)
        self.pinned.set(int(pinned))

    def engine_version(self, replica: str, rank: int, version: int | None, remove: bool = False) -> None:
        """Set the version engine rank ``rank`` of ``replica`` holds (None: unknown), or ``remove`` its
        series (the rank was dropped)."""
        labels = {**self.labels, "replica": replica, "rank": str(rank)}
        if remove:
            with contextlib.suppress(KeyError):
                self._engine_version.remove(*labels.values())
        else:
            self._engine_version.labels(**labels).set(-1 if version is None else version)

    def head_read(self, outcome: str) -> None:
        """Count a head read that ended with ``outcome`` (one of ``HEAD_OUTCOMES``)."""
        self._head_reads.labels(**self.labels, outcome=outcome).inc()

    def engine_transactions(self, outcome: str) -> None:
        """Count an engine transaction that ended with ``outcome`` (one of ``ENGINE_OUTCOMES``)."""
        self._engine_transactions.labels(**self.labels, outcome=outcome).inc()

    def publish_phase(self, phase: str, seconds: float) -> None:
        """Observe the seconds one phase of a publish took."""
        self._publish_seconds.labels(**self.labels, phase=phase).observe(seconds)

    def observe_publish(self, result, committed: bool = True, uploaded: bool = True) -> None:
        """Record a :class:`~weightsync.sync.publish.PublishResult` (a rank's part: not ``committed``,
        so the published version waits for the commit; not ``uploaded``: its bytes were counted as they
        went, by :class:`~weightsync.service.progress.DaemonProgress`)."""
        for phase in PHASES:
            if phase in result.seconds:
                self.publish_phase(phase, result.seconds[phase])
        if committed:
            self.published_version.set(result.version)
        if uploaded:
            self.upload_bytes.inc(result.uploaded_bytes)
        self.checkpoint_bytes.set(result.raw_bytes)
        self.delta_bytes.set(result.payload_bytes)
        self.changed_ratio.set(result.changed_fraction)

    # --- the mirror's observers (see weightsync.sync.mirror.mirror) ------------------------------------
    def mirror_heads(self, source: int | None, destination: int | None) -> None:
        """A pass read both heads and starts copying: the time to the next version counts from now."""
        self._mark = time.monotonic()
        self.source_version.set(-1 if source is None else source)
        self._set_destination(-1 if destination is None else destination)

    def mirror_chunk(self, copied: bool, nbytes: int) -> None:
        """A chunk was copied (``copied``) or found already there; called as each one is done."""
        if copied:
            self.copied_chunks.inc()
            self.copied_bytes.inc(nbytes)
        else:
            self.skipped_chunks.inc()

    def mirror_version(self, version: int, chunks: int = 0, nbytes: int = 0, seconds: float | None = None) -> None:
        """The destination head reached ``version`` (its chunks and bytes were counted by :meth:`mirror_chunk`);
        ``seconds`` from when the mirror first saw it (None: since the last heads or version)."""
        now = time.monotonic()
        self.version_seconds.observe(now - self._mark if seconds is None else seconds)
        self._mark = now
        self.copied_versions.inc()
        self._set_destination(max(version, self._destination))  # the head is there (or past it), never back

    def mirror_status(self, status) -> None:
        """The link's lag, copies in flight and lazy chunks (a :class:`~weightsync.sync.mirror.MirrorStatus`)."""
        self.lag_versions.set(status.lag_versions)
        self._behind_since = status.behind_since
        self.chunks_in_flight.set(status.in_flight)
        self.lazy_chunks.set(status.lazy_pending)

    def mirror_pass(self, result) -> None:
        """After a successful pass (``result``: the running :class:`~weightsync.sync.mirror.MirrorResult`)."""
        if result.head is not None:
            self._set_destination(result.head)
        self.last_success.set(self._clock())
        self.refused(None)

    def mirror_error(self, exc: Exception) -> None:
        """Count a failed mirror pass (and a version refused for its signature)."""
        self.loop_errors.inc()
        if isinstance(exc, SignatureError):
            self.refused(exc.version)

    def refused(self, version: int | None) -> None:
        """A version was refused for its signature (None: the refusal is over: a good version was
        used since, or the refused one is gone)."""
        if version is None:
            self.refused_version.set(-1)
        else:
            self.refused_version.set(version)
            self.refusals.inc()

    def _set_destination(self, version: int) -> None:
        self._destination = version
        self.destination_version.set(version)

    def on_retry(self, op: str, key: str, exc: Exception) -> None:
        """``on_retry`` callback of :class:`~weightsync.store.retry.RetryingStore`: counted by operation
        and reason, never by key or message (those would make a series per object)."""
        self._store_retries.labels(**self.labels, op=retry_op(op), reason=retry_reason(exc)).inc()

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
