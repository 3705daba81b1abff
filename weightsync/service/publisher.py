"""The publisher daemon: publish every checkpoint a trainer drops into a watched folder (step N as
version N, once its marker file is there, in order, none skipped unless stale), delta-based on the
head's checkpoint folder or a cache (docs/DESIGN.md)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
import stat
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from weightsync.errors import (
    BaseMismatchError,
    CheckpointError,
    FormatError,
    NotFoundError,
    StoreError,
    UsageError,
    VersionError,
)
from weightsync.format.keys import MAX_VERSION, part_key, refused_key
from weightsync.format.manifest import part_from_json
from weightsync.local.checkpoint import scan_checkpoint
from weightsync.local.state import holds
from weightsync.service.config import PublisherConfig
from weightsync.service.metrics import Metrics
from weightsync.service.progress import DaemonProgress, human_bytes, ratio_text
from weightsync.service.runtime import (
    Idle,
    Stopped,
    StopToken,
    Wait,
    event,
    iteration_failed,
    sleep_or_wake,
    stall_view,
    warm_codec,
)
from weightsync.service.stalls import StallWatch
from weightsync.store.repo import Repo
from weightsync.sync.parts import commit_parts, publish_part, rank_poll, read_refusal
from weightsync.sync.publish import PublishConfig, PublishResult, publish

log = logging.getLogger("weightsync.publisher")


_STEP = re.compile(r"(\d+)$")


class PathNotAllowed(UsageError):
    """An explicit publish of a folder outside the watched folder and the publish roots."""


class PathNotFound(UsageError):
    """An explicit publish of a folder that does not exist."""


def parse_step(name: str) -> int | None:
    """The step number a checkpoint folder's name ends in, or None. A number above the format's
    largest version (10^18) comes back as ``MAX_VERSION + 1``: :func:`scan` sets such folders aside."""
    m = _STEP.search(name)
    if m is None or name.startswith("."):
        return None
    digits = m.group(1).lstrip("0") or "0"
    return MAX_VERSION + 1 if len(digits) > len(str(MAX_VERSION)) else min(int(digits), MAX_VERSION + 1)


@dataclass(frozen=True)
class Candidate:
    """A checkpoint folder under the watched folder: its step, path, whether its marker is there, and
    when it last changed (to give up on a stale one)."""

    step: int
    path: Path
    ready: bool
    mtime: float  # last change of the folder, for stale detection


def scan(watch_dir: Path, marker: str, refused: dict[str, str] | None = None) -> list[Candidate]:
    """Checkpoint folders under ``watch_dir``, by step (the first name wins for a repeated step); a
    symlink to a folder is followed (a checkpoint written elsewhere and linked in). A folder that
    can never be published is no candidate, and goes to ``refused`` with why: its step is above the
    largest version the format allows (10^18), or it is a link to the watched folder or above it."""
    found: dict[int, Candidate] = {}
    try:
        entries = sorted(os.scandir(watch_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError(f"the watched folder {watch_dir} is not a directory") from None
    for e in entries:
        step = parse_step(e.name)
        try:
            if step is None or step in found or not e.is_dir():
                continue
            why = None
            if step > MAX_VERSION:
                why = f"its step is above {MAX_VERSION}, the largest version the format allows"
            elif e.is_symlink() and Path(watch_dir).resolve().is_relative_to(os.path.realpath(e.path)):
                why = "it links to the watched folder or a folder holding it"
            if why is not None:
                if refused is not None:
                    refused[e.name] = why
                continue
            ready = os.path.isfile(os.path.join(e.path, marker))
            found[step] = Candidate(step, Path(e.path), ready, e.stat().st_mtime)
        except FileNotFoundError:  # removed (or a link's target) while it was looked at
            continue
    return sorted(found.values(), key=lambda c: c.step)


# --- planning (pure) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    """The plan's answer "publish this candidate": with the head's checkpoint folder as the delta base
    when it is still there, and the unfinished steps given up on."""

    candidate: Candidate
    base: Path | None  # the head version's checkpoint folder, when it is still there
    skipped: tuple[int, ...] = ()  # unfinished steps given up on (older than stale_after)


PublishAction = Idle | Wait | Publish


def plan_publish(
    candidates: list[Candidate],
    head: int | None,
    now: float,
    stale_after: float,
    failed_step: int | None = None,
    retry_at: float = 0.0,
) -> PublishAction:
    """The next checkpoint to publish: the lowest step above the head, once it is ready."""
    skipped = []
    for c in candidates:
        if head is not None and c.step <= head:
            continue
        if not c.ready:
            if now - c.mtime < stale_after:
                behind = [x.step for x in candidates if x.step > c.step and x.ready]
                return Wait(
                    f"waiting for checkpoint {c.step} to complete"
                    + (
                        f"; ready checkpoint(s) {', '.join(map(str, behind[:5]))}{' ...' if len(behind) > 5 else ''} "
                        f"wait behind it until it has its marker or is skipped "
                        f"{stale_after - (now - c.mtime):.0f}s from now (--stale-after)"
                        if behind
                        else ""
                    )
                )
            skipped.append(c.step)
            continue
        if c.step == failed_step and now < retry_at:
            return Wait(f"checkpoint {c.step} failed; retrying in {retry_at - now:.1f}s")
        base = next((x.path for x in candidates if x.step == head and x.ready), None)
        return Publish(c, base, tuple(skipped))
    return Idle("no checkpoint to publish" if head is None else f"version {head} is the newest checkpoint")


# --- the daemon ----------------------------------------------------------------------------------
class Publisher:
    """The publisher's state and loop; the HTTP API (``weightsync.service.api``) reads and steers it."""

    def __init__(
        self,
        cfg: PublisherConfig,
        repo: Repo,
        metrics: Metrics,
        clock=time.time,
        stalls: StallWatch | None = None,
        stop_token: StopToken | None = None,
    ):
        self.cfg, self.repo, self.metrics, self.clock = cfg, repo, metrics, clock
        self.stalls = stalls  # store requests that hang (weightsync.service.stalls)
        self.cache_dir = cfg.state_dir / "cache"
        self._watch_missing = False  # the watched folder was missing at the last look (logged once)
        self.state = "starting"
        self.reason = ""
        self.head: int | None = None
        self.pending: list[int] = []
        self.last_error: str | None = None
        self.last_publish: dict | None = None
        self.stop_token = stop_token or StopToken()  # given: the one the store's retries wait on too
        self.progress: DaemonProgress | None = None  # the publish under way (phase, bytes), for the status
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self._failed: tuple[int, int, float] | None = None  # step, failures, retry_at
        self._errors = 0
        self._part: int | None = None  # rank mode: the version whose part this rank stored, not yet committed
        self._unpublishable: set[str] = set()  # checkpoint folders already reported as never publishable
        # versions POST /v1/publish gave a folder that is not the watched step of that number, and the
        # watched folders of that step already reported as left out (the number is taken)
        self._taken: dict[int, Path] = {}
        self._shadowed: set[Path] = set()
        self._preexisting: set[Path] | None = None  # folders complete at the first look: not judged
        self._judged: set[Path] = set()  # folders that completed while watched, at or below the head: judged once
        self._mine: set[Path] = set()  # folders this process published (as given, and resolved)
        self._publishing: set[Path] = set()  # ... and the one it publishes now (the loop's look runs meanwhile)
        self._mine_steps: set[int] = set()  # versions this process published (a folder renamed since is one)
        self._skipped_stale: set[int] = set()  # steps this process skipped as unfinished (--stale-after)
        self._blocked: str | None = None  # the unfinished checkpoint last reported as holding back others
        self._refused: tuple[int, str] | None = None  # rank mode: the version and reason last logged
        self._rng = random.Random()  # rank mode: the jitter of its polls (never the training's seeded generator)

    def request_stop(self) -> None:
        """Stop after the current step (a publish in progress is cancelled at its next check)."""
        self.stop_token.set()
        self.state = "stopping"
        if self._wake is not None:
            self._wake.set()

    @property
    def ready(self) -> bool:
        """Whether ``/readyz`` answers ready: started and not stopping."""
        return self.state not in ("starting", "stopping")

    def status(self) -> dict:
        """The ``GET /v1/status`` document."""
        state, reason, stalled = stall_view(self.stalls, self.state, self.reason)
        return {
            "role": "publisher",
            "id": self.cfg.identity.id,
            "region": self.cfg.identity.region,
            "cluster": self.cfg.identity.cluster,
            "store": self.repo.url,
            "watch_dir": str(self.cfg.watch_dir),
            "head_version": self.head,
            "pending": self.pending,
            "state": state,
            "reason": reason,
            "stalled": stalled,
            "progress": None if self.progress is None else self.progress.doc(),
            "last_publish": self.last_publish,
            "last_error": self.last_error,
            "rank": self.cfg.rank,
            "world": self.cfg.world,
            "part_stored": self._part,
            "signing_key": None if self.cfg.publish.signing_key is None else self.cfg.publish.signing_key.key_id,
        }

    async def run(self) -> None:
        """The daemon's loop: list, plan, publish, until stopped."""
        self._lock = self._lock or asyncio.Lock()
        self._wake = asyncio.Event()
        warm_codec()
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        if self.stalls is not None:
            self.stalls.start()
        lister = asyncio.create_task(self._list_pending(), name="pending")
        try:
            while not self.stop_token.is_set:
                await sleep_or_wake(self._wake, await self._iteration(), self.stop_token)
        finally:
            lister.cancel()
            with suppress(asyncio.CancelledError):
                await lister
            if self.stalls is not None:
                self.stalls.stop()

    async def _list_pending(self) -> None:
        """Keep ``pending`` current every poll interval, also while an iteration waits on a store that
        hangs or on a long publish: the checkpoints written meanwhile show in the status."""
        while True:
            await asyncio.sleep(self.cfg.poll_interval)
            try:
                candidates = await asyncio.to_thread(scan, self.cfg.watch_dir, self.cfg.marker)
            except (OSError, CheckpointError):
                continue  # the loop reports an unreadable folder, or one that is a file
            head = self.head
            self.pending = [c.step for c in candidates if head is None or c.step > head]

    async def _iteration(self) -> float:
        try:
            refused: dict[str, str] = {}
            candidates = await asyncio.to_thread(scan, self.cfg.watch_dir, self.cfg.marker, refused)
            self._report_refused(refused)
            # what waits, before the store is asked (a store that hangs must not hide new checkpoints)
            self.pending = [c.step for c in candidates if self.head is None or c.step > self.head]
            self.head = await asyncio.to_thread(self.repo.head_version)
            if self.head is not None:  # (a restarted publisher reports the store's head, not -1)
                self.metrics.published_version.set(self.head)
            if self._part is not None and self.head is not None and self.head >= self._part:
                if self.head > self._part:
                    event(
                        log,
                        f"the head moved past version {self._part}, which this rank stored a part of",
                        logging.WARNING,
                        head=self.head,
                        part=self._part,
                    )
                self._part = None  # committed (by this rank or another)
            self.pending = [c.step for c in candidates if self.head is None or c.step > self.head]
            self._report_shadowed(candidates)
            if self.cfg.rank is None:
                self._report_unpublished(candidates)
            failed_step, _, retry_at = self._failed or (None, 0, 0.0)
            if self._part is not None:  # rank mode: nothing else until this part's version is committed
                return await self._await_commit(failed_step, retry_at)
            # ranks must agree on every version, so in rank mode no rank skips an unfinished checkpoint
            stale = self.cfg.stale_after if self.cfg.rank is None else math.inf
            action = plan_publish(candidates, self.head, self.clock(), stale, failed_step, retry_at)
            if candidates:
                self._watch_missing = False
            else:
                action = await asyncio.to_thread(self._missing_watch, action)
            self.reason = (
                f"publishing checkpoint {action.candidate.step}" if isinstance(action, Publish) else action.reason
            )
            self._errors = 0
            if not isinstance(action, Publish):
                self.state = "idle" if isinstance(action, Idle) else "waiting"
                self._report_blocked(action)
                return self._poll()
            self._skipped_stale.update(action.skipped)
            for step in action.skipped:
                event(
                    log,
                    f"skipping unfinished checkpoint {step}",
                    logging.WARNING,
                    step=step,
                    stale_after=self.cfg.stale_after,
                )
            c = action.candidate
            if self.cfg.rank is not None and await asyncio.to_thread(self._part_stored, c.step):
                self._part = c.step  # stored before a restart: not encoded again
                event(log, f"part {self.cfg.rank} of version {c.step} is already stored", version=c.step)
                return 0.0
            try:
                await self.publish_folder(c.path, c.step, action.base)
            except CheckpointError as exc:  # its file names are the folder's: say which step's folder
                if str(c.path) in str(exc):
                    raise
                raise CheckpointError(f"checkpoint {c.path}: {exc}") from exc
            return 0.0  # look for the next one at once
        except Stopped:
            return 0.0
        except Exception as exc:  # logged, counted, backed off; the loop goes on
            # a failed publish is retried when its step's back-off ends (plan_publish waits until then)
            wait = None if self._failed is None else self._failed[2] - self.clock()
            return iteration_failed(self, exc, log, wait if wait is not None and wait > 0 else None)

    def _missing_watch(self, action: Idle | Wait | Publish) -> Idle | Wait | Publish:
        """``action``, or where the watched folder does not exist, an Idle that says so: logged (WARNING)
        once each time it goes missing, since a mistyped ``--watch`` looks like no checkpoint yet."""
        missing = not os.path.exists(self.cfg.watch_dir)
        if missing and not self._watch_missing:
            event(
                log,
                f"the watched folder {self.cfg.watch_dir} does not exist: waiting for it (is --watch right?)",
                logging.WARNING,
                path=str(self.cfg.watch_dir),
            )
        self._watch_missing = missing
        return Idle(f"the watched folder {self.cfg.watch_dir} does not exist") if missing else action

    def _poll(self) -> float:
        """The wait before the next look at the store: ``--poll-interval``; a rank's is stretched
        with the job's size and jittered (:func:`weightsync.sync.parts.rank_poll`), since every rank
        of a job reads the head (and a waiting one the refusal key) each time."""
        if self.cfg.rank is None:
            return self.cfg.poll_interval
        return rank_poll(self.cfg.poll_interval, self.cfg.world, self._rng)

    def _report_blocked(self, action: Idle | Wait) -> None:
        """Log once (WARNING) an unfinished checkpoint that holds back ready ones after it."""
        blocked = isinstance(action, Wait) and "wait behind it" in action.reason
        key = action.reason.split(";")[0] if blocked else None
        if blocked and key != self._blocked:
            event(log, f"an unfinished checkpoint holds back later ones: {action.reason}", logging.WARNING)
        self._blocked = key

    def _report_shadowed(self, candidates: list[Candidate]) -> None:
        """Log once (ERROR, and in the status) each ready checkpoint whose step's version number
        ``POST /v1/publish`` gave another folder: the watcher takes it for published, and it is not."""
        for c in candidates:
            other = self._taken.get(c.step)
            if c.ready and other is not None and c.path not in self._shadowed and other != c.path.resolve():
                self._shadowed.add(c.path)
                self.last_error = (
                    f"checkpoint {c.path} is not published: its version number {c.step} was given to {other} "
                    "by POST /v1/publish; publish it by hand with a version no step will take"
                )
                event(log, self.last_error, logging.ERROR, path=str(c.path), version=c.step)

    def _report_unpublished(self, candidates: list[Candidate]) -> None:
        """Log once (ERROR, and in the status) each checkpoint at or below the head that this process
        did not publish, though it completed (or appeared) while this process watched, or was still
        above the head at its first look: another writer took its step's number (a CLI publish,
        another publisher) or moved the head past it, and the watcher would take it for published.
        Folders complete and at or below the head at the first look are not judged (what a former run
        published cannot be told from here). No store request: it never holds up the loop."""
        head = self.head
        if self._preexisting is None:  # (a folder still above the head is this process's to publish: judged)
            self._preexisting = {c.path for c in candidates if c.ready and head is not None and c.step <= head}
            return
        for c in candidates:
            if not c.ready or head is None or c.step > head or c.path in self._preexisting or c.path in self._judged:
                continue
            names = {c.path, c.path.resolve()}
            if not names.isdisjoint(self._publishing):
                continue  # judged once that publish has ended
            self._judged.add(c.path)
            if c.step in self._taken or c.step in self._mine_steps or not names.isdisjoint(self._mine):
                continue  # a number given by POST /v1/publish: _report_shadowed's; or published here
            why = (
                "it was skipped as unfinished (--stale-after) before it completed"
                if c.step in self._skipped_stale
                else f"another writer took version {c.step}, or a number past it"
            )
            self.last_error = (
                f"checkpoint {c.path} is not published: the head is {head}, and this publisher did not publish step "
                f"{c.step} ({why}); publish it by hand with a version no step will take"
            )
            event(log, self.last_error, logging.ERROR, path=str(c.path), version=c.step, head=head)

    def _report_refused(self, refused: dict[str, str]) -> None:
        """Log once each checkpoint folder skipped for good (:func:`scan`'s ``refused``)."""
        for name in sorted(set(refused) - self._unpublishable):
            event(
                log,
                f"skipping checkpoint {name!r}: {refused[name]}",
                logging.ERROR,
                path=str(self.cfg.watch_dir / name),
            )
        self._unpublishable = set(refused)

    async def _await_commit(self, failed_step: int | None, retry_at: float) -> float:
        """Rank mode with a part stored: commit it (``--commit``) or wait for another rank to."""
        part = self._part
        self._errors = 0
        if not self.cfg.commit or (failed_step == part and self.clock() < retry_at):
            self.state = "waiting"
            self.reason = (
                f"part {self.cfg.rank} of version {part} stored; waiting for its commit"
                if not self.cfg.commit
                else f"committing version {part} failed; retrying in {retry_at - self.clock():.1f}s"
            )
            if not self.cfg.commit:
                await self._report_refusal(part)
            return self._poll() if not self.cfg.commit else min(self.cfg.poll_interval, retry_at - self.clock())
        self.reason = f"committing version {part} once all {self.cfg.world} parts are stored"
        await self._guarded(part, "committing", self._commit_blocking, part)
        return 0.0

    async def _report_refusal(self, part: int) -> None:
        """A committer refused ``part``'s version: say why in the status, and log it once per reason. This rank
        waits on (the version can be committed only from other parts, once gc has removed these)."""
        reason = await asyncio.to_thread(self._refusal, part)
        if reason is None:
            return
        self.reason = f"part {self.cfg.rank} of version {part} stored; the committer refused version {part}: {reason}"
        if self._refused != (part, reason):  # a committer that retries may refuse again for another reason
            event(log, f"the committer refused version {part}", logging.WARNING, version=part, reason=reason)
        self._refused = (part, reason)

    def _refusal(self, version: int) -> str | None:
        """Why a committer refused this rank's stored part of ``version``, if one did; None also
        where the store cannot tell now (the status then says it waits)."""
        key = part_key(version, self.cfg.rank, self.cfg.world)
        try:
            if self.repo.store.head(refused_key(version, self.cfg.world)) is None:  # the common case: one HEAD
                return None
            return read_refusal(self.repo, part_from_json(self.repo.store.get(key), f"{self.repo.url}/{key}"))
        except (StoreError, FormatError):
            return None

    def _part_stored(self, version: int) -> bool:
        """This rank's part of ``version`` is in the store, built on the current head."""
        key = part_key(version, self.cfg.rank, self.cfg.world)
        try:
            part = part_from_json(self.repo.store.get(key), f"{self.repo.url}/{key}")
        except NotFoundError:
            return False
        return part.parent == self.head

    async def publish_folder(self, path: Path, version: int | None, base: Path | None = None) -> PublishResult:
        """Publish ``path`` as ``version`` (default: its step if above the head, else head + 1); in
        rank mode this rank's part of it (committed by the next iterations)."""
        names = {Path(path), Path(path).resolve()}
        self._publishing |= names  # the loop's look must not judge it while it is published
        try:
            result = await self._guarded(version, "publishing", self._publish_blocking, path, version, base)
        finally:
            self._publishing -= names
        self._mine |= names
        if self.cfg.rank is None:
            self.head = max(self.head or -1, result.version)
        else:
            self._part = result.version
        self._mine_steps.add(result.version)
        self._record(path, result)
        return result

    async def _guarded(self, step: int | None, state: str, fn, *args):
        """Run ``fn(*args)`` on a worker thread under the publish lock; a failure is counted and
        backs off the retries of ``step``."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            self.state = state
            try:
                result = await asyncio.to_thread(fn, *args)
            except (Stopped, asyncio.CancelledError):
                raise
            except Exception:
                self.metrics.publish_failures.inc()
                if step is not None:
                    failures = self._failed[1] + 1 if self._failed and self._failed[0] == step else 1
                    self._failed = (step, failures, self.clock() + self.cfg.backoff.delay(failures))
                self.state = "error"
                raise
            self._failed = None
            self.state = "idle"
            return result

    def _publish_config(self, path: Path) -> PublishConfig:
        """The publish settings for ``path``: the marker is left out of the version when it is empty
        (a flag), and published when it has content (a checkpoint file written last, such as
        ``model.safetensors.index.json``, which the version would otherwise lack without a word)."""
        cfg, marker = self.cfg.publish, self.cfg.marker
        try:
            st = os.stat(path / marker, follow_symlinks=False)
        except OSError:
            return cfg
        if marker in cfg.ignore and stat.S_ISREG(st.st_mode) and st.st_size > 0:
            return replace(cfg, ignore=tuple(g for g in cfg.ignore if g != marker))
        return cfg

    def _publish_blocking(self, path: Path, version: int | None, base: Path | None) -> PublishResult:
        # uploads are counted as each chunk lands (weightsync_upload_bytes_total), failed publishes too
        self.progress = DaemonProgress(self.stop_token, self.metrics.upload_bytes.inc, version, self.clock)
        try:
            return self._publish_with(path, version, base, self.progress)
        finally:
            self.progress = None

    def _publish_with(self, path: Path, version: int | None, base: Path | None, stop) -> PublishResult:
        cfg, cache = self._publish_config(path), self.cache_dir
        files = None
        if self.cfg.rank is not None and self.cfg.own_files:
            files = [f.path for f in scan_checkpoint(path, cfg.ignore)]

        def run(base: Path | None):
            if self.cfg.rank is None:
                return publish(path, self.repo, version, config=cfg, base_dir=base, cache_dir=cache, observer=stop)
            return publish_part(
                path,
                self.repo,
                self.cfg.rank,
                self.cfg.world,
                files,
                version=version,
                config=cfg,
                base_dir=base,
                cache_dir=cache,
                observer=stop,
            )

        result = None
        if base is not None:
            try:
                result = run(base)
            except BaseMismatchError as exc:
                event(
                    log,
                    "previous checkpoint differs from the head version; using the cache",
                    logging.WARNING,
                    base=base,
                    error=str(exc),
                )
        return result or run(None)

    def _commit_blocking(self, version: int) -> None:
        """Rank mode with --commit: wait for every part of ``version``, merge and commit it."""

        def sleep(seconds: float) -> None:
            self.stop_token.check()
            time.sleep(seconds)

        r = commit_parts(
            self.repo,
            version,
            self.cfg.world,
            timeout=self.cfg.commit_timeout,
            sleep=sleep,
            signing_key=self.cfg.publish.signing_key,
        )
        self._part = None
        self.head = max(self.head or -1, r.version)
        self.metrics.published_version.set(r.version)
        event(
            log,
            f"{'found' if r.already else 'committed'} version {r.version} from {r.world} parts",
            version=r.version,
            files=r.files,
            size=human_bytes(r.raw_bytes),
            stored=human_bytes(r.payload_bytes),
            seconds=f"{r.seconds:.3f}",
        )

    def _record(self, path: Path, r: PublishResult) -> None:
        self.metrics.observe_publish(r, committed=self.cfg.rank is None, uploaded=False)  # counted as they went
        self.last_publish = {
            "path": str(path),
            "time": self.clock(),
            **asdict(r),
            "ratio": r.ratio,
            "changed_fraction": r.changed_fraction,
        }
        self.last_error = None
        s = r.seconds
        kind = "keyframe" if r.keyframe else "delta"
        what = (
            f"part {self.cfg.rank} of {self.cfg.world} of version {r.version}"
            if self.cfg.rank is not None
            else f"version {r.version}"
        )
        event(
            log,
            f"published {what}",
            version=r.version,
            kind=kind,
            parent=r.parent,
            size=human_bytes(r.raw_bytes),
            stored=human_bytes(r.payload_bytes),
            ratio=ratio_text(r.raw_bytes, r.payload_bytes),
            changed=f"{100 * r.changed_fraction:.2f}%",
            uploaded=human_bytes(r.uploaded_bytes),
            **{f"{k}_s": f"{v:.3f}" for k, v in s.items()},
        )

    def allowed(self, path: str) -> Path:
        """An explicit publish's folder, resolved (symlinks too): a strict subfolder of the watched folder
        or of a publish root, and none of those folders itself nor one holding them."""
        if len(path.encode("utf-8", "surrogatepass")) > 4096:  # PATH_MAX; and resolve() is quadratic in depth
            raise UsageError(f"path is longer than 4096 bytes: {path[:100]!r}...")
        try:
            p = Path(path).resolve()
            roots = [self.cfg.watch_dir.resolve(), *(r.resolve() for r in self.cfg.publish_roots)]
            if not any(p != r and p.is_relative_to(r) for r in roots):
                raise PathNotAllowed(f"{path!r} is not under the watched folder or a --publish-root")
            if any(r.is_relative_to(p) or holds(p, r) for r in roots):  # a root (a bind mount of one too)
                raise PathNotAllowed(
                    f"{path!r} is the watched folder or a --publish-root, or holds one; "
                    "give one checkpoint folder inside it"
                )
            if not p.is_dir():
                raise PathNotFound(f"{path!r} is not a directory")
        except (OSError, ValueError) as exc:  # NUL bytes, unencodable names, loops
            raise PathNotFound(f"{path!r} is not a usable folder name ({exc})") from None
        return p

    def default_version(self, path: Path, head: int | None) -> int:
        """The version ``POST /v1/publish`` gives a folder: its step if at least head + 1, else head + 1."""
        step = parse_step(path.name)
        nxt = 0 if head is None else head + 1
        return step if step is not None and step >= nxt else nxt

    async def publish_request(self, path: str, version: int | None) -> PublishResult:
        """``POST /v1/publish``: publish a folder now (waits for a publish in flight)."""
        if self.cfg.rank is not None:
            raise UsageError(
                "this publisher runs in rank mode (--rank): it publishes its part of each checkpoint in its "
                "watched folder, and POST /v1/publish, which publishes whole versions, is off"
            )
        folder = await asyncio.to_thread(self.allowed, path)  # resolving symlinks may block on the file system
        head = await asyncio.to_thread(self.repo.head_version)
        v = self.default_version(folder, head) if version is None else version
        if head is not None and v <= head:
            raise VersionError(f"version {v} is not after the head version {head}")
        candidates = await asyncio.to_thread(scan, self.cfg.watch_dir, self.cfg.marker)
        base = next((c.path for c in candidates if c.step == head and c.ready and c.path != folder), None)
        result = await self.publish_folder(folder, v, base)
        if folder.parent != self.cfg.watch_dir.resolve() or parse_step(folder.name) != v:
            self._taken[v] = folder  # a watched step of this number will be reported, not taken as published
        return result
