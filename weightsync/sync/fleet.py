"""The fleet ledger: each subscriber's record in the store (``fleet/<id>.json``), and the fleet view
built from them (:func:`fleet_view`, pure: lag, staleness, age of each record; records of stopped
subscribers and records not rewritten for ``expire_after`` seconds are left out), over one store or
several (:func:`read_fleets`: every region at once)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime

from weightsync.errors import FormatError, NotFoundError, SignatureError, StoreError, VersionError
from weightsync.format.keys import FLEET_PREFIX, ID_RE, MAX_VERSION
from weightsync.store import Store, check_key
from weightsync.store.repo import Repo

FORMAT = "weightsync.fleet"
MAX_ENGINES = 4096  # engine ranks one record may list
EXPIRE_AFTER = 600.0  # seconds: a record not rewritten for this long (20 heartbeats of 30 s) is a gone subscriber's
STOPPED = "stopped"  # the state of a subscriber's last record when it stopped cleanly


@dataclass(frozen=True)
class EngineRecord:
    """One engine rank registered with a subscriber (``weightsync.service.engines``): its replica,
    rank, world size and the version it says it holds (None: unknown)."""

    replica: str
    rank: int
    world: int
    version: int | None


@dataclass(frozen=True)
class FleetRecord:
    """One subscriber's record in the store: who it is, where, what it serves and targets, its state,
    when it wrote this, and the engine ranks that take their versions from it."""

    id: str
    region: str
    cluster: str
    current_version: int | None
    target: int | str  # a pinned version or "latest"
    state: str
    updated: float  # unix seconds
    engines: tuple[EngineRecord, ...] = ()

    def to_json(self) -> bytes:
        """The record's stored document."""
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()


def record_key(subscriber_id: str) -> str:
    """The store key of subscriber ``subscriber_id``'s record."""
    return check_key(f"{FLEET_PREFIX}{subscriber_id}.json")


def _version(v: object, what: str, allow: tuple = (None,)) -> int | str | None:
    if v in allow:
        return v
    if type(v) is not int or not 0 <= v <= MAX_VERSION:
        shown = repr(v)[:40] if isinstance(v, (int, float, str)) else f"of type {type(v).__name__}"  # no deep repr
        raise FormatError(f"{what}: bad version {shown}")
    return v


def record_from_json(data: bytes, what: str) -> FleetRecord:
    """Parse and validate a stored record (:class:`FormatError` if it does not parse)."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise FormatError(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FormatError(f"{what}: not a fleet record")
    strings = ("id", "region", "cluster", "state")
    if not all(isinstance(doc.get(k), str) for k in strings):
        raise FormatError(f"{what}: fields {strings} must be strings")
    if not ID_RE.match(doc["id"]) or any(c < " " or c == "\x7f" for k in strings[1:] for c in doc[k]):
        raise FormatError(f"{what}: an id or a name that no daemon has (control characters would forge the table)")
    updated = doc.get("updated")
    if not isinstance(updated, (int, float)) or isinstance(updated, bool) or not math.isfinite(updated):
        raise FormatError(f"{what}: 'updated' must be a number")
    return FleetRecord(
        doc["id"],
        doc["region"],
        doc["cluster"],
        _version(doc.get("current_version"), what),
        _version(doc.get("target"), what, ("latest",)),
        doc["state"],
        float(updated),
        _engines(doc.get("engines", []), what),
    )


def _engines(docs: object, what: str) -> tuple[EngineRecord, ...]:
    """The ``engines`` list of a record (absent in records written before engine ranks existed)."""
    if not isinstance(docs, list) or len(docs) > MAX_ENGINES:
        raise FormatError(f"{what}: 'engines' must be a list of at most {MAX_ENGINES} engine ranks")
    out = []
    for d in docs:
        if not isinstance(d, dict) or not isinstance(d.get("replica"), str):
            raise FormatError(f"{what}: an engine rank must be an object with a string 'replica'")
        rank, world = d.get("rank"), d.get("world")
        if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
            raise FormatError(f"{what}: engine rank {str(rank)[:20]} of world {str(world)[:20]} is not a rank")
        out.append(EngineRecord(d["replica"], rank, world, _version(d.get("version"), what)))
    return tuple(out)


def write_record(store: Store, record: FleetRecord) -> None:
    """Overwrite the subscriber's record in the store."""
    store.put(record_key(record.id), record.to_json(), mode="overwrite")


def read_records(store: Store) -> tuple[list[FleetRecord], list[str]]:
    """Every parseable record, and one error line per object that is not one."""
    records, errors = [], []
    for key in store.list(FLEET_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            record = record_from_json(store.get(key), key)
            if key != record_key(record.id):
                raise FormatError(f"{key}: holds the record of {record.id!r}, whose key is {record_key(record.id)}")
            records.append(record)
        except NotFoundError:
            continue  # removed while listing
        except (FormatError, StoreError) as exc:  # StoreError: a planted id that makes no key
            errors.append(str(exc))
    return sorted(records, key=lambda r: r.id), errors


# --- staleness ------------------------------------------------------------------------------------
def created_seconds(created: str) -> float | None:
    """A manifest's ``created`` timestamp as unix seconds (None if absent or unparsable)."""
    try:
        return datetime.fromisoformat(created).timestamp() if created else None
    except ValueError:
        return None


def superseded_at(repo: Repo, version: int | None, versions: Iterable[int] | None = None) -> float | None:
    """When the first version newer than ``version`` was published (None if there is none).

    This is when a subscriber serving ``version`` started being stale. ``versions`` saves a listing
    when the caller has one.
    """
    vs = repo.versions() if versions is None else versions
    newer = [v for v in vs if version is None or v > version]
    if not newer:
        return None
    try:
        return created_seconds(repo.manifest(min(newer)).created)
    except (VersionError, SignatureError):  # collected, or refused (its creation time is not to be trusted)
        return None


@dataclass(frozen=True)
class FleetRow:
    """One subscriber in the fleet view: its record's fields plus lag behind the head (versions),
    staleness (seconds) and how long ago the record was written."""

    id: str
    region: str
    cluster: str
    current_version: int | None
    target: int | str
    state: str
    lag: int | None  # versions behind the head (head minus current); None if it serves nothing
    staleness_seconds: float | None  # since a newer version than the current one was published
    last_seen_seconds: float  # since the record was written
    engines: list[dict] = field(default_factory=list)  # its engine ranks: replica, rank, world, version
    gone: bool = False  # stopped, or not seen for expire_after seconds: shown only when asked for


def is_gone(record: FleetRecord, now: float, expire_after: float = EXPIRE_AFTER) -> bool:
    """Whether a record is a gone subscriber's: it stopped cleanly, or has not rewritten its record (a
    heartbeat every ``--ledger-interval``) for ``expire_after`` seconds (a pod replaced by a rollout,
    killed or lost with its node). A record written further than that in the future is no heartbeat
    either (a clock far off, or a planted record that would never expire)."""
    return record.state == STOPPED or not -expire_after <= now - record.updated <= expire_after


def fleet_view(
    records: list[FleetRecord],
    head: int | None,
    superseded: Callable[[int | None], float | None],
    now: float,
    expire_after: float = EXPIRE_AFTER,
) -> list[FleetRow]:
    """Rows of the fleet table (pure but for ``superseded(version) -> unix seconds or None``); gone
    subscribers' rows (:func:`is_gone`) are marked ``gone``."""
    rows = []
    for r in records:
        cur = r.current_version
        lag = None if head is None or cur is None else head - cur
        since = None if head is None or (cur is not None and cur >= head) else superseded(cur)
        stale = (
            0.0
            if head is not None and cur is not None and cur >= head
            else None
            if since is None
            else max(0.0, now - since)
        )
        engines = [asdict(e) for e in r.engines]
        seen = max(0.0, now - r.updated)
        gone = is_gone(r, now, expire_after)
        rows.append(FleetRow(r.id, r.region, r.cluster, cur, r.target, r.state, lag, stale, seen, engines, gone))
    return rows


def read_fleet(repo: Repo, now: float, *, expire_after: float = EXPIRE_AFTER, everyone: bool = False) -> dict:
    """The fleet of one store as JSON-ready data: the store and its head version, one row per
    subscriber (gone ones only with ``everyone``; ``hidden`` counts the others), and bad records."""
    head = repo.head_version()
    records, errors = read_records(repo.store)
    versions = repo.versions() if records and head is not None else []
    cache: dict[int | None, float | None] = {}

    def superseded(v: int | None) -> float | None:
        if v not in cache:
            cache[v] = superseded_at(repo, v, versions)
        return cache[v]

    rows = fleet_view(records, head, superseded, now, expire_after)
    shown = [r for r in rows if everyone or not r.gone]
    return {
        "store": repo.url,
        "head_version": head,
        "subscribers": [{**asdict(r), "store": repo.url} for r in shown],
        "hidden": len(rows) - len(shown),
        "errors": errors,
    }


def read_fleets(repos: list[Repo], now: float, **options) -> dict:
    """The fleet over several stores (one per region; :func:`read_fleet` each, ``options`` as its):
    every store's head, the newest of them as ``head_version``, every subscriber row (each with its
    ``store``; its lag is against its own store's head), hidden rows and bad records of all."""
    fleets = [read_fleet(r, now, **options) for r in repos]
    heads = [f["head_version"] for f in fleets if f["head_version"] is not None]
    return {
        "head_version": max(heads, default=None),
        "stores": [{k: f[k] for k in ("store", "head_version", "hidden", "errors")} for f in fleets],
        "subscribers": [row for f in fleets for row in f["subscribers"]],
        "hidden": sum(f["hidden"] for f in fleets),
        "errors": [e for f in fleets for e in f["errors"]],
    }


def format_fleet(fleet: dict, expire_after: float = EXPIRE_AFTER) -> str:
    """The fleet as a text table (``weightsync fleet``): of one store (:func:`read_fleet`) or several
    (:func:`read_fleets`: a line per store, then every subscriber)."""

    def fmt(v, spec="") -> str:
        return "-" if v is None else format(v, spec)

    stores = fleet.get("stores")
    lines = (
        [f"head version: {fmt(fleet['head_version'])}"]
        if not stores
        else [f"store {s['store']}: head version {fmt(s['head_version'])}" for s in stores]
    )
    lines.append(
        f"{'subscriber':<28} {'region':<12} {'cluster':<12} {'version':>8} {'target':>8} {'lag':>5} "
        f"{'stale':>9} {'seen':>9}  state"
    )
    for r in fleet["subscribers"]:
        stale = fmt(r["staleness_seconds"], ".0f") + ("s" if r["staleness_seconds"] is not None else "")
        lines.append(
            f"{r['id']:<28} {r['region'] or '-':<12} {r['cluster'] or '-':<12} {fmt(r['current_version']):>8} "
            f"{r['target']!s:>8} {fmt(r['lag']):>5} {stale:>9} {r['last_seen_seconds']:>8.0f}s  {r['state']}"
            + (f"  {r['store']}" if stores else "")
            + ("  (gone)" if r.get("gone") else "")
        )
        replicas: dict[str, list[str]] = {}
        for e in r.get("engines", ()):
            replicas.setdefault(e["replica"], []).append(fmt(e["version"]))
        if replicas:
            lines.append("    engines: " + "  ".join(f"{k} [{' '.join(v)}]" for k, v in replicas.items()))
    if fleet.get("hidden"):
        lines.append(f"({fleet['hidden']} stopped or not seen for over {expire_after:g}s not shown: --all shows them)")
    lines += [f"bad record: {e}" for e in fleet["errors"]]
    return "\n".join(lines)
