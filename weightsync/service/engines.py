"""Engine ranks on a node: every process of an inference engine (one per GPU rank) takes each version
from its node's subscriber, and the ranks of a replica switch together (docs/ENGINES.md, "The node
path"). The subscriber's side is :class:`EngineCoordinator`: ranks register, long-poll for
instructions and report back over the subscriber's HTTP API; per replica one transaction at a time
brings every rank to the version ``current`` serves, in two phases: *prepare* on every rank (from the
current slot's folder, which the subscriber does not write meanwhile), then *apply* on every rank,
or *abort* on all as soon as one prepare fails, times out or loses its rank. Each iteration of its
loop asks the pure :func:`plan_replica` what a replica needs. :class:`EngineClient` is the ranks'
side of the wire (stdlib only: engines bring their own event loops, or none)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from weightsync.errors import UsageError, WeightsyncError
from weightsync.service.runtime import Idle, Wait, event
from weightsync.sync.fleet import EngineRecord

log = logging.getLogger("weightsync.engines")

MAX_WORLD = 1 << 16  # ranks of one replica
MAX_WAIT = 30.0  # seconds one long poll may be held open
PHASES = ("prepare", "apply")  # of a transaction; an abort ends the first


class UnknownEngineError(WeightsyncError):
    """A request names an engine registration the subscriber does not hold (never made, dropped, or
    made before the subscriber restarted): the rank registers again."""


class EngineConflictError(WeightsyncError):
    """A registration that contradicts the replica's live ranks (another world size), or itself (a
    rank outside its world)."""


# --- planning (pure) -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaView:
    """What the planner knows about one replica."""

    world: int
    versions: dict[int, int | None]  # rank -> the version it says it holds, for every registered rank
    busy: str | None = None  # a transaction in flight, described
    failed_version: int | None = None  # the last version a transaction of this replica failed for ...
    failures: int = 0  # ... how many times in a row ...
    retry_at: float = 0.0  # ... and when it may be tried again


@dataclass(frozen=True)
class Start:
    """The plan's answer "run a transaction to ``version`` on every rank", and why."""

    version: int
    reason: str


def plan_replica(view: ReplicaView, serving: int | None, now: float) -> Idle | Wait | Start:
    """What a replica needs, given the version the subscriber serves (None: none yet)."""
    if view.busy is not None:
        return Wait(view.busy)
    missing = sorted(set(range(view.world)) - set(view.versions))
    if missing:
        return Wait(
            f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {view.world} not registered: "
            "a replica switches only with all its ranks"
        )
    if serving is None:
        return Wait("the subscriber serves no version yet")
    held = set(view.versions.values())
    if held == {serving}:
        return Idle(f"every rank holds version {serving}")
    if view.failed_version == serving and now < view.retry_at:
        return Wait(f"version {serving} failed {view.failures} time(s); retrying in {view.retry_at - now:.1f}s")
    shown = ", ".join("?" if v is None else str(v) for v in sorted(held, key=lambda v: -1 if v is None else v))
    return Start(serving, f"ranks hold {shown}, the subscriber serves {serving}")


# --- the coordinator's state ---------------------------------------------------------------------
@dataclass(eq=False)
class _Rank:
    replica: str
    rank: int
    world: int
    instance: str
    version: int | None
    pid: int | None
    seen: float  # the coordinator's clock at its last request
    registered: float  # unix seconds
    epoch: int | None = None  # the rank's count of changes to what it holds, with ``version``
    seq: int = 0  # number of the last instruction given
    instruction: dict | None = None  # the last instruction, repeated until the rank polls past it
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # its last failed prepare or apply


@dataclass(eq=False)
class _Txn:
    id: int
    version: int
    folder: Path
    members: dict[int, str]  # rank -> instance
    started: float
    deadline: float
    phase: str = "prepare"
    prepared: set[int] = field(default_factory=set)
    applied: dict[int, bool] = field(default_factory=dict)


@dataclass(eq=False)
class _Replica:
    id: str
    world: int
    ranks: dict[int, _Rank] = field(default_factory=dict)
    txn: _Txn | None = None
    failed_version: int | None = None
    failures: int = 0
    retry_at: float = 0.0
    state: str = "waiting"  # in step, switching or waiting
    reason: str = ""
    last: dict | None = None  # how the last transaction ended
    dropped: dict[int, str] = field(default_factory=dict)  # rank -> why it left, until it registers again


class EngineCoordinator:
    """The engine ranks registered with one subscriber, and the transactions that move them.

    Every method runs on the subscriber's event loop. ``timeout``: seconds without a request after
    which a rank is dropped (its long polls are held at most a third of it). ``phase_timeout``:
    seconds each phase of a transaction may take. ``backoff``: the wait before a replica retries a
    version whose transaction failed (:class:`weightsync.service.config.Backoff`). ``on_release()``
    is called when a transaction stops reading its folder, ``on_settled()`` (a coroutine) when what
    the ranks hold may have changed (for the fleet ledger). ``metrics``: the subscriber's
    :class:`~weightsync.service.metrics.Metrics`. ``refuse``: why every registration is refused
    (partial slots, which hold the selected tensors at other offsets than the version's files).
    """

    def __init__(
        self,
        metrics,
        *,
        timeout: float,
        phase_timeout: float,
        backoff,
        on_release: Callable[[], None] = lambda: None,
        on_settled: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        refuse: str | None = None,
    ):
        self.metrics, self.timeout, self.phase_timeout, self.backoff = metrics, timeout, phase_timeout, backoff
        self.refuse = refuse  # why this subscriber takes no engine ranks (None: it does)
        self.on_release, self.on_settled, self.clock = on_release, on_settled, clock
        self.max_wait = min(MAX_WAIT, timeout / 3)
        self._replicas: dict[str, _Replica] = {}
        self._ranks: dict[str, _Rank] = {}  # instance -> rank
        self._txns = 0
        self._kick = asyncio.Event()
        self._closed = False
        self._settled = False
        self._tasks: set[asyncio.Task] = set()

    # -- what the ranks call (through the API) ------------------------------------------------------
    def register(
        self,
        replica: str,
        rank: int,
        world: int,
        version: int | None,
        pid: int | None = None,
        epoch: int | None = None,
    ) -> dict:
        """Register rank ``rank`` of ``world`` of ``replica``, holding ``version``; a registration of
        the same rank before it is dropped. Returns the instance id the rank names in later calls,
        and the seconds of its long polls and of the silence after which it is dropped.

        ``epoch`` (here, in polls and in reports): a count the rank raises whenever what it holds
        changes, sent with ``version``; a version sent with a lower epoch than one already seen is
        stale (a poll that left before an apply and arrived after its report) and ignored."""
        if not 1 <= world <= MAX_WORLD or rank < 0:
            raise UsageError(f"world must be in 1..{MAX_WORLD} and rank at least 0, got rank {rank} of {world}")
        if self.refuse is not None:
            raise EngineConflictError(self.refuse)
        if rank >= world:  # each field is valid alone (the API's schema), together they contradict
            raise EngineConflictError(f"rank {rank} is outside a world of {world} ranks (0..{world - 1})")
        rep = self._replicas.get(replica)
        if rep is not None and rep.world != world and any(k != rank for k in rep.ranks):
            raise EngineConflictError(
                f"replica {replica} has world size {rep.world} (ranks {sorted(rep.ranks)} registered), not {world}"
            )
        if rep is not None and rank in rep.ranks:
            self._lose(rep, rep.ranks[rank], "registered again (its process restarted?)", logging.WARNING)
        rep = self._replicas.get(replica)  # gone with its last rank
        if rep is None or rep.world != world:
            rep = self._replicas[replica] = _Replica(replica, world)
        r = _Rank(replica, rank, world, uuid.uuid4().hex, version, pid, self.clock(), time.time(), epoch)
        rep.ranks[rank] = r
        self._ranks[r.instance] = r
        rep.dropped.pop(rank, None)
        rep.failed_version, rep.failures, rep.retry_at = None, 0, 0.0  # a new member: a fresh try
        self.metrics.engine_version(replica, rank, version)
        event(log, "engine rank registered", replica=replica, rank=rank, world=world, version=version, pid=pid)
        self._changed()
        return {"instance": r.instance, "poll_seconds": self.max_wait, "timeout_seconds": self.timeout}

    async def poll(self, instance: str, after: int, wait: float, version: int | None, epoch: int | None = None) -> dict:
        """The rank's next instruction: the last one given if it is numbered above ``after``, else the
        next one given within ``wait`` seconds, else ``{"op": "none"}``. ``version``: what it holds."""
        r = self._rank(instance)
        self._seen(r, version, epoch)
        if r.seq <= after and not self._closed:
            r.wake.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(r.wake.wait(), max(0.0, min(wait, self.max_wait)))
            r = self._rank(instance)  # dropped while it waited: it registers again
            r.seen = self.clock()
        if r.seq > after and r.instruction is not None:
            return r.instruction
        return {"op": "none", "seq": r.seq}

    def report(
        self,
        instance: str,
        txn: int,
        phase: str,
        ok: bool,
        version: int | None,
        error: str | None = None,
        epoch: int | None = None,
    ) -> dict:
        """A rank's outcome of ``phase`` of transaction ``txn`` (and the version it holds now).
        ``accepted`` is false for a report on a transaction that is over or that it is no member of."""
        r = self._rank(instance)
        self._seen(r, version, epoch)
        rep = self._replicas[r.replica]
        t = rep.txn
        if t is None or t.id != txn or t.members.get(r.rank) != instance or t.phase != phase:
            return {"accepted": False}
        if not ok:
            r.error = error or "failed"
        if phase == "prepare":
            if not ok:
                self._abort(rep, f"rank {r.rank} could not prepare version {t.version}: {r.error}")
            else:
                t.prepared.add(r.rank)
                if t.prepared == set(t.members):
                    self._apply(rep)
        else:
            t.applied[r.rank] = ok
            if ok:
                r.error = None
            if set(t.applied) == set(t.members):
                self._finish(rep)
        self._changed()
        return {"accepted": True}

    def leave(self, instance: str) -> None:
        """The rank stops (its process is closing): dropped at once."""
        r = self._rank(instance)
        self._lose(self._replicas[r.replica], r, "left", logging.INFO)
        self._changed()

    # -- what the subscriber asks -------------------------------------------------------------------
    def holding(self, folder: Path) -> list[str]:
        """The replicas whose ranks are preparing from ``folder`` now (the subscriber must not write it)."""
        folder = Path(folder)
        return sorted(
            rep.id
            for rep in self._replicas.values()
            if rep.txn is not None and rep.txn.phase == "prepare" and rep.txn.folder == folder
        )

    def kick(self) -> None:
        """Something changed (a swap): plan every replica again now."""
        self._kick.set()

    def close(self) -> None:
        """Stop: answer every held poll now (and later ones at once)."""
        self._closed = True
        for r in self._ranks.values():
            r.wake.set()
        self._kick.set()

    def records(self) -> list[EngineRecord]:
        """Every registered rank, for the fleet ledger."""
        return [
            EngineRecord(rep.id, r.rank, r.world, r.version)
            for rep in sorted(self._replicas.values(), key=lambda x: x.id)
            for r in sorted(rep.ranks.values(), key=lambda x: x.rank)
        ]

    def status(self) -> dict:
        """The ``engines`` part of ``GET /v1/status``."""
        now = self.clock()
        out = []
        for rep in sorted(self._replicas.values(), key=lambda x: x.id):
            held = {r.version for r in rep.ranks.values()}
            complete = len(rep.ranks) == rep.world
            t = rep.txn
            out.append(
                {
                    "replica": rep.id,
                    "world": rep.world,
                    "version": held.pop() if complete and len(held) == 1 else None,  # None: ranks differ
                    "state": rep.state,
                    "reason": rep.reason,
                    "transaction": None
                    if t is None
                    else {
                        "id": t.id,
                        "version": t.version,
                        "phase": t.phase,
                        "folder": str(t.folder),
                        "prepared": sorted(t.prepared),
                        "applied": sorted(t.applied),
                        "seconds": round(now - t.started, 3),
                    },
                    "last_transaction": rep.last,
                    "ranks": [
                        {
                            "rank": r.rank,
                            "version": r.version,
                            "pid": r.pid,
                            "last_seen_seconds": round(now - r.seen, 3),
                            "error": r.error,
                        }
                        for r in sorted(rep.ranks.values(), key=lambda x: x.rank)
                    ],
                    "dropped": {str(k): v for k, v in sorted(rep.dropped.items())},
                }
            )
        return {"timeout_seconds": self.timeout, "phase_timeout_seconds": self.phase_timeout, "replicas": out}

    # -- the loop -----------------------------------------------------------------------------------
    async def run(self, serving: Callable[[], tuple[int, Path] | None]) -> None:
        """Drop silent ranks, end overdue phases and start the transactions replicas need, until
        :meth:`close`. ``serving()``: the version ``current`` serves and its slot folder, or None."""
        try:
            while not self._closed:
                self._kick.clear()
                delay = self.step(serving())
                if self._settled and self.on_settled is not None:
                    self._settled = False
                    task = asyncio.create_task(self.on_settled())
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), delay)
        finally:
            for task in list(self._tasks):
                task.cancel()

    def step(self, serving: tuple[int, Path] | None) -> float:
        """One pass over every replica; returns the seconds until the next is due."""
        now = self.clock()
        due = now + self.timeout / 4
        for r in [r for r in self._ranks.values() if now - r.seen > self.timeout]:
            self.metrics.engine_dropped.inc()
            self._lose(self._replicas[r.replica], r, f"sent nothing for {now - r.seen:.1f}s", logging.WARNING)
            self._changed()
        for rep in list(self._replicas.values()):
            t = rep.txn
            if t is not None and now >= t.deadline:
                late = sorted(set(t.members) - (t.prepared if t.phase == "prepare" else set(t.applied)))
                what = f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not"
                within = f"version {t.version} within {self.phase_timeout:g}s"
                if t.phase == "prepare":
                    self._abort(rep, f"{what} prepare {within}")
                else:
                    self._finish(rep, f"{what} confirm applying {within}")
                self._changed()
            if rep.txn is not None:
                due = min(due, rep.txn.deadline)
            view = ReplicaView(
                rep.world,
                {k: r.version for k, r in rep.ranks.items()},
                None if rep.txn is None else self._describe(rep.txn),
                rep.failed_version,
                rep.failures,
                rep.retry_at,
            )
            action = plan_replica(view, None if serving is None else serving[0], now)
            rep.reason = action.reason
            rep.state = "in step" if isinstance(action, Idle) else "waiting"
            if rep.txn is not None or isinstance(action, Start):
                rep.state = "switching"
            if isinstance(action, Start):
                self._start(rep, action.version, serving[1])
                due = min(due, now + self.phase_timeout)
            elif isinstance(action, Wait) and rep.failed_version is not None and rep.txn is None:
                due = min(due, max(now, rep.retry_at))
        return max(0.01, due - now)

    # -- transactions -------------------------------------------------------------------------------
    def _start(self, rep: _Replica, version: int, folder: Path) -> None:
        self._txns += 1
        now = self.clock()
        members = {k: r.instance for k, r in rep.ranks.items()}
        t = _Txn(self._txns, version, folder, members, now, now + self.phase_timeout)
        rep.txn = t
        rep.reason = self._describe(t)
        event(log, f"engine transaction {t.id}: preparing version {version}", replica=rep.id, folder=folder)
        for r in rep.ranks.values():
            self._instruct(r, {"op": "prepare", "txn": t.id, "version": version, "folder": str(folder)})

    def _apply(self, rep: _Replica) -> None:
        t = rep.txn
        t.phase, t.deadline = "apply", self.clock() + self.phase_timeout
        rep.reason = self._describe(t)
        for rank in t.members:
            self._instruct(rep.ranks[rank], {"op": "apply", "txn": t.id, "version": t.version})
        self.on_release()

    def _abort(self, rep: _Replica, why: str) -> None:
        t = rep.txn
        for rank, instance in t.members.items():
            r = rep.ranks.get(rank)
            if r is not None and r.instance == instance:
                self._instruct(r, {"op": "abort", "txn": t.id, "version": t.version, "reason": why})
        rep.failures = rep.failures + 1 if rep.failed_version == t.version else 1
        rep.failed_version = t.version
        rep.retry_at = self.clock() + self.backoff.delay(rep.failures)
        self._ended(rep, "aborted", why, logging.WARNING)
        self.on_release()

    def _finish(self, rep: _Replica, late: str | None = None) -> None:
        t = rep.txn
        failed = sorted(k for k, ok in t.applied.items() if not ok)
        if late is None and not failed:
            self.metrics.engine_transaction_seconds.observe(self.clock() - t.started)
            rep.failed_version, rep.failures = None, 0
            self._ended(rep, "applied", None, logging.INFO)
            return
        why = [late] if late else []
        why += [f"rank {k} could not apply: {rep.ranks[k].error}" for k in failed if k in rep.ranks]
        rep.failures = rep.failures + 1 if rep.failed_version == t.version else 1
        rep.failed_version, rep.retry_at = t.version, self.clock() + self.backoff.delay(rep.failures)
        self._ended(rep, "apply_failed", "; ".join(why), logging.ERROR)

    def _ended(self, rep: _Replica, outcome: str, why: str | None, level: int) -> None:
        t = rep.txn
        rep.txn = None
        seconds = round(self.clock() - t.started, 6)
        rep.last = {"id": t.id, "version": t.version, "outcome": outcome, "error": why, "seconds": seconds}
        self.metrics.engine_transactions(outcome)
        fields = {"replica": rep.id, "seconds": f"{seconds:.3f}"}
        if why:
            fields["error"] = why
        event(log, f"engine transaction {t.id}: {outcome.replace('_', ' ')} (version {t.version})", level, **fields)

    def _describe(self, t: _Txn) -> str:
        done = t.prepared if t.phase == "prepare" else t.applied
        verb = "preparing" if t.phase == "prepare" else "applying"
        return f"transaction {t.id}: {verb} version {t.version} ({len(done)} of {len(t.members)} ranks done)"

    # -- ranks --------------------------------------------------------------------------------------
    def _rank(self, instance: str) -> _Rank:
        r = self._ranks.get(instance)
        if r is None:
            raise UnknownEngineError("no engine rank is registered under this instance id; register again")
        return r

    def _seen(self, r: _Rank, version: int | None, epoch: int | None) -> None:
        r.seen = self.clock()
        if epoch is not None and r.epoch is not None:
            if epoch < r.epoch:
                return  # sent before a change the subscriber already heard of
            r.epoch = epoch
        elif epoch is not None:
            r.epoch = epoch
        if version != r.version:
            r.version = version
            self.metrics.engine_version(r.replica, r.rank, version)
            self._changed()

    def _instruct(self, r: _Rank, doc: dict) -> None:
        r.seq += 1
        r.instruction = {**doc, "seq": r.seq}
        r.wake.set()

    def _lose(self, rep: _Replica, r: _Rank, why: str, level: int) -> None:
        """Drop rank ``r``: out of its replica (which then waits for it), out of a transaction."""
        del rep.ranks[r.rank]
        del self._ranks[r.instance]
        r.wake.set()  # a held poll answers: the rank learns it is unknown
        rep.dropped[r.rank] = why
        self.metrics.engine_version(rep.id, r.rank, None, remove=True)
        event(log, f"engine rank dropped: {why}", level, replica=rep.id, rank=r.rank, version=r.version, pid=r.pid)
        t = rep.txn
        if t is not None and t.members.get(r.rank) == r.instance:
            if t.phase == "prepare":
                self._abort(rep, f"rank {r.rank} {why}")
            else:
                del t.members[r.rank]
                t.applied.pop(r.rank, None)
                if set(t.applied) == set(t.members):
                    self._finish(rep, f"rank {r.rank} {why} before confirming the apply")
        if not rep.ranks:
            del self._replicas[rep.id]

    def _changed(self) -> None:
        self._settled = True
        self._kick.set()


# --- the ranks' side of the wire -----------------------------------------------------------------
class EngineClient:
    """An engine rank's calls to its subscriber's API (``url``: ``http://127.0.0.1:8471``; ``token``:
    the API's bearer token, if it has one). Blocking (urllib); one client per thread is not needed.
    Raises :class:`UnknownEngineError` when the subscriber no longer knows the instance,
    :class:`EngineConflictError` for a conflicting registration, :class:`WeightsyncError` for another
    error answer and ``OSError`` when the subscriber cannot be reached."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        self._auth = None if token is None else f"Bearer {token}"

    def register(
        self,
        replica: str,
        rank: int,
        world: int,
        version: int | None,
        pid: int | None = None,
        epoch: int | None = None,
    ) -> dict:
        """``POST /v1/engines``: the instance id and the poll and drop timings."""
        body = {"replica": replica, "rank": rank, "world": world, "version": version, "pid": pid, "epoch": epoch}
        return self._call("POST", "/v1/engines", body)

    def poll(self, instance: str, after: int, wait: float, version: int | None, epoch: int | None = None) -> dict:
        """``POST /v1/engines/poll``: the next instruction (``op``: prepare, apply, abort or none)."""
        body = {"instance": instance, "after": after, "wait": wait, "version": version, "epoch": epoch}
        return self._call("POST", "/v1/engines/poll", body, timeout=wait + self.timeout)

    def report(
        self,
        instance: str,
        txn: int,
        phase: str,
        ok: bool,
        version: int | None,
        error: str | None = None,
        epoch: int | None = None,
    ) -> dict:
        """``POST /v1/engines/report``: the outcome of one phase of a transaction."""
        body = {"instance": instance, "txn": txn, "phase": phase, "ok": ok, "version": version, "error": error}
        return self._call("POST", "/v1/engines/report", {**body, "epoch": epoch})

    def leave(self, instance: str) -> None:
        """``POST /v1/engines/leave``: this rank stops."""
        self._call("POST", "/v1/engines/leave", {"instance": instance})

    def manifest(self, version: int) -> bytes:
        """``GET /v1/manifest/{version}``: the manifest's bytes (parse them with
        :func:`weightsync.format.manifest.manifest_from_json`, which checks its checksum)."""
        return self._request("GET", f"/v1/manifest/{int(version)}", None, self.timeout)

    def _call(self, method: str, path: str, body: dict, timeout: float | None = None) -> dict:
        return json.loads(self._request(method, path, json.dumps(body).encode(), timeout or self.timeout))

    def _request(self, method: str, path: str, data: bytes | None, timeout: float) -> bytes:
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._auth is not None:
            req.add_header("Authorization", self._auth)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", "")
            except (ValueError, AttributeError, OSError):
                message = ""
            what = f"{method} {path}: HTTP {exc.code}" + (f": {message}" if message else "")
            if exc.code == 404 and path.startswith("/v1/engines"):
                raise UnknownEngineError(what) from None
            if exc.code == 409:
                raise EngineConflictError(what) from None
            raise WeightsyncError(what) from None
