# PYTHON_ARGCOMPLETE_OK  (shell completion: eval "$(register-python-argcomplete weightsync)")
"""The ``weightsync`` command line. Builds configuration from flags and environment, then calls the API."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from weightsync._version import __version__
from weightsync.errors import ChecksumError, UsageError, WeightsyncError
from weightsync.service.flags import (
    S3_CONNECT_TIMEOUT,
    S3_READ_TIMEOUT,
    EnvParser,
    add_encoding_args,
    add_lazy_args,
    add_log_args,
    add_publisher_args,
    add_rank_args,
    add_signing_args,
    add_store_watch_args,
    add_subscriber_args,
    add_trust_args,
    env_argument,
    fallback_store,
    new_version_arg,
    parse_listen,
    publish_config,
    signing_key,
    trusted_keys,
    version_arg,
)
from weightsync.service.progress import Progress, counted, human_bytes, ratio_text
from weightsync.store.repo import open_repo, versions
from weightsync.sync.fleet import EXPIRE_AFTER
from weightsync.sync.lazy import LazyReads
from weightsync.sync.publish import PublishConfig, publish
from weightsync.sync.pull import PullConfig, pull, verify


def _default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "weightsync" / "publish"


def _store_options(args) -> dict:
    """``open_repo``'s options from ``--endpoint-url`` and, for an s3:// store, the S3 timeouts."""
    from weightsync.service.config import StoreConfig

    timeouts = {k: getattr(args, f"s3_{k}", None) for k in ("connect_timeout", "read_timeout")}
    return StoreConfig(args.store, getattr(args, "endpoint_url", None), **timeouts).options()


def _repo(args):
    """The command's store; with ``--trusted-key``, one that uses only versions a trusted key signed."""
    return open_repo(args.store, trusted_keys=trusted_keys(args), **_store_options(args))


def _progress(args, label: str) -> Progress:
    """A tqdm bar on stderr: only on a terminal (or in a notebook), off with --no-progress or TQDM_DISABLE=1."""
    return Progress(label, enabled=False if args.no_progress else None)


def _publish_config(args) -> PublishConfig:
    return publish_config(args)


def cmd_publish(args) -> int:
    cfg = _publish_config(args)
    cache = None if args.no_cache else Path(args.cache_dir or _default_cache()) / _cache_name(args.store)
    with _progress(args, f"publish {args.checkpoint_dir}") as progress:
        r = publish(
            args.checkpoint_dir,
            _repo(args),
            args.version,
            config=cfg,
            base_dir=args.base,
            cache_dir=cache,
            observer=progress,
        )
    kind = "keyframe" if r.keyframe else f"delta from {r.parent}"
    print(
        f"published version {r.version} ({kind}): {human_bytes(r.raw_bytes)} -> {human_bytes(r.payload_bytes)} "
        f"({ratio_text(r.raw_bytes, r.payload_bytes)}), {100 * r.changed_fraction:.2f}% elements changed, "
        f"{human_bytes(r.uploaded_bytes)} uploaded "
        f"in {r.seconds['total']:.2f}s",
        file=sys.stderr,
    )
    print(r.version)
    return 0


def cmd_publish_part(args) -> int:
    from weightsync.sync.parts import publish_part

    cfg = _publish_config(args)
    name = f"{_cache_name(args.store)}-rank{args.rank}-of-{args.world}"  # one base per rank, several per host
    cache = None if args.no_cache else Path(args.cache_dir or _default_cache()) / name
    with _progress(args, f"publish-part {args.rank}/{args.world} {args.checkpoint_dir}") as progress:
        r = publish_part(
            args.checkpoint_dir,
            _repo(args),
            args.rank,
            args.world,
            files=args.files,
            version=args.version,
            config=cfg,
            base_dir=args.base,
            cache_dir=cache,
            observer=progress,
        )
    kind = "keyframe" if r.keyframe else f"delta from {r.parent}"
    done = " (the same part was already stored)" if r.existed else ""
    print(
        f"rank {r.rank} of {r.world}: part of version {r.version} ({kind}), {counted(len(r.files), 'file')}: "
        f"{human_bytes(r.raw_bytes)} -> {human_bytes(r.payload_bytes)}, {human_bytes(r.uploaded_bytes)} uploaded in "
        f"{r.seconds['total']:.2f}s{done}; visible once commit-parts merges all {r.world} parts",
        file=sys.stderr,
    )
    print(r.version)
    return 0


def cmd_commit_parts(args) -> int:
    from weightsync.sync.parts import commit_parts

    if not args.timeout >= 0:
        raise UsageError(f"--timeout must be >= 0 seconds, not {args.timeout:g}")
    r = commit_parts(
        _repo(args),
        args.version,
        args.world,
        timeout=args.timeout,
        allow_removed=args.allow_removed_files,
        signing_key=signing_key(args),
    )
    kind = "keyframe" if r.keyframe else f"delta from {r.parent}"
    done = "was already committed" if r.already else "committed"
    print(
        f"version {r.version} ({kind}) {done} from {r.world} parts: {counted(r.files, 'file')}, "
        f"{human_bytes(r.raw_bytes)} -> {human_bytes(r.payload_bytes)} in {counted(r.chunks, 'chunk')}, "
        f"{r.seconds:.2f}s",
        file=sys.stderr,
    )
    print(r.version)
    return 0


def _cache_name(url: str) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(str(url).encode())


def _lazy(args) -> LazyReads:
    """``--lazy-chunks`` and ``--fallback-store`` (opened, but read only if a pull needs it)."""
    cfg = fallback_store(args)
    fallback = None if cfg is None else open_repo(cfg.url, **cfg.options())
    return LazyReads(args.lazy_chunks, fallback)


def cmd_pull(args) -> int:
    config = PullConfig(fetch_concurrency=args.concurrency, lazy=_lazy(args))
    with _progress(args, f"pull {args.out_dir}") as progress:
        r = pull(_repo(args), args.out_dir, args.version, config=config, observer=progress)
    src = "empty folder" if r.from_version is None else f"version {r.from_version}"
    how = "" if r.rebuilt_from is None else f" (rebuilt from keyframe {r.rebuilt_from})"
    if r.fallback_bytes:
        how += f" ({human_bytes(r.fallback_bytes)} of it from {config.lazy.fallback.url})"
    print(
        f"pulled version {r.version} from {src}: {human_bytes(r.fetched_bytes)} fetched{how}, "
        f"{counted(r.written_files, 'file')} written, {r.kept_files} kept, {r.seconds['total']:.2f}s",
        file=sys.stderr,
    )
    print(r.version)
    return 0


def cmd_versions(args) -> int:
    infos = versions(_repo(args))
    if args.json:
        print(json.dumps([asdict(i) for i in infos], indent=2))
        return 0
    print(f"{'version':>8} {'parent':>7} {'kind':>8} {'size':>10} {'stored':>10} {'ratio':>7} {'changed':>8}  created")
    for i in infos:
        kind = "keyframe" if i.keyframe else "delta"
        ratio = ratio_text(i.raw_bytes, i.payload_bytes)
        parent = "-" if i.parent is None else str(i.parent)
        print(
            f"{i.version:>8} {parent:>7} {kind:>8} {human_bytes(i.raw_bytes):>10} {human_bytes(i.payload_bytes):>10} "
            f"{ratio:>7} {100 * i.changed_fraction:>7.2f}%  {i.created}"
        )
    return 0


VERIFY_DIFFERS = 1  # the folder does not hold the version (a file differs, is missing or is extra)
VERIFY_UNCHECKED = 3  # could not tell: store unreachable, version missing, folder unreadable, install interrupted
VERIFY_EXIT_STATUS = f"""exit status:
  0  DIR holds the version byte for byte
  {VERIFY_DIFFERS}  DIR does not hold it: a file differs, is missing, or is not part of the version
  2  bad command line (an unknown option, a --version that is not a number or 'latest')
  {VERIFY_UNCHECKED}  could not check: the store URL cannot be opened, the store is unreachable or not a store,
     the version does not exist or (with --trusted-key) no trusted key signed it, DIR is missing
     or unreadable, or an install into DIR was interrupted (pull again to finish it)"""


def cmd_verify(args) -> int:
    try:
        v = verify(_repo(args), args.dir, args.version)
    except ChecksumError:
        raise  # exit_code 1: differs
    except WeightsyncError as exc:
        exc.exit_code = VERIFY_UNCHECKED
        raise
    except OSError as exc:
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"weightsync: error: could not check{where}: {exc.strerror or exc}", file=sys.stderr)
        return VERIFY_UNCHECKED
    print(f"{args.dir} holds version {v} byte for byte", file=sys.stderr)
    return 0


def cmd_keygen(args) -> int:
    from weightsync.store.signing import write_key_pair

    key = write_key_pair(args.out)
    print(
        f"wrote the private key {args.out} (mode 0600: for the publisher only) and the public key {args.out}.pub "
        f"(for every reader: --trusted-key); key id {key.key_id}",
        file=sys.stderr,
    )
    print(key.key_id)
    return 0


def cmd_demo(args) -> int:
    from weightsync.demo import run_demo

    if args.steps < 1 or args.hidden < 1:
        raise UsageError(f"--steps and --hidden must be at least 1, got {args.steps} and {args.hidden}")
    if args.workdir:  # a second run there failed at its first version, after its table's header ("": a new one)
        work = Path(args.workdir)
        if work.exists() and not work.is_dir():
            raise UsageError(f"--workdir {work}: not a directory")
        if work.is_dir() and any(work.iterdir()):
            raise UsageError(f"--workdir {work} is not empty: give a new or empty folder")
    return run_demo(args.workdir, steps=args.steps, hidden=args.hidden)


def _side_store(args, side: str):
    """The mirror's ``--from`` or ``--to`` store: its URL and S3 endpoint (``--{side}-endpoint-url``, else "
    "``--endpoint-url``)."""
    from weightsync.service.config import StoreConfig
    from weightsync.service.flags import store_timeouts

    url = args.src if side == "from" else args.dst
    endpoint = getattr(args, f"{side}_endpoint_url", None) or getattr(args, "endpoint_url", None)
    keys = trusted_keys(args) if side == "from" else None
    return StoreConfig(url, endpoint, trusted_keys=keys, **store_timeouts(args))


class _MirrorHealth:
    """What the mirror's ``/readyz`` says: ready once a pass has succeeded (both stores reachable, the
    destination a mirror of the source), and the outcome of the latest pass."""

    def __init__(self) -> None:
        self.ready, self.state, self.last_error = False, "starting", None

    def passed(self) -> None:
        self.ready, self.state, self.last_error = True, "idle", None

    def failed(self, exc: Exception) -> None:
        self.state, self.last_error = "error", f"{type(exc).__name__}: {exc}"

    def waiting(self, reason: str) -> None:
        self.state, self.last_error = "waiting", reason

    def readyz(self):
        from weightsync.service.runtime import json_answer

        doc = {"ready": self.ready, "state": self.state, **({"last_error": self.last_error} if self.last_error else {})}
        return json_answer(doc, 200 if self.ready else 503)


def _serve_mirror_http(text: str, flag: str, metrics, health: _MirrorHealth, log):
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` at ``http://HOST:PORT`` from a daemon thread."""
    from weightsync.service.metrics import CONTENT_TYPE
    from weightsync.service.runtime import event, json_answer, serve_routes

    host, port = parse_listen(text, flag)
    routes = {
        "/metrics": lambda: (200, CONTENT_TYPE, metrics.render()),
        "/healthz": lambda: json_answer({"status": "ok"}),
        "/readyz": health.readyz,
    }
    try:
        server = serve_routes(host, port, routes)
    except OSError as exc:  # address in use, not ours, or a host that does not resolve
        raise UsageError(f"{flag} {text}: cannot listen there: {exc.strerror or exc}") from None
    bound = server.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    event(log, f"mirror metrics listening on http://{shown}:{bound}/metrics (and /healthz, /readyz)")
    return server


def cmd_mirror(args) -> int:
    import contextlib
    import faulthandler
    import logging
    import signal
    import threading

    from prometheus_client import CollectorRegistry

    from weightsync.service.config import LogConfig
    from weightsync.service.flags import env_sources
    from weightsync.service.metrics import Metrics
    from weightsync.service.runtime import Stopped, StopToken, dump_stacks, event, open_daemon_repo, setup_logging
    from weightsync.service.stalls import StallWatch
    from weightsync.store.inflight import InFlight
    from weightsync.sync.mirror import MirrorConfig, MirrorObserver, mirror, parse_shard

    setup_logging(LogConfig(args.log_json, args.log_level))
    log = logging.getLogger("weightsync.mirror")
    shard, shards = parse_shard(args.shard)
    cfg = MirrorConfig(
        concurrency=args.concurrency,
        interval=args.interval,
        keyframe_payloads=args.keyframe_payloads,
        shard=shard,
        shards=shards,
        commit=args.commit or shards == 1,
    )
    metrics = Metrics(CollectorRegistry(), "mirror", region=args.region, cluster=args.cluster)
    health = _MirrorHealth()
    token = StopToken()  # also ends the waits between store retries: a stop is not held up by a store that is down
    stop = token.event
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dump = threading.Event()  # SIGUSR1, as the daemons: every thread's stack, logged by a thread of its own, so
    signal.signal(signal.SIGUSR1, lambda *_: dump.set())  # the handler never logs amid what the main thread does

    def dumper() -> None:
        while True:
            dump.wait()
            dump.clear()
            dump_stacks()

    threading.Thread(target=dumper, name="ws-stack-dump", daemon=True).start()
    with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):  # no stderr file: no dump
        faulthandler.register(signal.SIGUSR2, all_threads=True)  # to stderr, even with the main thread stuck

    class Report(MirrorObserver):  # metrics, logs and the health endpoints
        def on_heads(self, source: int | None, destination: int | None) -> None:
            metrics.mirror_heads(source, destination)

        def on_chunk(self, copied: bool, nbytes: int) -> None:
            metrics.mirror_chunk(copied, nbytes)

        def on_version(self, version: int, chunks: int, nbytes: int, seconds: float = 0.0) -> None:
            metrics.mirror_version(version, chunks, nbytes, seconds)
            event(
                log,
                f"mirrored version {version}: {counted(chunks, 'chunk')}, {human_bytes(nbytes)} copied",
                version=version,
            )

        def on_status(self, status) -> None:
            metrics.mirror_status(status)

        def on_error(self, exc: Exception) -> None:
            metrics.mirror_error(exc)
            health.failed(exc)
            event(
                log,
                f"mirror pass failed, retrying in {args.interval:g}s",
                logging.WARNING,
                error=f"{type(exc).__name__}: {exc}",
            )

        def on_pass(self, result) -> None:
            metrics.mirror_pass(result)
            health.passed()

        def on_waiting(self, reason: str) -> None:
            if health.state != "waiting":  # once, not at every poll
                event(log, f"waiting for the source: {reason}", source=args.src, interval=f"{args.interval:g}s")
            health.waiting(reason)

    flag = env_sources(args).get("metrics_listen", "--metrics-listen")
    server = (
        None if args.metrics_listen is None else _serve_mirror_http(args.metrics_listen, flag, metrics, health, log)
    )
    inflight = InFlight()
    stalls = StallWatch(inflight, args.stall_after, metrics, log).start()  # a hung store: logged, gauge
    try:
        src = open_daemon_repo(_side_store(args, "from"), metrics.on_retry, inflight, token)  # as the daemons do
        dst = open_daemon_repo(_side_store(args, "to"), metrics.on_retry, inflight, token)
        r = mirror(src, dst, follow=args.follow, config=cfg, stop=stop, observer=Report())
    except Stopped:  # stopped while a store request was being retried
        event(log, "mirror stopped")
        return 0
    except WeightsyncError as exc:
        if args.follow:  # a long-running mirror's end goes into its log too, with time and level
            event(log, "mirror stopped on an error", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        stalls.stop()
        if server is not None:
            server.shutdown()
            server.server_close()
    event(
        log,
        f"mirror {args.src} -> {args.dst}: {counted(len(r.copied_versions), 'version')}, "
        f"{counted(r.copied_chunks, 'chunk')}, {human_bytes(r.copied_bytes)} copied, "
        f"{counted(r.skipped_chunks, 'chunk')} already there, head {r.head}, "
        f"{r.seconds:.2f}s",
    )
    print("" if r.head is None else r.head)
    return 0


def _ranges(versions: list[int]) -> str:
    """Sorted version numbers as runs, ``[0-4, 7, 9-12]`` (a log line stays short for any count)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return "[" + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + "]"


def cmd_gc(args) -> int:
    from weightsync.sync.gc import GcConfig, gc
    from weightsync.sync.publish import REFRESH_AFTER

    cfg = GcConfig(keep=args.keep, grace_seconds=args.grace_seconds, dry_run=args.dry_run)
    if cfg.grace_seconds < REFRESH_AFTER and not cfg.dry_run:
        print(
            f"gc {args.store}: warning: a grace of {cfg.grace_seconds:g}s is below publishers' refresh_after "
            f"({REFRESH_AFTER:g}s): the chunks of a publish in flight may be deleted (it then fails and publishes "
            "again); use it when no publisher runs",
            file=sys.stderr,
        )
    r = gc(_repo(args), cfg)
    verb = "would delete" if r.dry_run else "deleted"
    print(
        f"gc {args.store}: kept versions {_ranges(r.kept_versions)}, {verb} "
        f"{counted(len(r.deleted_versions), 'version')} and {counted(r.deleted_chunks, 'chunk')} "
        f"({human_bytes(r.deleted_bytes)}); "
        f"{counted(r.young_chunks, 'unreferenced chunk')} younger than {args.grace_seconds:g}s left, "
        f"{counted(len(r.abandoned_versions), 'abandoned publish', 'abandoned publishes')} removed, {r.seconds:.2f}s",
        file=sys.stderr,
    )
    if r.touched_during_gc or r.referenced_during_gc:
        print(
            f"gc {args.store}: kept {r.touched_during_gc} chunks re-used and {r.referenced_during_gc} chunks "
            "referenced "
            "by writers while gc ran",
            file=sys.stderr,
        )
    if r.foreign_objects:
        print(
            f"gc {args.store}: left {r.foreign_objects} objects under chunks/ that are no chunks (not weightsync's; "
            "another store inside this one?)",
            file=sys.stderr,
        )
    if r.partial_writes:
        print(
            f"gc {args.store}: {verb} {r.partial_writes} unfinished uploads of killed writers (temporary files, "
            "multipart uploads) older than the grace",
            file=sys.stderr,
        )
    if r.deleted_parts or r.pending_parts:
        print(
            f"gc {args.store}: {verb} {r.deleted_parts} parts of merged, stale or abandoned multi-rank publishes; "
            f"kept {r.pending_parts} of publishes in progress",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "kept": r.kept_versions,
                "deleted": r.deleted_versions,
                "deleted_chunks": r.deleted_chunks,
                "deleted_bytes": r.deleted_bytes,
                "young_chunks": r.young_chunks,
                "abandoned": r.abandoned_versions,
                "touched_during_gc": r.touched_during_gc,
                "referenced_during_gc": r.referenced_during_gc,
                "deleted_parts": r.deleted_parts,
                "pending_parts": r.pending_parts,
                "deleted_signatures": r.deleted_signatures,
                "lazy_chunks": r.lazy_chunks,
                "deleted_notes": r.deleted_notes,
                "foreign_objects": r.foreign_objects,
                "partial_writes": r.partial_writes,
                "dry_run": r.dry_run,
            }
        )
    )
    return 0


def cmd_publisher(args) -> int:
    from weightsync.service.flags import publisher_config

    return _run_daemon(publisher_config(args, os.environ))


def cmd_subscriber(args) -> int:
    from weightsync.service.flags import subscriber_config

    return _run_daemon(subscriber_config(args, os.environ))


def _run_daemon(cfg) -> int:
    """Build a daemon from its config (publisher or subscriber) and serve it until SIGTERM."""
    import logging

    from prometheus_client import CollectorRegistry

    from weightsync.service.api import Deps, create_app
    from weightsync.service.config import PublisherConfig
    from weightsync.service.metrics import Metrics
    from weightsync.service.runtime import StopToken, open_daemon_repo, run, setup_logging
    from weightsync.service.stalls import StallWatch
    from weightsync.store.inflight import InFlight

    setup_logging(cfg.log)
    ident = cfg.identity
    publisher = isinstance(cfg, PublisherConfig)
    metrics = Metrics(
        CollectorRegistry(),
        "publisher" if publisher else "subscriber",
        region=ident.region,
        cluster=ident.cluster,
        subscriber="" if publisher else ident.id,
    )
    inflight = InFlight()  # the store requests running now: a hung store is reported (weightsync.service.stalls)
    stop = StopToken()  # also ends the waits between store retries: SIGTERM is not held up by a store that is down
    repo = open_daemon_repo(cfg.store, metrics.on_retry, inflight, stop)
    role = "publisher" if publisher else "subscriber"
    stalls = StallWatch(inflight, cfg.stall_after, metrics, logging.getLogger(f"weightsync.{role}"))
    if publisher:
        from weightsync.service.publisher import Publisher

        daemon = Publisher(cfg, repo, metrics, stalls=stalls, stop_token=stop)
    else:
        from weightsync.service.subscriber import Subscriber

        daemon = Subscriber(cfg, repo, metrics, stalls=stalls, stop_token=stop)
        daemon.claim()  # another process writing the folder: a one-line error before anything is served
    return run(lambda: create_app(Deps(daemon, metrics, cfg.api.token, cfg.grace)), cfg.api)


def cmd_fleet(args) -> int:
    import time

    from weightsync.service.config import StoreConfig
    from weightsync.sync.fleet import format_fleet, read_fleet, read_fleets

    if not args.expire_after > 0:
        raise UsageError(f"--expire-after must be a positive number of seconds, not {args.expire_after:g}")
    stores, endpoints = args.store, args.endpoint_url or []
    if len(endpoints) not in (0, 1, len(stores)):
        raise UsageError(
            f"--endpoint-url: give one for every store ({len(stores)}, in the order of --store) or one for all, "
            f"not {len(endpoints)}"
        )
    repos = []
    for i, url in enumerate(stores):
        endpoint = endpoints[i] if len(endpoints) == len(stores) else (endpoints or [None])[0]
        timeouts = {k: getattr(args, f"s3_{k}") for k in ("connect_timeout", "read_timeout")}
        repo = open_repo(url, **StoreConfig(url, endpoint, **timeouts).options())
        repo.require()
        repos.append(repo)
    options = {"expire_after": args.expire_after, "everyone": args.all}
    now = time.time()
    fleet = read_fleet(repos[0], now, **options) if len(repos) == 1 else read_fleets(repos, now, **options)
    print(json.dumps(fleet, indent=2) if args.json else format_fleet(fleet, args.expire_after))
    return 0


def _add_store(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """``--store`` and ``--endpoint-url``; with ``environ``, with environment defaults (deployed jobs)."""
    env_argument(p, environ, "--store", required=True, help="file:///abs/path, a plain path, or s3://bucket/prefix")
    env_argument(p, environ, "--endpoint-url", help="S3 endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)")
    _add_s3_timeouts(p, environ)


def _add_s3_timeouts(p: argparse.ArgumentParser, environ: Mapping[str, str] | None) -> None:
    """A command's ``--s3-connect-timeout`` and ``--s3-read-timeout`` (the daemons' are in service.flags)."""
    for what, default, help_ in (
        ("connect", S3_CONNECT_TIMEOUT, "to connect to an S3 endpoint"),
        ("read", S3_READ_TIMEOUT, "an S3 request may wait for the next bytes of its answer"),
    ):
        env_argument(
            p,
            environ,
            f"--s3-{what}-timeout",
            type=float,
            help=f"seconds {help_} before the attempt fails and is retried (default {default:g}; a store that "
            "hangs fails after 5 such waits, retries included)",
        )


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (default: one on stderr when it is a terminal; TQDM_DISABLE=1 also turns it off)",
    )


def _add_publish_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", help="folder holding exactly the parent version (e.g. the previous checkpoint)")
    p.add_argument("--cache-dir", help="where to keep a copy of the head version (default: ~/.cache/weightsync)")
    p.add_argument("--no-cache", action="store_true", help="keep no copy; pull the parent when a delta needs it")
    add_encoding_args(p)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The command line. The daemons, ``mirror``, ``gc`` and ``fleet`` take a default for every flag
    from ``environ`` (``WEIGHTSYNC_<FLAG>``; None: from nothing, but the help still names them);
    the one-shot commands read no environment."""
    env = {} if environ is None else environ
    parser = EnvParser(prog="weightsync", description="Bit-exact weight delta sync over object storage.")
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("publish", help="publish a checkpoint directory as a new version")
    p.add_argument("checkpoint_dir")
    _add_store(p)
    p.add_argument("--version", type=new_version_arg, default=None, help="version number (default: head + 1)")
    _add_publish_options(p)
    add_signing_args(p)
    _add_progress(p)
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("publish-part", help="publish one rank's files as its part of the next version (multi-rank)")
    p.add_argument("checkpoint_dir")
    _add_store(p)
    add_rank_args(p, required=True)
    p.add_argument(
        "--files",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="relative paths this rank publishes, repeatable (default: the safetensors files round-robin by "
        "sorted path, every other file on rank 0)",
    )
    p.add_argument("--version", type=new_version_arg, default=None, help="version number (default: head + 1)")
    _add_publish_options(p)
    add_signing_args(
        p,
        help="the key commit-parts signs with: a part builds only on a head it signed (else every rank "
        "makes a keyframe); parts themselves are not signed",
    )
    _add_progress(p)
    p.set_defaults(func=cmd_publish_part)

    p = sub.add_parser("commit-parts", help="merge the W parts of a version into one version and commit it")
    _add_store(p)
    p.add_argument("--version", type=int, required=True, help="the version the parts make up")
    p.add_argument("--world", type=int, required=True, help="W, the number of parts (ranks)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for all parts (default 600)")
    p.add_argument(
        "--allow-removed-files",
        action="store_true",
        help="commit even if no part has some file of the head version (default: refuse, nothing committed)",
    )
    add_signing_args(p)
    p.set_defaults(func=cmd_commit_parts)

    p = sub.add_parser("pull", help="create or incrementally update a folder to hold a version")
    _add_store(p)
    p.add_argument(
        "--version", type=version_arg, default="latest", metavar="N|latest", help="(default latest: the head)"
    )
    p.add_argument("--concurrency", type=int, default=32, help="chunks in flight (default 32)")
    p.add_argument("out_dir")
    add_trust_args(p)
    add_lazy_args(p)
    _add_progress(p)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("versions", help="list the versions in a store")
    _add_store(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_versions)

    p = sub.add_parser(
        "verify",
        help="exit 0 iff DIR holds the version byte for byte",
        description="Check, read-only, that DIR holds the version byte for byte.",
        epilog=VERIFY_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_store(p)
    p.add_argument(
        "--version", type=version_arg, default="latest", metavar="N|latest", help="(default latest: the head)"
    )
    p.add_argument("dir", metavar="DIR", help="the folder to check")
    add_trust_args(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "keygen",
        help="write an Ed25519 key pair for signed versions: OUT (private, 0600) and OUT.pub",
        description="Write a new Ed25519 key pair: OUT, the private key (PEM PKCS#8, mode 0600), for "
        "publish/commit-parts/publisher --signing-key; OUT.pub, the public key (one OpenSSH line), for "
        "pull/verify/subscriber/mirror --trusted-key. Refuses to overwrite either. Prints the key id.",
    )
    p.add_argument("out", metavar="OUT", help="the private key file to create (the public key goes to OUT.pub)")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("demo", help="generate, publish, pull and verify a small trajectory on a file store")
    p.add_argument("--workdir", help="where to put the trajectory, store and replica (default: a temp dir)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256: ~36 MB checkpoints)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("mirror", help="copy versions into a regional store (chunks, manifest, head)")
    add = lambda *flags, **kw: env_argument(p, env, *flags, **kw)  # noqa: E731
    add("--from", dest="src", required=True, help="source store URL")
    add("--to", dest="dst", required=True, help="destination (regional) store URL")
    add("--follow", action="store_true", help="keep polling the source until SIGTERM/SIGINT")
    add("--interval", type=float, default=1.0, help="seconds between polls of the source head, > 0 (default 1)")
    add("--concurrency", type=int, default=64, help="chunks copied at once (default 64; memory: x chunk size)")
    add(
        "--keyframe-payloads",
        choices=("eager", "lazy", "never"),
        default="lazy",
        help="a keyframe's full payloads, which followers of its parent never read: copied before its head "
        "moves (eager), after it (lazy, the default) or never",
    )
    add(
        "--shard",
        metavar="I/N",
        default="0/1",
        help="copy only the chunks of shard I of N (by chunk id; default 0/1: all); run N processes, one with --commit",
    )
    add(
        "--commit",
        action="store_true",
        help="with --shard: this process also commits versions (notes, manifests, head) once every chunk of "
        "theirs is in the destination, whichever shard copied it (implied without --shard)",
    )
    add("--endpoint-url", help="S3 endpoint of both stores (default: boto3's)")
    add("--from-endpoint-url", help="S3 endpoint of the source (overrides --endpoint-url)")
    add("--to-endpoint-url", help="S3 endpoint of the destination (overrides --endpoint-url)")
    add(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve /metrics (Prometheus), /healthz and /readyz at http://HOST:PORT (default: none; host 127.0.0.1)",
    )
    add("--region", default="", help="region label of the metrics (the destination's region)")
    add("--cluster", default="", help="cluster label of the metrics")
    add_trust_args(p, env)
    add_log_args(p, env)
    add_store_watch_args(p, env)
    p.set_defaults(func=cmd_mirror)

    p = sub.add_parser("gc", help="delete old versions and the chunks only they need")
    add = lambda *flags, **kw: env_argument(p, env, *flags, **kw)  # noqa: E731
    _add_store(p, env)
    add("--keep", type=int, required=True, help="newest versions to keep, with their chains")
    add(
        "--grace-seconds",
        type=float,
        default=3600.0,
        help="never delete an unreferenced chunk younger than this (default 3600; > publishers' refresh_after, 900)",
    )
    add("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("publisher", help="daemon: publish every checkpoint dropped into a folder")
    add_publisher_args(p, env)
    p.set_defaults(func=cmd_publisher)

    p = sub.add_parser("subscriber", help="daemon: keep a folder at the newest (or a pinned) version, A/B swapped")
    add_subscriber_args(p, env)
    p.set_defaults(func=cmd_subscriber)

    p = sub.add_parser("fleet", help="every subscriber's version, lag and staleness (the fleet ledger)")
    add = lambda *flags, **kw: env_argument(p, env, *flags, **kw)  # noqa: E731
    add(
        "--store",
        action="append",
        required=True,
        sep=",",
        help="file:///abs/path, a plain path, or s3://bucket/prefix; repeat it for every region's store",
    )
    add(
        "--endpoint-url",
        action="append",
        sep=",",
        help="S3 endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL); one for all stores, or one per --store "
        "in the same order (stores in regions with their own endpoints)",
    )
    _add_s3_timeouts(p, env)
    add("--json", action="store_true", help="the fleet as JSON instead of a table")
    add(
        "--show-gone",
        "--all",
        dest="all",
        action="store_true",
        help="also show stopped subscribers and those whose records expired",
    )
    add(
        "--expire-after",
        type=float,
        default=EXPIRE_AFTER,
        help=f"seconds after which a subscriber that stopped rewriting its record (every --ledger-interval) is "
        f"gone: not shown without --all (default {EXPIRE_AFTER:g})",
    )
    p.set_defaults(func=cmd_fleet)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(os.environ)
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (argcomplete): print them and exit
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    if args.func in (cmd_publisher, cmd_subscriber, cmd_mirror):  # the processes that serve /metrics
        from prometheus_client import disable_created_metrics

        disable_created_metrics()  # no *_created series: Prometheus does not use them
    try:
        return args.func(args)
    except WeightsyncError as exc:
        print(f"weightsync: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a file system or network failure outside our own checks: still one line
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"weightsync: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightsync: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
