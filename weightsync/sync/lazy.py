"""Reading from a store that notes chunks as not copied yet (docs/FORMAT.md section 1, lazy chunks).

A regional mirror may move its head before it holds a keyframe's full payloads. Followers of the
parent never read them (they read the keyframe's deltas); a reader that would, gets their bytes
one of two ways, as :class:`LazyReads` says:

- ``rebuild``: from the newest keyframe this store holds whole, plus the deltas after it (the
  keyframes' own deltas among them): only this store's bytes, more of them, and more decoding;
- ``fallback``: the noted chunks read from another store that holds them (the source region),
  each checked against its id (whole chunks) or its payload's checksum (ranges) like any other;
- ``auto`` (the default): rebuild what can be rebuilt, read the rest from the fallback store when
  one is given. Without one it is ``rebuild``.

Whatever the mode, a recipe that reads no noted chunk is preferred (a follower never reads a full
payload it does not need), and when nothing else serves, the noted chunks the plan needs are
looked for in this store (a note the mirror has not removed yet). Failing that,
:class:`LazyChunksError`. Each note is read after its manifest: the mirror writes it before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from weightsync.errors import LazyChunksError, SignatureError, UsageError, VersionError
from weightsync.format.keys import chunk_key
from weightsync.format.manifest import Manifest
from weightsync.store.repo import Repo
from weightsync.sync.plan import Recipe

MODES = ("auto", "rebuild", "fallback")

T = TypeVar("T")

# make(chain, avoid, use_avoided) -> (the caller's plan, the recipes it reads): see plan_reads
Make = Callable[[list[Manifest], frozenset[str], bool], tuple[T, Iterable[Recipe]]]


@dataclass(frozen=True)
class LazyReads:
    """How a reader gets the bytes of chunks its store notes as not copied yet (see the module doc):
    ``mode`` is ``auto``, ``rebuild`` or ``fallback``; ``fallback`` the store to read them from
    (a :class:`Repo`; only its chunks are read, never its manifests or head)."""

    mode: str = "auto"
    fallback: Repo | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--lazy-chunks must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "fallback" and self.fallback is None:
            raise UsageError("--lazy-chunks fallback needs --fallback-store (a store holding the same versions)")


@dataclass(frozen=True)
class Reads:
    """Where a plan's chunks come from: the store, except ``from_fallback`` (noted there as not
    copied yet), read from ``fallback``. ``rebuilt_from``: the keyframe a rebuild starts at, when the
    plan walks past keyframes the store does not hold whole (None otherwise)."""

    fallback: Repo | None = None
    from_fallback: frozenset[str] = frozenset()
    rebuilt_from: int | None = None

    def source(self, repo: Repo, chunk_id: str) -> Repo:
        """The repo to read ``chunk_id`` from."""
        return self.fallback if chunk_id in self.from_fallback and self.fallback is not None else repo


NO_LAZY = Reads()


def plan_reads(
    repo: Repo,
    version: int,
    make: Make,
    *,
    back_to: int | None = None,
    lazy: LazyReads | None = None,
) -> tuple[T, Reads]:
    """Plan reading ``version`` of ``repo`` around the chunks it notes as not copied yet.

    ``make(chain, avoid, use_avoided)`` plans on ``chain`` (as :meth:`Repo.chain` gives it, from
    ``back_to`` when that is on the way) with :func:`~weightsync.sync.plan.plan_segment`'s ``avoid``
    and ``use_avoided``, and returns its plan and the recipes the plan reads. It is called again
    while the notes of the versions those recipes read name chunks they read: first on the usual
    chain, then (``auto``, ``rebuild``) on one from the newest keyframe held whole, then
    (``auto``, ``fallback``, with a fallback store) letting recipes read noted chunks from there.
    Returns the plan and :class:`Reads`, which a fetch takes to read each chunk where it is.
    """
    lazy = lazy or LazyReads()
    notes: dict[int, frozenset[str]] = {}

    def noted(chain: list[Manifest]) -> frozenset[str]:
        """Chunks a note names, but those a version of ``chain`` whose note is known references and
        does not name: a committed version holds every chunk its note leaves out (a keyframe may
        repeat an older one's bytes, and a mirror notes its chunk although it is there)."""
        held = {c.id for m in chain if m.version in notes for c in m.chunks if c.id not in notes[m.version]}
        return frozenset().union(*notes.values()) - held

    def settle(chain: list[Manifest], use_avoided: bool) -> tuple[T, dict[str, int]]:
        """Plan until the notes of every version the plan reads are known and respected; returns
        the plan and the noted chunks it reads (id -> size)."""
        plan, recipes = make(chain, noted(chain), use_avoided)
        while True:
            steps = [s for r in recipes for s in r.steps]
            unread = sorted({s.version for s in steps} - notes.keys())
            if unread:
                notes.update(_read_notes(repo, unread))
            avoid = noted(chain)
            used = {g.chunk.id: g.chunk.size for s in steps for g in s.all_ranges if g.chunk.id in avoid}
            if not unread or not used:  # no new note, or none that this plan reads: planning again gives it back
                return plan, used
            plan, recipes = make(chain, avoid, use_avoided)

    chain = repo.chain(version, back_to=back_to)
    use_fallback = lazy.fallback is not None and lazy.mode != "rebuild"
    try:
        plan, used = settle(chain, lazy.mode == "fallback")
        return plan, Reads(lazy.fallback, frozenset(used)) if used else NO_LAZY
    except LazyChunksError:
        pass
    rebuilt_from, why = None, ""
    if lazy.mode != "fallback":
        keyframe = next(m.version for m in reversed(chain) if m.keyframe)  # the one the target builds on
        try:
            chain = repo.chain(version, back_to=back_to, whole=True)
            notes.update(_read_notes(repo, [m.version for m in chain if m.version not in notes]))  # all held
            rebuilt_from = next(m.version for m in chain if m.keyframe)
            rebuilt_from = rebuilt_from if rebuilt_from < keyframe else None
            return settle(chain, False)[0], Reads(rebuilt_from=rebuilt_from)
        except (LazyChunksError, VersionError, SignatureError) as exc:
            why = f" ({exc})"  # no whole keyframe before it (or one on the way collected or refused), or still short
    if use_fallback:
        plan, used = settle(chain, True)
        return plan, Reads(lazy.fallback, frozenset(used), rebuilt_from)
    plan, used = settle(chain, True)  # what it would read: perhaps copied since the notes were written
    missing = _missing(repo, used)
    if not missing:
        return plan, Reads(rebuilt_from=rebuilt_from)
    options = "give --fallback-store URL (a store holding the version, e.g. the source region)"
    if lazy.mode == "rebuild":
        options = "use --lazy-chunks auto or fallback with --fallback-store URL (e.g. the source region)"
    raise LazyChunksError(
        f"version {version} needs {len(missing)} chunk(s) that {repo.url} has not copied yet (a mirror "
        f"copies keyframe full payloads lazily) and cannot rebuild from a keyframe it holds whole{why}; "
        f"{options}, or pull again once they arrive",
        version,
        frozenset(missing),
    )


def _read_notes(repo: Repo, versions: list[int]) -> dict[int, frozenset[str]]:
    """The notes of ``versions`` (each read after its manifest, which the caller read first)."""
    if len(versions) <= 1:
        return {v: repo.lazy_chunks(v) for v in versions}
    with ThreadPoolExecutor(min(8, len(versions)), thread_name_prefix="ws-notes") as pool:
        return dict(zip(versions, pool.map(repo.lazy_chunks, versions)))


def _missing(repo: Repo, sizes: dict[str, int]) -> list[str]:
    """The chunks of ``sizes`` (id -> size) that ``repo`` does not hold at their size."""
    if not sizes:
        return []
    ids = sorted(sizes)
    with ThreadPoolExecutor(min(16, len(ids)), thread_name_prefix="ws-lazy") as pool:
        have = list(pool.map(lambda c: repo.store.head(chunk_key(c)), ids))
    return [c for c, size in zip(ids, have) if size != sizes[c]]
