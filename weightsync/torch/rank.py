"""An engine worker's side of the node path: each rank (one per GPU) takes its part of every version
from its node's subscriber, never from the store, and applies it in place in step with the other
ranks of its replica (the protocol: ``weightsync.service.engines``; docs/ENGINES.md, "The node
path")::

    folder, version = current_folder("/models/run1")   # the slot ``current`` names, and its version
    model = load(folder)                               # from_pretrained, safetensors, the engine's loader
    rank = EngineRank("http://127.0.0.1:8471", model, version, replica="node3-tp", rank=tp_rank,
                      world=tp_size, lock=serving_lock, folder=folder).start()
    ...                                                # serve: every forward pass under serving_lock
    rank.close()

A background thread long-polls the subscriber; a worker thread prepares each version from the slot
folder it names (:meth:`TorchSink.prepare` with ``folder``: only the tensors that changed are read,
each checked against the manifest's checksum), reports, and applies under the serving lock when
every rank of the replica has prepared (or drops the update on an abort)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path

from weightsync.errors import UsageError, WeightsyncError
from weightsync.format.manifest import Manifest, manifest_from_json
from weightsync.service.engines import EngineClient, EngineConflictError, UnknownEngineError
from weightsync.service.slots import slot_version
from weightsync.sync.observer import Observer
from weightsync.torch.sink import ApplyError, TorchSink, Update

log = logging.getLogger("weightsync.engine")


def current_folder(target: Path | str) -> tuple[Path, int]:
    """The slot folder that ``<target>/current`` points at, resolved (a later swap does not move it),
    and the version it holds. Load the model from this folder, not through ``current``; a slot the
    subscriber refilled while it was read fails the rank's check on :meth:`EngineRank.start`
    (``BaseMismatchError``): load again."""
    link = Path(target) / "current"
    try:
        folder = link.resolve(strict=True)
    except FileNotFoundError:
        raise UsageError(f"{link} does not exist: the subscriber serves no version yet") from None
    version = slot_version(folder, False)
    if version is None:
        partial = slot_version(folder, True) is not None
        raise UsageError(
            f"{folder} holds "
            + ("a partial version (--include/--exclude): engine ranks need whole slots" if partial else "no version")
        )
    return folder, version


class _Aborted(Exception):
    """The transaction being prepared was aborted (or the rank is closing)."""


class _AbortCheck(Observer):
    """Stops a prepare at its next check once its transaction is aborted or the rank closes."""

    def __init__(self, *flags: threading.Event):
        self.flags = flags

    def check(self) -> None:
        if any(f.is_set() for f in self.flags):
            raise _Aborted()


class EngineRank:
    """One rank of an inference engine replica, kept at the version its node's subscriber serves.

    ``url``: the subscriber's API (``http://127.0.0.1:8471``), ``token`` its bearer token if it has
    one. ``model``: the rank's module (or a mapping of names to tensors), holding ``version``, which
    it was loaded from ``folder`` (e.g. :func:`current_folder`; given, tensors the rank holds only in
    part are verified against it). ``replica``: the replica's id, the same on its ``world`` ranks;
    ``rank``: this one's. ``lock``: the engine's serving lock, held around each forward pass (an
    apply takes it for the swap alone). ``mode``, ``layout`` and ``sink_options`` go to
    :class:`~weightsync.torch.sink.TorchSink`.

    ``auto_apply=True`` applies as soon as the subscriber says every rank prepared: ranks switch
    within milliseconds of each other, between forward passes, but not at one agreed step. An
    engine whose ranks run each step in lockstep (tensor parallelism) passes ``auto_apply=False``
    and, at a step boundary, lets its ranks agree (e.g. an all-reduce of :meth:`pending`) and then
    calls :meth:`apply_pending` on every rank before the same step.
    """

    def __init__(
        self,
        url: str,
        model,
        version: int,
        *,
        replica: str,
        rank: int = 0,
        world: int = 1,
        lock: threading.Lock | None = None,
        token: str | None = None,
        folder: Path | str | None = None,
        mode: str = "patch",
        layout=None,
        auto_apply: bool = True,
        client: EngineClient | None = None,
        **sink_options,
    ):
        self.client = client or EngineClient(url, token)
        self.model, self.replica, self.rank, self.world = model, replica, rank, world
        self.auto_apply = auto_apply
        self._start = (version, folder, lock, mode, layout, sink_options)
        self.sink: TorchSink | None = None
        self.history: deque[tuple[float, str, int, int]] = deque(maxlen=256)  # (unix time, event, txn, version)
        self.last_error: str | None = None
        self._held = (0, version)  # (epoch, version): replaced as one, so a poll never sends a mix
        self._instance: str | None = None
        self._poll_seconds = 10.0
        self._stop = threading.Event()
        self._work: queue.Queue = queue.Queue()
        self._aborts: dict[int, threading.Event] = {}  # txn -> set when it is aborted
        self._prepared: dict[int, Update] = {}  # worker thread only
        self._pending: tuple[int, Update, str] | None = None  # auto_apply=False: (txn, update, instance)
        self._pending_lock = threading.Lock()
        self._manifests: dict[int, Manifest] = {}
        self._threads: list[threading.Thread] = []

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> EngineRank:
        """Get the manifest of the model's version from the subscriber, check the model holds it
        (``BaseMismatchError`` if not), register and start following. Raises when the subscriber
        cannot be reached; later outages are retried."""
        version, folder, lock, mode, layout, options = self._start
        self.sink = TorchSink(
            None,
            self.model,
            version,
            manifest=self._manifest(version),
            folder=folder,
            lock=lock,
            mode=mode,
            layout=layout,
            **options,
        )
        self._register()
        for name, target in (("poll", self._poll_loop), ("apply", self._work_loop)):
            t = threading.Thread(target=target, name=f"weightsync-rank{self.rank}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop following: leave the replica (the subscriber drops this rank at once) and end the
        threads. The model keeps the version it holds."""
        self._stop.set()
        for ev in list(self._aborts.values()):
            ev.set()
        instance, self._instance = self._instance, None
        if instance is not None:
            try:
                self.client.leave(instance)
            except (OSError, WeightsyncError):
                pass  # gone already: the subscriber drops it for silence
        self._work.put(None)
        for t in self._threads:
            t.join(timeout)

    def __enter__(self) -> EngineRank:
        return self.start() if self.sink is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what the engine reads ----------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The version the model holds (None after an apply failed midway, until the next one)."""
        return self._held[1]

    @property
    def lock(self) -> threading.Lock:
        """The serving lock (the one given, or the sink's own)."""
        return self.sink.lock if self.sink is not None else self._start[2]

    def pending(self) -> int | None:
        """``auto_apply=False``: the version every rank of the replica has prepared and this one may
        apply now (None: nothing to apply)."""
        with self._pending_lock:
            return None if self._pending is None else self._pending[1].version

    def apply_pending(self) -> float | None:
        """``auto_apply=False``: apply the pending update now (takes the serving lock: call it
        between steps, not while holding it) and report it; returns the pause in seconds, None if
        nothing was pending."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        return self._apply(*pending)

    # -- threads ------------------------------------------------------------------------------------
    def _register(self) -> None:
        epoch, version = self._held
        doc = self.client.register(self.replica, self.rank, self.world, version, os.getpid(), epoch)
        self._instance, self._poll_seconds = doc["instance"], float(doc["poll_seconds"])
        log.info(
            "registered with %s as rank %d of %d of replica %s", self.client.url, self.rank, self.world, self.replica
        )

    def _poll_loop(self) -> None:
        after, delay, down = 0, 0.1, None
        while not self._stop.is_set():
            instance = self._instance
            try:
                if instance is None:
                    self._register()
                    after, instance = 0, self._instance
                epoch, held = self._held
                msg = self.client.poll(instance, after, self._poll_seconds, held, epoch)
            except UnknownEngineError:
                if not self._stop.is_set():
                    log.warning(
                        "the subscriber no longer knows this rank (restarted, or dropped it); registering again"
                    )
                    self._forget()
                continue
            except (OSError, WeightsyncError, ValueError) as exc:
                if isinstance(exc, EngineConflictError) or down is None:
                    log.warning("cannot reach the subscriber at %s (%s); retrying", self.client.url, exc)
                down = down or time.monotonic()
                self._stop.wait(delay)
                delay = min(5.0, delay * 2)
                continue
            if down is not None:
                log.info("the subscriber answers again after %.1fs", time.monotonic() - down)
            delay, down = 0.1, None
            if msg.get("op", "none") == "none":
                continue
            after = msg["seq"]
            txn = msg["txn"]
            if msg["op"] == "prepare":
                self._aborts[txn] = threading.Event()
                self._work.put(("prepare", msg, instance))
            elif msg["op"] == "apply":
                self._work.put(("apply", msg, instance))
            elif msg["op"] == "abort":
                ev = self._aborts.pop(txn, None)
                if ev is not None:
                    ev.set()  # a prepare under way stops at its next check
                self._work.put(("abort", msg, instance))

    def _forget(self) -> None:
        """A new registration: what was prepared for the old one is dropped."""
        self._instance = None
        for ev in list(self._aborts.values()):
            ev.set()
        self._aborts.clear()
        self._work.put(("forget", None, None))

    def _work_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None or self._stop.is_set():
                return
            op, msg, instance = item
            try:
                if op == "prepare":
                    self._prepare(msg, instance)
                elif op == "apply":
                    self._take_apply(msg, instance)
                elif op == "abort":
                    if self._prepared.pop(msg["txn"], None) is not None:
                        self._event("aborted", msg["txn"], msg["version"])
                        log.warning("version %d aborted: %s", msg["version"], msg.get("reason", ""))
                else:  # forget
                    self._prepared.clear()
                    with self._pending_lock:
                        self._pending = None
            except Exception:  # a bug: logged; the subscriber's timeouts end the transaction
                log.exception("engine rank: %s failed", op)

    def _prepare(self, msg: dict, instance: str) -> None:
        txn, version = msg["txn"], msg["version"]
        aborted = self._aborts.get(txn)
        if aborted is None or aborted.is_set():
            return
        try:
            up = self.sink.prepare(
                version,
                folder=Path(msg["folder"]),
                manifest=self._manifest(version),
                observer=_AbortCheck(aborted, self._stop),
            )
        except _Aborted:
            self._event("aborted", txn, version)
            return
        except Exception as exc:  # reported: the subscriber aborts every rank
            self.last_error = _one_line(exc)
            log.warning("could not prepare version %d: %s", version, self.last_error)
            self._event("prepare failed", txn, version)
            self._report(instance, txn, "prepare", False, self.last_error)
            return
        if aborted.is_set():
            self._event("aborted", txn, version)
            return
        self._prepared[txn] = up
        self._event("prepared", txn, version)
        self._report(instance, txn, "prepare", True)

    def _take_apply(self, msg: dict, instance: str) -> None:
        txn = msg["txn"]
        up = self._prepared.pop(txn, None)
        self._prepared.clear()  # earlier ones were prepared from a version the model no longer holds
        self._aborts.pop(txn, None)
        if up is None:
            self._report(instance, txn, "apply", False, f"nothing prepared for transaction {txn}")
            return
        if self.auto_apply:
            self._apply(txn, up, instance)
        else:
            with self._pending_lock:
                self._pending = (txn, up, instance)

    def _apply(self, txn: int, up: Update, instance: str) -> float | None:
        try:
            pause = self.sink.apply(up)
        except Exception as exc:  # reported; in patch mode the model is torn until the next update
            if isinstance(exc, ApplyError) and self.sink.mode == "patch":
                self._held = (self._held[0] + 1, None)
            self.last_error = _one_line(exc)
            log.error("could not apply version %d: %s", up.version, self.last_error)
            self._event("apply failed", txn, up.version)
            self._report(instance, txn, "apply", False, self.last_error)
            return None
        self._held = (self._held[0] + 1, self.sink.version)
        self._event("applied", txn, up.version)
        log.info("applied version %d (pause %.2f ms)", up.version, 1000 * pause)
        self._report(instance, txn, "apply", True)
        return pause

    def _report(self, instance: str, txn: int, phase: str, ok: bool, error: str | None = None) -> None:
        delay = 0.1
        for _ in range(6):
            if self._stop.is_set() or instance != self._instance:
                return  # registered again since: the subscriber ended that transaction
            try:
                epoch, version = self._held
                self.client.report(instance, txn, phase, ok, version, error, epoch)
                return
            except UnknownEngineError:
                return
            except (OSError, WeightsyncError, ValueError) as exc:
                log.warning("could not report %s of transaction %d (%s); retrying", phase, txn, exc)
                self._stop.wait(delay)
                delay *= 2

    def _manifest(self, version: int) -> Manifest:
        m = self._manifests.get(version)
        if m is None:
            m = manifest_from_json(self.client.manifest(version), f"{self.client.url}/v1/manifest/{version}")
            if m.version != version:
                raise WeightsyncError(f"the subscriber answered the manifest of version {m.version} for {version}")
            self._manifests[version] = m
            while len(self._manifests) > 4:  # the version held and the next ones: a few
                self._manifests.pop(next(iter(self._manifests)))
        return m

    def _event(self, what: str, txn: int, version: int) -> None:
        self.history.append((time.time(), what, txn, version))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
