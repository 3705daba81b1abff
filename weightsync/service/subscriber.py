"""The subscriber daemon: follow the store's head (or a pinned version) into A/B slots, verify,
swap the ``current`` symlink atomically, fire the swap hook and write the fleet record. Each
iteration asks the pure :func:`plan_next` what to do (docs/DESIGN.md: layout, pins, refills)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path

from weightsync.errors import ChecksumError, NotFoundError, SignatureError, UsageError, VersionError, WeightsyncError
from weightsync.format.manifest import Manifest
from weightsync.local.base import clone
from weightsync.local.install import clear_folder, empty_folder
from weightsync.local.lock import FolderLock
from weightsync.local.state import (
    REFILL,
    STATE_DIR,
    Recorded,
    Snapshot,
    claims_version,
    disown,
    installed_change,
    read_state,
    rebase_state,
    snapshot,
    snapshot_change,
)
from weightsync.local.verify import verify_folder
from weightsync.service.config import SubscriberConfig
from weightsync.service.engines import EngineCoordinator
from weightsync.service.heads import HeadReader, LeaderFeed
from weightsync.service.hooks import HookRecord, HookRunner, read_hook_record, write_hook_record
from weightsync.service.metrics import Metrics
from weightsync.service.pin import (
    LATEST,
    ForeignTargetError,
    Target,
    read_target,
    startup_target,
    target_path,
    write_target,
)
from weightsync.service.progress import DaemonProgress, human_bytes
from weightsync.service.runtime import (
    Idle,
    Stopped,
    StopToken,
    Wait,
    event,
    iteration_failed,
    open_daemon_repo,
    sleep_or_wake,
    stall_view,
    warm_codec,
)
from weightsync.service.slots import Slots, StandbyRelease, slot_version
from weightsync.service.stalls import StallWatch
from weightsync.store import same_store
from weightsync.store.repo import Repo
from weightsync.sync.fleet import STOPPED, FleetRecord, record_key, superseded_at, write_record
from weightsync.sync.lazy import LazyReads
from weightsync.sync.pull import PullConfig, pull
from weightsync.sync.selection import STATE as PARTIAL_STATE
from weightsync.sync.selection import Selection, materialize, read_partial_state

log = logging.getLogger("weightsync.subscriber")


def _drop_copy(folder: Path) -> None:
    """Remove what an unfinished copy into the standby slot left (it claims no version)."""
    clear_folder(folder)


class _SeedInterrupted(Exception):
    """The idle copy into the standby slot gave way to other work."""


# --- planning (pure) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class View:
    """What the planner knows about the local side."""

    current: int | None  # version ``current`` points at (None: nothing served yet)
    standby: int | None = None  # version the standby slot holds, if any
    failed_version: int | None = None  # the last version whose sync failed ...
    failures: int = 0  # ... how many times in a row ...
    retry_at: float = 0.0  # ... and when it may be tried again


@dataclass(frozen=True)
class Sync:
    """The plan's answer "bring the standby slot to ``version``, then swap", and why."""

    version: int
    reason: str


Action = Idle | Wait | Sync


def plan_next(view: View, head: int | None, target: Target, now: float) -> Action:
    """What to do next, given the local view, the store's head version and the target."""
    if head is None:
        return Wait("the store has no versions yet")
    desired = head if target == LATEST else int(target)
    if desired > head:
        return Wait(f"pinned version {desired} is not published yet (head {head})")
    if view.current == desired:
        return Idle(f"serving version {desired}" + (" (pinned)" if target != LATEST else ""))
    if view.failed_version == desired and now < view.retry_at:
        return Wait(f"version {desired} failed {view.failures} time(s); retrying in {view.retry_at - now:.1f}s")
    if view.standby == desired:
        return Sync(desired, "the standby slot already holds it")
    how = (
        "pinned"
        if target != LATEST
        else "head moved back"
        if view.current is not None and desired < view.current
        else "head moved"
    )
    return Sync(desired, f"{how}: {view.current} -> {desired}")


# --- the daemon ----------------------------------------------------------------------------------
@dataclass
class SyncResult:
    """What one sync did: the version now in the slot, the one before, bytes fetched, the version's bytes,
    seconds fetching and building, whether the slot was refilled in place."""

    version: int
    from_version: int | None
    fetched_bytes: int
    raw_bytes: int
    fetch_seconds: float
    build_seconds: float
    in_place: bool = False  # the standby slot was refilled in place
    served: Snapshot | None = None  # the slot's files as filled (what the served-slot check compares)


class Subscriber:
    """The subscriber's state and loop; the HTTP API (``weightsync.service.api``) reads and steers it."""

    def __init__(
        self,
        cfg: SubscriberConfig,
        repo: Repo,
        metrics: Metrics,
        clock=time.time,
        stalls: StallWatch | None = None,
        stop_token: StopToken | None = None,
    ):
        self.cfg, self.repo, self.metrics, self.clock = cfg, repo, metrics, clock
        self.stalls = stalls  # store requests that hang (weightsync.service.stalls)
        self.slots = Slots(cfg.target_dir)
        self.release = StandbyRelease(cfg.standby_hold, cfg.hook is not None)
        self.selection = Selection(cfg.include, cfg.exclude)
        self.target, self.target_from = self._initial_target()
        metrics.target(self.target)
        self._target_lock: asyncio.Lock | None = None
        self.view = View(None)
        self.latest: int | None = None
        self.state = "starting"
        self.reason = ""
        self.last_error: str | None = None
        self.last_sync: dict | None = None
        self.stop_token = stop_token or StopToken()  # given: the one the store's retries wait on too
        # chunks the (regional) store has not copied yet: rebuilt, or read from --fallback-store
        inflight = stalls.inflight if stalls else None
        fallback = (
            None
            if cfg.fallback is None
            else open_daemon_repo(cfg.fallback, metrics.on_retry, inflight, self.stop_token)
        )
        self.lazy = LazyReads(cfg.lazy_chunks, fallback)
        self.progress: DaemonProgress | None = None  # the sync under way (phase, bytes), for the status
        self.hooks = HookRunner(cfg.hook, metrics.hook_failures.inc, self._hook_changed) if cfg.hook else None
        self._hook_task: asyncio.Task | None = None  # the one hook call at a time (never two at the engine)
        self._hook_want: tuple[int | None, int, Path] | None = None  # (swap, version, folder) to fire next
        self._changed: asyncio.Event | None = None  # pulsed when the state moves (API waits on it)
        self._wake: asyncio.Event | None = None
        self.staleness = 0.0
        self._superseded: tuple[int | None, float] | None = None
        self._errors = 0
        self._last_ledger = 0.0
        self._ledger_written: tuple[bytes, ...] = ()  # the record this process last wrote, and those it tried to
        # write since (an answer lost after the write landed); another record there: a clash
        self.id_clash = False  # another subscriber writes the fleet record of this --id
        self._store_ok = False
        self._seed_failed: int | None = None  # the current version a standby copy failed for (not retried)
        self._seeded: str | None = None  # the standby slot holding that copy, until the next flip: never served
        self._seed_poll = 0.0  # when the copy next asks the store for its head
        self._lock: FolderLock | None = None  # the target folder and both slots: one writer, us
        self._served: Snapshot | None = None  # the current slot as swapped in, to notice a hand in it
        self._ledger_lock: asyncio.Lock | None = None
        self.engines = EngineCoordinator(
            metrics,
            timeout=cfg.engine_timeout,
            phase_timeout=cfg.engine_phase_timeout,
            backoff=cfg.backoff,
            on_release=self._wake_up,
            on_settled=lambda: self._write_ledger(force=True),
            refuse="this subscriber keeps partial slots (--include/--exclude); engine ranks prepare from whole ones"
            if cfg.partial
            else None,
        )
        self.refused: dict | None = None  # the version refused for its signature (--trusted-key), and why
        self.heads = HeadReader(repo, metrics.head_read, clock)  # conditional head reads; GET /v1/head's feed
        self.leader = (  # --head-from: wait on the leader's GET /v1/head between polls
            None
            if cfg.head_from is None
            else LeaderFeed(
                cfg.head_from,
                repo.url,
                cfg.poll_interval,
                own_id=cfg.identity.id,
                token=cfg.api.token,
                count=metrics.head_read,
                up=lambda ok: metrics.head_leader_up.set(int(ok)),
            )
        )
        self._idle = False  # the last iteration asks for the ordinary wait (a leader's news may end it)
        self.closing = False  # the API server is shutting down: held calls answer now (:meth:`close_waits`)
        self.head_reads = 0  # the loop's reads of the head so far (``PUT /v1/target?wait=`` waits for a new one)

    def claim(self) -> None:
        """Take the target folder and both slots for this process (FolderBusyError if another
        process writes them); released when :meth:`run` ends."""
        if self._lock is None:
            root = Path(self.cfg.target_dir)
            _check_target_root(root)  # before the claim makes the slots
            folders = [root] + [self.slots.path(n) for n in Slots.NAMES]
            self._lock = FolderLock(folders, f"weightsync subscriber ({self.cfg.identity.id})").acquire()

    # -- control (called by the API) --------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop after the current step (a pull in progress is cancelled at its next check)."""
        self.stop_token.set()
        self.state = "stopping"
        self.engines.close()
        self._wake_up()

    def close_waits(self) -> None:
        """Answer the API calls waiting for a state (``?wait=``) now: the server is shutting down, and
        waits for its requests before the daemon stops (a held call kept SIGTERM waiting)."""
        self.closing = True
        self._notify()

    def _wake_up(self) -> None:
        """Run the next iteration now (an API request, a slot the engine ranks no longer read)."""
        if self._wake is not None:
            self._wake.set()

    def serving(self) -> tuple[int, Path] | None:
        """The version ``current`` serves and its slot's folder (what engine ranks prepare from);
        None while nothing is served, or while a swap is under way."""
        if self.view.current is None or self._served is None:
            return None
        try:
            cur = self.slots.current()
        except UsageError:
            return None
        return None if cur is None else (self.view.current, self.slots.path(cur))

    def _initial_target(self) -> tuple[Target, str]:
        """The start-up target (:func:`startup_target`), logged with its source."""
        pin, stored = self.cfg.pin, None
        try:
            stored = read_target(self.cfg.target_dir, self.repo.url)
        except ForeignTargetError as exc:
            event(log, "ignoring a target stored for another store", logging.WARNING, error=exc)
        except UsageError as exc:
            if pin is None:
                raise
            event(log, "ignoring a damaged stored target: the command line pins a version", logging.WARNING, error=exc)
        target, source = startup_target(pin, stored)
        overrides = {} if pin is None or stored in (None, pin) else {"overrides_stored": stored}
        event(
            log,
            "target at start-up",
            target=target,
            source=source,
            **overrides,
            file=Path(self.cfg.target_dir) / STATE_DIR / "target.json",
        )
        return target, source

    async def set_target(self, target: Target) -> None:
        """Pin a version (it must exist) or follow ``"latest"``; the loop acts on it at once. The
        target is stored first (it survives restarts); if that fails nothing changes."""
        if target != LATEST:
            head = await asyncio.to_thread(self.heads.read)
            if head is None or int(target) > head:
                raise VersionError(f"version {target} does not exist in {self.repo.url} (head {head})")
            await asyncio.to_thread(self.repo.manifest, int(target))
        if self._target_lock is None:
            self._target_lock = asyncio.Lock()
        async with self._target_lock:  # the file and memory agree on the last call
            try:
                await asyncio.to_thread(write_target, self.cfg.target_dir, target, self.cfg.fsync, self.repo.url)
            except OSError as exc:
                raise WeightsyncError(
                    f"could not store the target in {target_path(self.cfg.target_dir)}: "
                    f"{exc.strerror or exc}; target unchanged"
                ) from None
            self.target, self.target_from = target, "api"
            self.metrics.target(target)
        event(log, "target set", target=target, stored=target_path(self.cfg.target_dir))
        if self.view.failed_version is not None:
            self.view = View(self.view.current, self.view.standby)  # a new target gets a fresh try
        self._notify()  # a call waiting on another target learns it was replaced
        if self._wake is not None:
            self._wake.set()

    @property
    def ready(self) -> bool:
        """Whether ``/readyz`` answers ready: a version is served."""
        return self.view.current is not None

    @property
    def degraded(self) -> bool:
        """Whether the swap hook of the version served failed (or was cut off, or is still retrying): the
        engine may serve older weights than ``current``. Lasts until a hook call succeeds, across restarts."""
        rec = None if self.hooks is None else self.hooks.record
        return rec is not None and rec.degraded

    def _serving(self) -> str:
        """The state of an idle subscriber that serves its target: ``serving``, or ``degraded``."""
        return "degraded" if self.degraded else "serving"

    def _notify(self) -> None:
        """Wake the API calls waiting for a state (:meth:`wait_until`)."""
        if self._changed is not None:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait_until(self, done, seconds: float) -> bool:
        """Wait up to ``seconds`` until ``done()`` is true (checked at every change of state); returns it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not done() and not self.closing:
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
        return True

    def hook_settled(self, version: int | None) -> bool:
        """No hook call is running or queued (none will come for ``version``), or there is no hook."""
        if self.hooks is None:
            return True
        busy = self._hook_want is not None or not (self._hook_task is None or self._hook_task.done())
        return not busy

    def hook_outcome(self, version: int) -> str | None:
        """How the hook call for ``version`` ended once settled: ``ok`` (or no hook), else why it failed;
        None while one is running or queued."""
        if not self.hook_settled(version):
            return None
        rec = None if self.hooks is None else self.hooks.record
        if rec is None or rec.version != version or rec.state == "ok":
            return "ok"  # no call for it in this target folder's record: nothing failed
        return f"version {version} is served, but its swap hook failed: {rec.error}"

    def target_outcome(self, target: Target, head: int | None = None, after: int | None = None) -> str | None:
        """For ``PUT /v1/target?wait=``: ``ok`` once ``target`` is served and its hook succeeded (or there
        is none); why not, once its sync or hook failed (the sync is retried); None while under way.
        Whether another call replaced the target is :meth:`target_replaced`'s answer. ``head``: the head
        the call read, which ``latest`` means, or a newer one the loop read after the call (its
        :attr:`head_reads` was ``after``) and serves."""
        desired = self.latest if target == LATEST else int(target)
        if target == LATEST and head is not None:  # the call's read: fresher than the loop's before the call
            cur = self.view.current
            moved_on = cur is not None and cur > head and cur == self.latest and self.head_reads > (after or 0)
            desired = cur if moved_on else head  # (newer since, as the loop read it after the call, and served)
        if desired is None:
            return None
        if self.view.failed_version == desired:
            return (
                f"the sync of version {desired} failed {self.view.failures} time(s) and is retried: {self.last_error}"
            )
        if self.view.current != desired:
            return None
        return self.hook_outcome(desired)

    def target_replaced(self, target: Target) -> str | None:
        """Why a ``PUT /v1/target?wait=`` for ``target`` stops waiting without an outcome: another call
        set another target before this one was served (None while ``target`` is still the target)."""
        if self.target == target:
            return None
        wanted = "the head" if target == LATEST else f"version {target}"
        return f"the target was set to {self.target} by another call before {wanted} was served"

    def rerun_hook(self) -> int:
        """``POST /v1/hook``: call the swap hook again for the version served (after the call in
        flight, if any); returns that version. UsageError without a hook, VersionError while nothing is served."""
        if self.hooks is None:
            raise UsageError("this subscriber has no swap hook (--hook-url, --hook-command, --hook-preset)")
        served = self.serving()
        if served is None:
            raise VersionError("no version is served yet: there is nothing to tell the engine")
        version, folder = served
        event(log, "swap hook requested through the API", version=version)
        self._request_hook(version, folder, self.release.swaps)
        return version

    def status(self) -> dict:
        """The ``GET /v1/status`` document."""
        lag = None if self.latest is None or self.view.current is None else self.latest - self.view.current
        reason = self.reason
        if self.state == "degraded" and (rec := self.hooks.record) is not None:
            what = "is being retried" if rec.state == "retrying" else f"did not succeed ({rec.state})"
            reason += f"; the swap hook of version {rec.version} {what}: {rec.error}; POST /v1/hook calls it again"
        state, reason, stalled = stall_view(self.stalls, self.state, reason)
        return {
            "role": "subscriber",
            "id": self.cfg.identity.id,
            "region": self.cfg.identity.region,
            "cluster": self.cfg.identity.cluster,
            "store": self.repo.url,
            "target_dir": str(self.cfg.target_dir),
            "current_version": self.view.current,
            "standby_version": self.view.standby,
            "latest_version": self.latest,
            "target": self.target,
            "target_from": self.target_from,  # command line, stored, default (the head) or api
            "state": state,
            "reason": reason,
            "stalled": stalled,
            "lag": lag,
            "staleness_seconds": self.staleness,
            "partial": {"include": list(self.cfg.include), "exclude": list(self.cfg.exclude)}
            if self.cfg.partial
            else None,
            "progress": None if self.progress is None else self.progress.doc(),
            "last_sync": self.last_sync,
            "last_error": self.last_error,
            "hook": None if self.hooks is None or self.hooks.record is None else self.hooks.record.to_doc(),
            "engines": self.engines.status(),
            "trusted_keys": None if self.repo.trusted_keys is None else list(self.repo.trusted_keys.ids),
            "refused": self.refused,
            "id_clash": self.id_clash,
            "head_from": None if self.leader is None else self.leader.status(),
        }

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """The daemon's loop: claim the folders, then read the head, plan, sync and swap, until stopped."""
        self._wake = asyncio.Event()
        self.heads.attach(asyncio.get_running_loop())
        warm_codec()
        engines = heartbeat = refresh = None
        if self.stalls is not None:
            self.stalls.start()
        try:
            await asyncio.to_thread(self.claim)
            await asyncio.to_thread(self._startup)
            self._resume_hook()
            engines = asyncio.create_task(self.engines.run(self.serving), name="engines")
            heartbeat = asyncio.create_task(self._heartbeat(), name="fleet-heartbeat")
            if self.leader is None and self.cfg.api.port is not None:  # followers may wait on this one
                refresh = asyncio.create_task(self._refresh_head(), name="head-refresh")
            while not self.stop_token.is_set:
                await self._pause(await self._iteration())
        finally:
            self.engines.close()
            self.heads.close()
            if self.leader is not None:
                await self.leader.close()
            for task in (engines, heartbeat, refresh):
                if task is not None:
                    task.cancel()
                    with suppress(asyncio.CancelledError):
                        await task
            if self._hook_task is not None and not self._hook_task.done():
                self._hook_task.cancel()  # its record stays "running": the next start calls it again
            self.state = STOPPED  # the last record: the fleet view leaves it out (a pod gone in a rollout)
            await self._write_ledger(force=True)
            if self.stalls is not None:
                self.stalls.stop()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _rebase_slot(self, folder: Path) -> None:
        """A slot filled from another store holds nothing of this one (its version numbers are that
        store's), unless its files are exactly this store's version of the same number (a mirror of
        the same run, after a failover): then it is recorded as this store's, and nothing is fetched
        again."""
        if self.cfg.partial:
            return
        try:
            state = read_state(folder)
            if state is None or same_store(state.store, self.repo.url):
                return
            head = self.repo.head_version()
            if head is None or state.version > head:  # not committed there (a review found one adopted)
                return
            manifest = self.repo.manifest(state.version)
        except WeightsyncError:  # damaged, not in this store, refused or unreachable: it holds nothing of it
            return
        if _same_files(state, manifest):
            hook = read_hook_record(self.cfg.target_dir, state.store)
            rebase_state(folder, self.repo.url, self.cfg.fsync)
            if hook is not None and hook.version == state.version:  # its hook's outcome too (a failed one is retried)
                write_hook_record(self.cfg.target_dir, self.repo.url, hook, self.cfg.fsync)
            event(
                log, "a slot filled from another store holds this store's version", folder=folder, version=state.version
            )

    def _startup(self) -> None:
        self.cfg.target_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.cfg.target_dir.glob(".current-*"):  # a flip killed before its rename
            stale.unlink(missing_ok=True)
        for stale in target_path(self.cfg.target_dir).parent.glob(".tmp-*"):  # a target write killed likewise
            stale.unlink(missing_ok=True)
        for name in Slots.NAMES:
            self.slots.path(name).mkdir(parents=True, exist_ok=True)
            self._rebase_slot(self.slots.path(name))
        cur = self.slots.current()
        current = None if cur is None else slot_version(self.slots.path(cur), self.cfg.partial, self.repo.url)
        standby = slot_version(self.slots.path(self.slots.standby()), self.cfg.partial, self.repo.url)
        self.view = View(current, standby)
        if current is not None:
            self._served = snapshot(self.slots.path(cur))
            self._check_served(installed=True)  # changed while no subscriber watched
        self.metrics.current_version.set(-1 if current is None else current)
        if self.hooks is not None:
            self.hooks.record = read_hook_record(self.cfg.target_dir, self.repo.url)
            self.metrics.hook_degraded.set(int(self.degraded))
        if current is not None and self.repo.trusted_keys is not None:
            try:  # installed before the keys were given: still served (nothing better), but reported
                self.repo.manifest(current)
            except SignatureError as exc:
                self._refuse(exc)
            except WeightsyncError:
                pass  # collected, or the store unreachable: the loop reports what matters
        event(
            log,
            "started",
            target_dir=self.cfg.target_dir,
            current=current,
            standby=standby,
            target=self.target,
            target_from=self.target_from,
            partial=self.cfg.partial,
        )

    async def _pause(self, delay: float) -> None:
        """The wait between iterations: ``delay`` seconds, or with ``--head-from`` after the ordinary
        iteration until the leader has news (:class:`LeaderFeed`); an API request or a stop ends it."""
        if self.leader is None or not self._idle:  # a retry, a back-off, an interrupted copy: as timed
            await sleep_or_wake(self._wake, delay, self.stop_token)
            return
        self._wake.clear()
        if not self.stop_token.is_set:
            await self.leader.wait(self._wake)

    async def _refresh_head(self) -> None:
        """Read the head every poll interval while the loop syncs (a long sync reads none), so that
        followers waiting on this subscriber's ``GET /v1/head`` hear of a newer head meanwhile."""
        while True:
            await asyncio.sleep(self.cfg.poll_interval)
            stale = time.monotonic() - self.heads.read_mono >= self.cfg.poll_interval
            if stale and self.state in ("syncing", "swapping"):
                with suppress(WeightsyncError):  # the loop reports store errors
                    await asyncio.to_thread(self.heads.read)

    async def _iteration(self) -> float:
        """One poll: plan, act, update gauges. Returns the seconds to wait before the next one."""
        self._idle = False
        try:
            if self._lock is not None:
                await asyncio.to_thread(self._lock.check)  # a slot removed by hand: its lock is taken again
            if self._served is not None:
                await asyncio.to_thread(self._check_served)
            head = await asyncio.to_thread(self.heads.read)  # one conditional request: a 304 while unchanged
            if head is not None and self.latest is not None and head < self.latest:
                event(
                    log,
                    "the store's head went back (rewritten, or restored)",
                    logging.WARNING,
                    before=self.latest,
                    head=head,
                )
            self.latest = head
            self.head_reads += 1
            if self.refused is not None and (head is None or head < self.refused["version"]):
                self._refuse(None)  # the refused version is gone from the store
            self.metrics.latest_version.set(-1 if head is None else head)
            action = plan_next(self.view, head, self.target, self.clock())
            if isinstance(action, Sync) and (held := self.engines.holding(self.slots.path(self.slots.standby()))):
                action = Wait(
                    f"engine ranks of replica {', '.join(held)} are preparing from the standby slot; "
                    f"version {action.version} is synced into it once they are done"
                )
            self.reason = action.reason
            interrupted = False
            if isinstance(action, Sync):
                interrupted = not await self._sync(action.version)  # not swapped: plan again at once
            else:
                self.state = self._serving() if isinstance(action, Idle) and self.ready else "waiting"
                if isinstance(action, Idle):
                    interrupted = await self._seed_standby()
            await self._update_lag()
            await self._write_ledger()
            self._errors = 0
            if isinstance(action, Idle):
                self.last_error = None
            delay = 0.0 if interrupted else self._next_delay()  # an interrupted copy: at once to what interrupted it
            self._idle = delay >= self.cfg.poll_interval
            return delay
        except Stopped:
            return 0.0
        except Exception as exc:  # logged, counted, backed off; the loop goes on
            return iteration_failed(self, exc, log)
        finally:
            self._notify()

    def _next_delay(self) -> float:
        delay = self.cfg.poll_interval
        if self.view.failed_version is not None:
            delay = min(delay, max(0.0, self.view.retry_at - self.clock()))
        return delay

    def _wanted(self, version: int) -> bool:
        """Whether the target still asks for ``version`` once it is synced: a pin to it, or ``latest``
        and the head, or newer than the version served (the head may have moved on meanwhile: still a
        step forward)."""
        if self.target != LATEST:
            return int(self.target) == version
        return self.view.current is None or version > self.view.current or version == self.latest

    async def _sync(self, version: int) -> bool:
        """Fill the standby slot with ``version``, verify it and swap it in; False if it is not swapped
        because the target moved away from it meanwhile (the slot keeps it)."""
        self.state = "syncing"
        standby = self.slots.standby()
        folder = self.slots.path(standby)
        self.progress = DaemonProgress(self.stop_token, self.metrics.download_bytes.inc, version, self.clock)
        try:
            result = await asyncio.to_thread(self._fill, folder, version)
            # what no transfer reported (a file store's chunks are read in place): counted as before
            self.metrics.download_bytes.inc(max(0, result.fetched_bytes - self.progress.moved))
        except Stopped:
            raise
        except Exception as exc:
            if isinstance(exc, ChecksumError):
                self.metrics.checksum_failures.inc()
            if isinstance(exc, SignatureError):
                self._refuse(exc)
            failures = self.view.failures + 1 if self.view.failed_version == version else 1
            retry_at = self.clock() + self.cfg.backoff.delay(failures)
            self.view = View(self.view.current, None, version, failures, retry_at)
            raise
        finally:
            self.progress = None
        if self.stop_token.is_set:
            self.view = View(self.view.current, version)
            raise Stopped("stopping before the swap; the standby slot keeps the new version")
        if not self._wanted(version):  # a pin or rollback while it synced: never swap away from it
            self.view = View(self.view.current, version)
            self.state = self._serving() if self.ready else "waiting"
            event(log, "not swapped: the target moved while the version synced", version=version, target=self.target)
            return False
        self.state = "swapping"
        t0 = time.perf_counter()
        self._seeded = None  # before the flip: a flip that fails late may already have switched `current`
        self._served = None
        await asyncio.to_thread(self.slots.flip, standby)
        pause = time.perf_counter() - t0
        self._served = result.served
        swap = self.release.swapped()
        served_before = self.view.current
        self.view = View(version, served_before)
        self.state = self._serving()  # before the record is written: it says what is served now
        self._after_swap(result, folder, pause, swap, served_before)
        self.engines.kick()
        if self.refused is not None and version >= self.refused["version"]:
            self._refuse(None)
        await self._write_ledger(force=True)
        return True

    def _refuse(self, exc: SignatureError | None) -> None:
        """Report a version refused for its signature in ``/v1/status`` and the metrics, logged once
        per version; None: the refusal is over (a version at or past it was swapped in, or it is gone)."""
        if exc is None:
            self.refused = None
            self.metrics.refused(None)
            return
        if self.refused is None or self.refused["version"] != exc.version:
            event(log, "refused a version: not signed by a trusted key", logging.ERROR, version=exc.version, error=exc)
        self.refused = {"version": exc.version, "reason": exc.reason, "time": self.clock()}
        self.metrics.refused(exc.version)

    def _fill(self, folder: Path, version: int) -> SyncResult:
        """Bring a slot to ``version`` and verify it (runs in a worker thread)."""
        try:
            return self._fill_slot(folder, version)
        finally:
            self._rebase_served()

    def _rebase_served(self) -> None:
        """Take in the ctimes a fill moved in the served slot (linking its files into the standby,
        or replacing such links there, changes their link count), and nothing else: a served slot
        that changed otherwise still differs from its snapshot, for :meth:`_check_served`."""
        cur = self.slots.current()
        if cur is None or self._served is None:
            return
        now = snapshot(self.slots.path(cur))
        if {p: e[:4] for p, e in now.items()} == {p: e[:4] for p, e in self._served.items()}:
            self._served = now  # a link made and dropped again moves the ctime, not the link count

    def _fill_slot(self, folder: Path, version: int) -> SyncResult:
        self.repo.manifest(version)  # with --trusted-key, a version refused for its signature touches no slot
        self._clear_other_mode(folder)
        base = None
        cfg = PullConfig(
            fetch_concurrency=self.cfg.fetch_concurrency,
            decode_threads=self.cfg.decode_threads,
            fsync=self.cfg.fsync,
            lazy=self.lazy,
        )
        observer = self.progress or self.stop_token
        if self.cfg.partial:
            r = materialize(self.repo, folder, version, self.selection, config=cfg, observer=observer, lock=self._lock)
            raw = sum(f["size"] for f in read_partial_state(folder).files.values())
            fetch_s, build_s = r.seconds.get("fetch", 0.0), r.seconds.get("build", 0.0)
        else:
            self._clear_unclaimed(folder)
            base = self._refill_base(version)
            if base is None:
                self._seed_from_current(folder, version)
            r = pull(self.repo, folder, version, config=cfg, observer=observer, base_dir=base, lock=self._lock)
            raw = self.repo.manifest(version).raw_bytes
            fetch_s, build_s = r.seconds.get("fetch", 0.0), r.seconds.get("build", 0.0)
            if self.cfg.verify_before_swap:
                try:
                    verify_folder(folder, self.repo.manifest(version))
                except ChecksumError:
                    disown(folder)  # its state would keep the wrong bytes at the next try: rebuilt instead
                    raise
        served = snapshot(folder)
        if (why := installed_change(folder, _recorded(folder, self.cfg.partial), served)) is not None:
            raise UsageError(f"{folder} changed while it was being filled ({why}); not swapping to it")
        return SyncResult(r.version, r.from_version, r.fetched_bytes, raw, fetch_s, build_s, base is not None, served)

    def _check_served(self, installed: bool = False) -> None:
        """Notice the served slot changed behind our back (a hand, another tool): it then claims no
        version, the daemon is not ready, and the loop syncs a fresh copy into the standby and
        swaps to it (worker thread). Each poll compares one lstat per file with the snapshot taken
        at the swap; ``installed`` (at start-up) compares with the slot's recorded state instead."""
        if self._served is None:
            return
        cur = self.slots.current()
        if cur is None:  # the link itself was removed (or the whole folder): nothing is served
            folder, why = self.slots.link, "the current link is gone"
        else:
            folder = self.slots.path(cur)
            now = snapshot(folder)
            if installed:
                why = installed_change(folder, _recorded(folder, self.cfg.partial), now)
            else:
                why = snapshot_change(self._served, now)
            if why is None:
                self._served = now  # link counts (and their ctimes) move with others' hard links
                return
        event(
            log,
            "the served slot changed behind weightsync's back; it no longer claims a version, "
            "a fresh copy is synced and swapped in",
            logging.ERROR,
            folder=folder,
            version=self.view.current,
            change=why,
        )
        self.metrics.checksum_failures.inc()
        self.last_error = f"the served slot {folder} changed behind weightsync's back ({why})"
        if cur is not None:
            disown(folder)
        self._served = None
        self.view = View(None, self.view.standby)
        self.metrics.current_version.set(-1)

    def _refill_base(self, version: int) -> Path | None:
        """The current slot, to refill the standby in place from, when moving forward and the
        standby is released (:class:`weightsync.service.slots.StandbyRelease`); else None."""
        cur = self.slots.current()
        current = None if cur is None else slot_version(self.slots.path(cur), False, self.repo.url)
        never_served = self._seeded == self.slots.standby()  # a copy made while idle: nothing reads it
        if current is None or version <= current or not (never_served or self.release.free()):
            return None
        return self.slots.path(cur)

    def _clear_unclaimed(self, folder: Path) -> None:
        """Empty a standby that claims no version and is no interrupted refill (a clone killed
        midway; never served), keeping ``.weightsync`` (its spool of verified chunks)."""
        if slot_version(folder, False, self.repo.url) is None and not (folder / STATE_DIR / REFILL).exists():
            empty_folder(folder)

    def _seed_from_current(self, folder: Path, version: int) -> None:
        """Moving forward, start the standby from the current version (hard links, no download):
        one delta to apply instead of two, and no full download after a fresh start."""
        cur = self.slots.current()
        current = None if cur is None else slot_version(self.slots.path(cur), False, self.repo.url)
        if current is None or version <= current or slot_version(folder, False, self.repo.url) == current:
            return
        event(log, "seeding the standby slot from the current version", folder=folder, version=current)
        clone(self.slots.path(cur), folder)

    async def _seed_standby(self) -> bool:
        """While idle, give an empty standby slot a copy of the current version, so that the next
        delta refills it in place instead of creating every file (what the first delta after a
        start paid). Skipped where no refill would follow (partial mode, ``--standby-hold never``),
        where the standby holds or is refilling something, and after a failed copy of this version
        (its remains are removed: a full disk is not filled twice). Returns True when the copy gave
        way to other work (:meth:`_seed_check`); it is redone when idle again."""
        cur, current = self.slots.current(), self.view.current
        if (
            self.cfg.partial
            or self.release.hold is None
            or cur is None
            or current is None
            or self.view.standby is not None
        ):
            return False
        folder = self.slots.path(self.slots.standby())
        if (
            self.engines.holding(folder)
            or self._seed_failed == current
            or (folder / STATE_DIR / REFILL).exists()
            or slot_version(folder, False, self.repo.url) is not None
        ):
            return False
        t0, self._seed_poll = time.perf_counter(), time.monotonic() + self.cfg.poll_interval
        try:
            await asyncio.to_thread(clone, self.slots.path(cur), folder, True, self.cfg.fsync, self._seed_check)
        except _SeedInterrupted as exc:  # the loop has other work: the copy is redone when idle again
            await asyncio.to_thread(_drop_copy, folder)
            event(
                log, f"stopped copying the current version into the standby slot: {exc}", folder=folder, version=current
            )
            return True
        except OSError as exc:
            self._seed_failed = current
            await asyncio.to_thread(_drop_copy, folder)
            event(
                log,
                "could not copy the current version into the standby slot; the next delta creates its files",
                level=logging.WARNING,
                folder=folder,
                version=current,
                error=exc,
            )
            return False
        await asyncio.to_thread(self._check_served)  # a served file rewritten while copied: not the version
        if self.view.current != current:
            await asyncio.to_thread(_drop_copy, folder)
            return False
        self.view, self._seeded = replace(self.view, standby=current), self.slots.standby()
        event(
            log,
            "seeded the standby slot with a copy of the current version",
            folder=folder,
            version=current,
            seconds=f"{time.perf_counter() - t0:.3f}",
        )
        return False

    def _seed_check(self) -> None:
        """Called between 64 MiB pieces of the standby copy (worker thread): a stop, an API request
        (the wake event) or a new head (polled every poll interval) ends the copy, so it never
        holds up a sync."""
        self.stop_token.check()
        if self._wake is not None and self._wake.is_set():
            raise _SeedInterrupted("a request came in")
        if time.monotonic() >= self._seed_poll:
            self._seed_poll = time.monotonic() + self.cfg.poll_interval
            try:
                head = self.heads.read()
            except WeightsyncError:
                return  # the loop reports store errors; the copy goes on
            if head != self.latest:
                raise _SeedInterrupted(f"version {head} was published")

    def _clear_other_mode(self, folder: Path) -> None:
        partial_state = (folder / STATE_DIR / PARTIAL_STATE).exists()
        full_state = (folder / STATE_DIR / "state.json").exists() or (folder / STATE_DIR / REFILL).exists()
        if (self.cfg.partial and full_state and not partial_state) or (not self.cfg.partial and partial_state):
            event(log, "clearing a slot filled in the other mode", folder=folder)
            clear_folder(folder)

    def _after_swap(self, r: SyncResult, folder: Path, pause: float, swap: int, served_before: int | None) -> None:
        """Metrics, ``last_sync``, the log line and the hook of a swap to ``r.version`` from
        ``served_before`` (the version served until now; ``r.from_version`` is what the slot held)."""
        m = self.metrics
        m.current_version.set(r.version)
        m.download_seconds.observe(r.fetch_seconds)
        m.apply_seconds.observe(r.build_seconds)
        m.swap_pause.observe(pause)
        m.swaps.inc()
        self.last_sync = {
            "version": r.version,
            "from_version": served_before,  # the version served before the swap
            "base_version": r.from_version,  # what the standby slot held, the sync's base (None: empty)
            "fetched_bytes": r.fetched_bytes,
            "raw_bytes": r.raw_bytes,
            "fetch_seconds": round(r.fetch_seconds, 6),
            "build_seconds": round(r.build_seconds, 6),
            "swap_seconds": round(pause, 6),
            "in_place": r.in_place,
            "time": self.clock(),
        }
        ratio = f"{r.raw_bytes / r.fetched_bytes:.1f}x" if r.fetched_bytes else "-"
        event(
            log,
            f"swapped to version {r.version}",
            version=r.version,
            from_version=served_before,
            base_version=r.from_version,
            slot=folder.name,
            fetched=human_bytes(r.fetched_bytes),
            size=human_bytes(r.raw_bytes),
            ratio=ratio,
            fetch_s=f"{r.fetch_seconds:.3f}",
            build_s=f"{r.build_seconds:.3f}",
            in_place=r.in_place,
            swap_ms=f"{1000 * pause:.2f}",
        )
        if self.hooks is not None:
            self._request_hook(r.version, folder, swap)

    def _resume_hook(self) -> None:
        """At start-up: call the hook again when its last call, recorded in the target folder, did not
        succeed for the version served (it failed, or the process stopped during it or before it)."""
        rec = None if self.hooks is None else self.hooks.record
        served = self.serving()
        if rec is None or served is None or (rec.version == served[0] and rec.state == "ok"):
            return
        event(
            log,
            f"calling the swap hook again: its last call did not succeed for version {served[0]}",
            logging.WARNING,
            version=served[0],
            last_version=rec.version,
            last_state=rec.state,
        )
        self._request_hook(served[0], served[1], None)

    def _request_hook(self, version: int, folder: Path, swap: int | None) -> None:
        """Fire the hook for ``version`` (the slot ``folder``) once the call in flight, if any, has ended:
        calls never overlap, and a newer request replaces a queued one (the engine loads the newest)."""
        self._hook_want = (swap, version, folder)
        if self._hook_task is None or self._hook_task.done():
            self._hook_task = asyncio.create_task(self._hook_calls(), name="swap-hook")

    async def _hook_calls(self) -> None:
        """Run the queued hook calls one after the other. A success releases the standby slot for the
        swap it was fired for (:class:`~weightsync.service.slots.StandbyRelease`)."""
        while self._hook_want is not None:
            swap, version, folder = self._hook_want
            self._hook_want = None
            outcome = await self.hooks.fire(
                version, str(folder), str(self.slots.link), superseded=lambda: self._hook_want is not None
            )
            if outcome.ok and swap is not None:
                self.release.confirm(swap)
        self._notify()

    async def _hook_changed(self, rec: HookRecord) -> None:
        """A hook call moved (:class:`HookRunner`): the gauge, the state, the record in the target folder."""
        self.metrics.hook_degraded.set(int(rec.degraded))
        if self.state in ("serving", "degraded"):
            self.state = self._serving()
        try:
            await asyncio.to_thread(write_hook_record, self.cfg.target_dir, self.repo.url, rec, self.cfg.fsync)
        except OSError as exc:
            event(log, "could not record the swap hook's state", logging.WARNING, error=exc)
        self._notify()

    async def _update_lag(self) -> None:
        cur, head, m = self.view.current, self.latest, self.metrics
        if head is None or cur is None:
            m.version_lag.set(0 if head is None else head + 1)
            return
        m.version_lag.set(max(0, head - cur))
        if cur >= head:
            self.staleness = 0.0
        else:
            if self._superseded is None or self._superseded[0] != cur:
                since = await asyncio.to_thread(superseded_at, self.repo, cur)
                self._superseded = None if since is None else (cur, since)
            if self._superseded is not None:
                self.staleness = max(0.0, self.clock() - self._superseded[1])
        m.staleness.set(self.staleness)

    async def _heartbeat(self) -> None:
        """Rewrite the fleet record every ``--ledger-interval`` seconds, also while a sync runs for an
        hour: a record that stops being rewritten is a gone subscriber's (the fleet view expires it)."""
        while True:
            await asyncio.sleep(self.cfg.ledger_interval)
            await self._write_ledger()

    async def _write_ledger(self, force: bool = False) -> None:
        if self._ledger_lock is None:
            self._ledger_lock = asyncio.Lock()
        async with self._ledger_lock:  # the loop and the engine coordinator both write: one at a time, latest last
            await self._write_ledger_now(force)

    async def _write_ledger_now(self, force: bool) -> None:
        now = self.clock()
        if not force and now - self._last_ledger < self.cfg.ledger_interval:
            return
        ident = self.cfg.identity
        engines = tuple(self.engines.records())
        rec = FleetRecord(
            ident.id, ident.region, ident.cluster, self.view.current, self.target, self.state, now, engines
        )
        try:
            # never write into a location that is not (yet) a weightsync store: the record would
            # make it "hold other objects" and a publisher would refuse to create the store there
            self._store_ok = self._store_ok or await asyncio.to_thread(self.repo.check)
            if not self._store_ok:
                return
            await asyncio.to_thread(self._check_own_record, ident.id)
            doc = rec.to_json()
            landed, tried = self._ledger_written[:1], self._ledger_written[1:]
            self._ledger_written = (*landed, *tried[-7:], doc)  # a write whose answer is lost may land
            await asyncio.to_thread(write_record, self.repo.store, rec)
            self._ledger_written, self._last_ledger = (doc,), now
        except WeightsyncError as exc:
            event(log, "could not write the fleet ledger", logging.WARNING, error=str(exc))

    def _check_own_record(self, sub_id: str) -> None:
        """(in a thread) Before a ledger write: the record in the store is the one this process wrote
        last, or another process writes it too (two subscribers given one ``--id``: the fleet shows one
        of them, flapping). Logged (ERROR) once per clash, and in the status (``id_clash``)."""
        if not self._ledger_written:
            return  # the first write: what is there is a former run's
        try:
            stored = self.repo.store.get(record_key(sub_id))
        except NotFoundError:
            stored = None  # removed (by hand, or an expired record's clean-up): not a clash
        except WeightsyncError:
            return  # unread: the write goes on (the check is a diagnostic), the clash as it was
        clash = stored is not None and stored not in self._ledger_written
        if clash and not self.id_clash:
            event(
                log,
                f"another subscriber writes the fleet record of id {sub_id!r}: give each subscriber its own --id",
                logging.ERROR,
                id=sub_id,
            )
        self.id_clash = clash


def _same_files(state, manifest: Manifest) -> bool:
    """Whether a folder's recorded files are exactly ``manifest``'s (paths, sizes, digests)."""
    return {p: tuple(r[:2]) for p, r in state.files.items()} == {f.path: (f.size, f.xxh3) for f in manifest.files}


def _check_target_root(root: Path) -> None:
    """Refuse a target folder that is another kind of weightsync folder (a pull's, a publish cache:
    it holds a version of its own), or that a subscriber never had and holds other files (a
    checkpoint: its slots and ``current`` would become part of it, and of what is published from it)."""
    if not root.is_dir():
        return
    if claims_version(root):
        raise UsageError(
            f"{root} holds a version of its own (a pull's folder, or a publish cache), not a subscriber's slots; "
            "give the subscriber another --target"
        )
    ours = {"slots", "current", "lost+found"}  # (a fresh file system's root has lost+found)
    foreign = sorted(p.name for p in root.iterdir() if p.name not in ours and not p.name.startswith("."))
    if foreign and not (root / "slots").is_dir():
        raise UsageError(
            f"{root} is not empty ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}) and no subscriber's "
            "target; give an empty or new folder"
        )


def _recorded(folder: Path, partial: bool) -> Recorded:
    """The files of the version ``folder`` claims, as its local state records them."""
    if partial:
        state = read_partial_state(folder)
        return (
            {}
            if state is None
            else {p: (r["size"], r["xxh3"], r.get("mtime_ns"), r.get("ctime_ns")) for p, r in state.files.items()}
        )
    state = read_state(folder)
    return {} if state is None else dict(state.files.items())
