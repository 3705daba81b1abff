"""A weightsync store: the marker, the head pointer, manifests and chunks over a :class:`Store`.

The commit order makes a version atomic: chunks first (content-addressed, create-only), then the
manifest (create-only, so two publishers cannot both own a version), then its signatures (when the
publisher signs), then a conditional update of the head pointer. Readers only trust manifests at or
below the head; a repo given trusted keys also only manifests one of them signed (docs/FORMAT.md
section 7), checked in :meth:`Repo.manifest`, which every reader goes through.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from weightsync.errors import (
    AlreadyExistsError,
    ChecksumError,
    FormatError,
    LazyChunksError,
    NotAStoreError,
    NotFoundError,
    PreconditionFailedError,
    SignatureError,
    StoreError,
    UsageError,
    VersionError,
)
from weightsync.format.keys import (
    FLEET_PREFIX,
    HEAD_KEY,
    MARKER_KEY,
    MAX_VERSION,
    VERSIONS_PREFIX,
    chunk_key,
    lazy_key,
    parse_version_key,
    signature_key,
    version_key,
)
from weightsync.format.manifest import (
    Manifest,
    Payload,
    check_marker,
    head_from_json,
    head_to_json,
    lazy_candidates,
    lazy_from_json,
    lazy_to_json,
    manifest_from_json,
    manifest_to_json,
    marker_to_json,
)
from weightsync.format.signatures import MAX_DOCUMENT_BYTES
from weightsync.store import Store, open_store
from weightsync.store.retry import RetryingStore, RetryPolicy
from weightsync.store.signing import Keyring, SigningKey, TrustedKey

log = logging.getLogger("weightsync.store")


def check_signable(manifest: Manifest) -> None:
    """Raise :class:`UsageError` unless every payload of ``manifest`` has a SHA-256 digest, which a
    signature needs (docs/FORMAT.md section 7)."""
    if any(not p.sha256 for p in Payload.all_in(manifest)):
        raise UsageError(
            f"version {manifest.version}: payloads without SHA-256 digests cannot be signed (XXH3 binds no content "
            "against a forger); rank parts need publish-part --signing-key"
        )


class Repo:
    """Weightsync operations on one store. Thread-safe; caches parsed manifests (they are immutable).

    ``trusted_keys`` (a :class:`~weightsync.store.signing.Keyring`): every manifest read must be
    signed by one of them (:meth:`manifest` raises :class:`SignatureError` otherwise); None: no
    signature is checked (the stores of users who configure no keys)."""

    def __init__(self, store: Store, manifest_cache: int = 64, *, trusted_keys: Keyring | None = None):
        self.store = store
        self.trusted_keys = trusted_keys
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._cache_size = manifest_cache
        self._lock = threading.Lock()

    def trusting(self, trusted_keys: Keyring | None) -> Repo:
        """A repo over the same store that checks signatures with ``trusted_keys`` (its own manifest cache)."""
        return Repo(self.store, self._cache_size, trusted_keys=trusted_keys)

    @property
    def url(self) -> str:
        """The store's URL (for messages and state files)."""
        return self.store.url

    # --- marker ----------------------------------------------------------------------------------
    def check(self) -> bool:
        """True if this is a weightsync store, False if the location is empty; raises otherwise."""
        try:
            check_marker(self.store.get(MARKER_KEY))
            return True
        except NotFoundError:
            # empty, or holding only subscribers' ledger records (they may start before the store)
            if all(k.startswith(FLEET_PREFIX) for k in self.store.list("")):
                return False
            if self.store.head(MARKER_KEY) is not None:
                return self.check()  # a first publish created the store between our two reads
            raise NotAStoreError(f"{self.url} is not a weightsync store (it holds other objects)") from None
        except FormatError as exc:
            raise NotAStoreError(f"{self.url} is not a weightsync store: {exc}") from None

    def require(self) -> None:
        """Raise :class:`NotAStoreError` unless this is a weightsync store with its marker."""
        if not self.check():
            raise NotAStoreError(f"{self.url} is not a weightsync store (it is empty, or does not exist)")

    def init(self) -> None:
        """Make this location a weightsync store (write the marker) unless it is one; refuses one holding other "
        "objects."""
        if not self.check():
            try:
                self.store.put(MARKER_KEY, marker_to_json(), mode="create")
            except AlreadyExistsError:
                self.require()

    # --- head and versions -----------------------------------------------------------------------
    def head(self) -> tuple[int | None, str | None]:
        """The head version and the tag to update it conditionally (None, None on a fresh store)."""
        try:
            data, etag = self.store.get_with_etag(HEAD_KEY)
        except NotFoundError:
            return None, None
        return head_from_json(data), etag

    def head_if_changed(self, etag: str | None) -> tuple[int | None, str | None] | None:
        """:meth:`head` unless the head still has the tag ``etag`` (from an earlier :meth:`head` or
        call of this): then ``None``, at the cost of one small request without a body on S3 (a
        ``304``). ``etag=None`` always reads. A head removed since answers ``(None, None)``."""
        try:
            got = self.store.get_if_changed(HEAD_KEY, etag)
        except NotFoundError:
            return None, None
        return None if got is None else (head_from_json(got[0]), got[1])

    def head_version(self) -> int | None:
        """The head version, or None on a fresh store."""
        return self.head()[0]

    def versions(self) -> list[int]:
        """Committed versions (manifests at or below the head), ascending."""
        head = self.head_version()
        if head is None:
            return []
        found = (parse_version_key(k) for k in self.store.list(VERSIONS_PREFIX))
        return sorted(v for v in found if v is not None and v <= head)

    def manifest(self, version: int) -> Manifest:
        """The validated manifest of ``version`` (cached); :class:`VersionError` if the store has none,
        :class:`SignatureError` if the repo trusts keys and none of them signed it."""
        with self._lock:
            if version in self._manifests:
                self._manifests.move_to_end(version)
                return self._manifests[version]
        data, _ = self.read_version(version, signatures=False)
        return self._remember(version, data)

    def _remember(self, version: int, data: bytes) -> Manifest:
        """``data`` parsed as ``version``'s manifest (it must claim that version), cached."""
        key = version_key(version)
        m = manifest_from_json(data, f"{self.url}/{key}")
        if m.version != version:
            raise FormatError(f"{self.url}/{key}: manifest claims version {m.version}")
        if self.trusted_keys is not None and any(not p.sha256 for p in Payload.all_in(m)):
            raise SignatureError(  # the signature covers XXH3 names only: a forger could match those
                f"version {version} of {self.url}", version, "signed, but its payloads carry no SHA-256 digests"
            )
        with self._lock:
            self._manifests[version] = m
            while len(self._manifests) > self._cache_size:
                self._manifests.popitem(last=False)
        return m

    def read_version(self, version: int, signatures: bool = True) -> tuple[bytes, bytes | None]:
        """``version``'s stored manifest and signatures document (None: unsigned), as bytes. With
        trusted keys both are read and checked (:meth:`Keyring.verify`) before they are returned;
        without, the signatures are read only if ``signatures`` (a mirror copies them along).
        :class:`VersionError` if the store has no such manifest."""
        key = version_key(version)
        pending = None
        if signatures or self.trusted_keys is not None:  # read beside the manifest: one round trip, not two
            pool = ThreadPoolExecutor(1, thread_name_prefix="ws-signatures")
            pending = pool.submit(self._signatures, version)
            pool.shutdown(wait=False)
        try:
            data = self.store.get(key)
        except NotFoundError:
            raise VersionError(f"version {version} does not exist in {self.url}") from None
        document = None if pending is None else pending.result()
        if self.trusted_keys is not None:
            self.verify_signature(version, data, document)
        return data, document

    def _signatures(self, version: int) -> bytes | None:
        try:  # at most one byte more than a document may have: a huge object is refused, not read
            return self.store.get_range(signature_key(version), 0, MAX_DOCUMENT_BYTES + 1)
        except NotFoundError:
            return None

    def verify_signature(self, version: int, manifest: bytes, document: bytes | None) -> TrustedKey | None:
        """The trusted key that signed ``version`` (None when this repo trusts no keys); raises
        :class:`SignatureError` unless one of the trusted keys signed these manifest bytes."""
        if self.trusted_keys is None:
            return None
        return self.trusted_keys.verify(f"version {version} of {self.url}", version, manifest, document)

    def refusal(self, version: int, keys: Keyring) -> str | None:
        """Why ``keys`` would refuse ``version`` (the :class:`SignatureError`'s line), or None if one
        of them signed it; whatever this repo itself trusts. A repo that trusts no keys keeps the
        manifest it read (a publisher reads its parent next)."""
        data, document = self.trusting(None).read_version(version)
        try:
            keys.verify(f"version {version} of {self.url}", version, data, document)
        except SignatureError as exc:
            return str(exc)
        if self.trusted_keys is None:
            self._remember(version, data)
        return None

    def chain(self, version: int, back_to: int | None = None, limit: int = 1000, whole: bool = False) -> list[Manifest]:
        """Manifests from the keyframe that ``version`` builds on up to ``version``, in order.

        With ``back_to`` (a local version older than that keyframe and an ancestor of ``version``),
        the chain starts at ``back_to`` instead, so keyframes' own deltas can be followed.

        ``whole``: start at the newest keyframe this store holds whole instead, walking past
        keyframes whose chunks it notes as not all copied (:meth:`lazy_chunks`, each note read
        after its manifest), so that their full payloads can be rebuilt from that keyframe and
        the deltas (a keyframe's own deltas among them). :class:`LazyChunksError` if there is none
        within ``limit`` versions (a region mirrored with ``--keyframe-payloads never`` has only its
        first keyframe whole: its chains grow with every version); :class:`VersionError` if one on
        the way was collected.
        """
        out = [self.manifest(version)]
        while not out[-1].keyframe:
            try:
                out.append(self.manifest(out[-1].parent))
            except VersionError as exc:  # a gc under way (newest first) or cut short: name the version asked for
                raise VersionError(
                    f"version {version} of {self.url} cannot be built: the version {out[-1].parent} it is a delta "
                    f"from is gone (collected); {exc}"
                ) from None
        past = 0  # versions walked past lazy keyframes
        while whole and self.lazy_chunks(out[-1].version):
            if out[-1].parent is None or past >= limit:
                far = f" within {limit} versions" if out[-1].parent is not None else ""
                raise LazyChunksError(
                    f"version {version}: no keyframe of {self.url}{far} before it is held whole", version
                )
            while True:  # to the keyframe before, each manifest still stored (the cache cannot tell)
                parent = out[-1].parent
                if self.store.head(version_key(parent)) is None:
                    raise VersionError(f"version {parent} does not exist in {self.url} (collected)")
                out.append(self.manifest(parent))
                past += 1
                if out[-1].keyframe:
                    break
        to_keyframe = len(out)
        if back_to is not None and back_to < out[-1].version:
            try:
                while out[-1].parent is not None and out[-1].parent >= back_to and len(out) < to_keyframe + limit:
                    if self.store.head(version_key(out[-1].parent)) is None:
                        break  # collected by gc (the manifest cache cannot tell): no path from there
                    out.append(self.manifest(out[-1].parent))
            except (VersionError, SignatureError):
                pass  # no usable path from there (a refused manifest never joins a chain): the keyframe serves
            if out[-1].version != back_to:
                del out[to_keyframe:]
        return out[::-1]

    def descent(self, ancestor: int, version: int, limit: int = 32) -> list[Manifest]:
        """The manifests from ``ancestor``'s child to ``version``, each the parent of the next, when
        ``version`` descends from ``ancestor`` within ``limit`` versions: what a rollback from
        ``version`` to ``ancestor`` undoes. Empty otherwise (another lineage, too far, a version on
        the way collected or refused for its signature): a rollback then plans from the keyframe."""
        out: list[Manifest] = []
        try:
            m = self.manifest(version)
            while m.version > ancestor and len(out) < limit:
                out.append(m)
                if m.parent is None or m.parent < ancestor:
                    return []
                if m.parent == ancestor:
                    return out[::-1]
                if self.store.head(version_key(m.parent)) is None:
                    return []  # collected by gc (the manifest cache cannot tell)
                m = self.manifest(m.parent)
        except (VersionError, SignatureError):
            pass
        return []

    # --- chunks a mirror has not copied yet (docs/FORMAT.md section 1) -----------------------------
    def lazy_chunks(self, version: int) -> frozenset[str]:
        """The chunks of ``version`` that are not in this store yet by a mirror's choice (a
        keyframe's full payloads, copied after its head moved, or never): read them elsewhere or
        rebuild. Empty when the store holds the whole version (no note).

        A note that cannot be read (torn, planted, naming another version) is taken to list every
        chunk a mirror may leave out of ``version`` (:func:`lazy_candidates`): readers then avoid
        them as far as they can, and a mirror copies them and clears the note."""
        key = lazy_key(version)
        try:
            data = self.store.get(key)
        except NotFoundError:
            return frozenset()
        try:
            noted, ids = lazy_from_json(data, f"{self.url}/{key}")
            if noted != version:
                raise FormatError(f"{self.url}/{key}: the note names version {noted}")
        except FormatError as exc:
            log.warning("%s; taking it to list every chunk only the full payloads of version %d use", exc, version)
            return lazy_candidates(self.manifest(version))
        return ids

    def note_lazy_chunks(self, version: int, chunk_ids: Iterable[str]) -> None:
        """Record that ``chunk_ids`` of ``version`` are not here yet; written before the manifest
        of ``version``, so no reader can see the version without the note."""
        self.store.put(lazy_key(version), lazy_to_json(version, chunk_ids), mode="overwrite")

    def clear_lazy_chunks(self, version: int) -> None:
        """Drop ``version``'s note once all its chunks are here."""
        try:
            self.store.delete(lazy_key(version))
        except NotFoundError:
            pass

    # --- writes ----------------------------------------------------------------------------------
    def put_chunk(self, chunk_id: str, data: bytes) -> bool:
        """Upload a chunk unless an object of that id and size is there; True if bytes moved
        (see :meth:`store_chunk`)."""
        return self.store_chunk(chunk_id, len(data), data)

    def store_chunk(
        self, chunk_id: str, size: int, data: bytes | Callable[[], bytes], *, verify_existing: bool = False
    ) -> bool:
        """Make the chunk ``chunk_id`` of ``size`` bytes present; True if bytes moved. ``data`` is
        the chunk, or a function that returns it (called only when it must be uploaded: a mirror
        reads the source only for chunks the destination lacks).

        A chunk that is already there is touched, so that a concurrent ``gc`` (which spares young
        objects) cannot delete it between this check and the commit of the manifest that uses it;
        one that gc collected between the check and the touch is uploaded again. An object of the
        wrong size under a chunk's key is damaged and is replaced; so is one of the right size with
        other bytes, where the store tells that in the same request (:meth:`Store.compare`: S3's ETag, a
        local file) with ``data`` in hand (a publish), or with ``verify_existing`` (a mirror: it is
        read). Otherwise an object of the right size is taken for the chunk (pulls check every chunk).
        """
        key = chunk_key(chunk_id)
        if callable(data):
            have = self.store.head(key)
        else:
            seen = self.store.compare(key, data)
            have = None if seen == "absent" else size if seen in ("same", "same-size") else -1
            if seen == "other":  # damaged or planted: a later keyframe re-using the chunk would carry it
                log.warning("%s/%s: holds other bytes than chunk %s; stored again", self.url, key, chunk_id)
        if have == size and verify_existing:
            try:
                verify_chunk(f"{self.url}/{key}", chunk_id, size, self.store.get(key))
            except ChecksumError:
                have = -1  # planted or damaged: replaced below
            except NotFoundError:
                have = None
        if have == size:
            try:
                self.store.touch(key)
                return False
            except NotFoundError:
                have = None  # collected by gc since the HEAD: upload it again
        try:
            self.store.put(key, data() if callable(data) else data, mode="create" if have is None else "overwrite")
        except AlreadyExistsError:
            if self.store.head(key) != size:  # a racing writer stored the same id: it must be these bytes
                raise
            return False
        return True

    def get_chunk(self, chunk_id: str, size: int) -> bytes:
        """A chunk's bytes, checked against its id and size (:class:`ChecksumError` otherwise). At most
        one byte more than ``size`` is read: a larger object under its key is refused, not held whole."""
        key = chunk_key(chunk_id)
        data = self.store.get_at_most(key, size)
        if len(data) > size:
            raise ChecksumError(f"{self.url}/{key}", f"{chunk_id} ({size} bytes)", f"more than {size} bytes")
        verify_chunk(f"{self.url}/{key}", chunk_id, size, data)
        return data

    def commit(
        self,
        manifest: Manifest,
        expected_head: str | None,
        signing_key: SigningKey | None = None,
        check_chunks: Iterable[str] = (),
    ) -> None:
        """Write the manifest (create-only), then, with ``signing_key``, its signatures
        (docs/FORMAT.md section 7: of the bytes stored), then move the head to it if it is newer.

        ``check_chunks``: ids of chunks the caller stored for this version and has not checked since
        (one HEAD request each, before the head moves, so that no reader ever sees a version taken
        back): if one is gone (a gc whose grace, or whose view of the store's clock, took it for an
        abandoned upload's), the manifest is removed and :class:`VersionError` says so, nothing
        committed. A head or signature write refused at its first attempt removes the manifest too
        (left above the head, it blocked the number); after a timeout it stays (the write may have
        landed), for the same publish to finish.

        A manifest already stored under the version is accepted when it describes the same files
        from the same parent: our own write whose answer was lost and retried, or a re-publish of
        the same checkpoint after a publisher died between the manifest and the head. A version
        number the format does not allow is refused before anything is written: readers would
        reject the head for good.

        The head never moves backwards: a version below the head (a slow publisher whose head was
        moved past by another) is refused with :class:`VersionError`, and the manifest this call
        wrote is removed again, since readers trust every manifest at or below the head.
        """
        v = manifest.version
        if not 0 <= v <= MAX_VERSION:
            raise VersionError(f"version {v} is outside the format's range 0..{MAX_VERSION}; not committed")
        head = self.head_version()
        if head is not None and head > v:
            raise VersionError(f"version {v} is below the head {head} of {self.url}; not committed")
        if signing_key is not None:
            check_signable(manifest)
        created, data = True, manifest_to_json(manifest)
        try:
            self.store.put(version_key(v), data, mode="create")
        except AlreadyExistsError:
            data = self._same_version(manifest)
            if data is None:
                head = self.head_version()
                if head is not None and head >= v:
                    raise VersionError(f"version {v} already exists in {self.url}") from None
                raise VersionError(
                    f"version {v} already exists in {self.url} above its head ({head}), as another publish: one "
                    "in progress, or one that died before its commit (gc removes it once older than its grace "
                    "period); publish as another --version"
                ) from None
            created = False
        if signing_key is not None:  # after the manifest: only the owner of version v signs it
            try:
                self.store.put(signature_key(v), signing_key.sign(v, data), mode="overwrite")
            except StoreError:
                if created:  # nothing points at it yet (unless an identical publish moved the head: checked there)
                    self._drop_manifest(v, signing_key, data)
                raise
        if gone := self._gone_chunks(check_chunks):  # before the head: no reader has seen version v
            what = f"chunk {gone[0]}" + (f" and {len(gone) - 1} more" if len(gone) > 1 else "")
            why = (
                f"version {v} of {self.url}: {what} of this publish was deleted before its commit (gc ran with a "
                "grace shorter than the publish took, or saw the store's clock ahead of its writer's)"
            )
            if self._drop_manifest(v, signing_key, data) if created else self.head_version() != v:
                raise VersionError(f"{why}; nothing was committed: publish again")
            err = VersionError(
                f"{why}, and an identical publish committed it meanwhile: publish the next as a keyframe"
            )
            err.committed_broken = True  # not "already committed" for a caller that retries (commit_parts)
            log.error("%s", err)
            raise err
        etag, replaced = expected_head, head
        for _ in range(100):
            try:
                try:
                    self.store.put_if_match(HEAD_KEY, head_to_json(v), etag)
                except PreconditionFailedError:
                    raise
                except StoreError as exc:
                    # refused at the first attempt (a full disk, access denied): it did not land. A
                    # timeout, or retries given up (``attempts``), may have: the manifest stays
                    if created and not exc.retryable and not getattr(exc, "attempts", 0):
                        self._drop_manifest(v, signing_key, data)
                    raise
                if self.head_on_collected(v, replaced):
                    raise VersionError(
                        f"version {v} of {self.url} was collected by gc before the head moved to it (this publish "
                        f"stalled longer than gc's grace period); the head is back at {replaced}: publish again"
                    )
                return
            except PreconditionFailedError:
                current, etag = self.head()
                replaced = current
                if current == v:
                    return  # our own write landed (an ambiguous retry) or an identical re-publish
                if current is not None and current > v:
                    if created:
                        self.store.delete(version_key(v))  # readers trust every manifest at or below the head
                        if signing_key is not None:
                            self.store.delete(signature_key(v))
                    raise VersionError(f"version {v} not committed: the head moved to {current} concurrently") from None
        raise VersionError(f"could not move head to {v}: too much contention")

    def head_on_collected(self, version: int, replaced: int | None) -> bool:
        """Right after moving the head from ``replaced`` to ``version``: whether ``version``'s manifest
        is gone. gc takes a manifest above the head older than its grace period for one its writer
        left (it died before the head); a writer that only stalled that long would leave a head on
        nothing, which no reader, publisher or gc gets past. The head is then moved back to
        ``replaced`` if it still names ``version`` (one HEAD request per commit)."""
        try:
            if self.store.head(version_key(version)) is not None:
                return False
        except StoreError as exc:  # the head moved: the version is committed unless shown otherwise
            log.warning(
                "version %d of %s: could not check it is still stored after its commit: %s", version, self.url, exc
            )
            return False
        current, etag = self.head()
        if current == version:
            if replaced is None:
                self.store.delete(HEAD_KEY)
            else:
                with contextlib.suppress(PreconditionFailedError):
                    self.store.put_if_match(HEAD_KEY, head_to_json(replaced), etag)
        return True

    def _drop_manifest(self, v: int, signing_key: SigningKey | None, data: bytes) -> bool:
        """Remove the manifest (and signature) this commit wrote (``data``) when it does not commit:
        left above the head, it made every later publish of another checkpoint fail ("already exists
        above its head") until gc's grace ran out, and one published past it listed the failed
        version. Returns False if the head names ``v`` (an identical publish committed it): then it
        stays, and one the head reached while it was deleted is put back, as gc does."""
        try:
            if self.head_version() == v:
                return False
            self.store.delete(version_key(v))
            if signing_key is not None:
                self.store.delete(signature_key(v))
            if self.head_version() != v:
                return True
            with contextlib.suppress(AlreadyExistsError):  # the head reached it meanwhile: back, create-only
                self.store.put(version_key(v), data, mode="create")
            if signing_key is not None:
                self.store.put(signature_key(v), signing_key.sign(v, data), mode="overwrite")
            return False
        except StoreError as exc:
            log.warning("version %d of %s: its commit failed, and its manifest stays: %s", v, self.url, exc)
            return True

    def _gone_chunks(self, ids: Iterable[str]) -> list[str]:
        """Those of the chunks ``ids`` that are not stored (HEAD requests, 32 at a time); a chunk whose
        check fails counts as stored (a store that cannot answer fails the head write anyway)."""
        ids = sorted(set(ids))

        def gone(chunk_id: str) -> bool:
            try:
                return self.store.head(chunk_key(chunk_id)) is None
            except StoreError as exc:
                log.warning("chunk %s of %s: could not check it is still stored: %s", chunk_id, self.url, exc)
                return False

        if len(ids) <= 1:
            return [c for c in ids if gone(c)]
        with ThreadPoolExecutor(min(32, len(ids)), thread_name_prefix="ws-check") as pool:
            return [c for c, g in zip(ids, pool.map(gone, ids)) if g]

    def _same_version(self, manifest: Manifest) -> bytes | None:
        """The stored manifest of ``manifest.version`` if it is above the head and describes the same
        files from the same parent (our own earlier write, or an identical re-publish); else None."""
        head = self.head_version()
        if head is not None and head >= manifest.version:
            return None  # a committed version is never replaced
        try:
            data = self.store.get(version_key(manifest.version))
            stored = manifest_from_json(data)
        except (FormatError, NotFoundError):
            return None
        files = lambda m: [(f.path, f.size, f.xxh3) for f in m.files]  # noqa: E731
        return data if stored.parent == manifest.parent and files(stored) == files(manifest) else None

    def set_head(self, version: int) -> None:
        """Point the head at ``version`` unconditionally (mirror and repair use)."""
        if not 0 <= version <= MAX_VERSION:
            raise VersionError(f"version {version} is outside the format's range 0..{MAX_VERSION}; head not moved")
        self.store.put(HEAD_KEY, head_to_json(version), mode="overwrite")


def verify_chunk(what: str, chunk_id: str, size: int, data: bytes | memoryview) -> None:
    """Raise :class:`ChecksumError` unless ``data`` is ``size`` bytes whose XXH3-128 is ``chunk_id``."""
    if len(data) != size:
        raise ChecksumError(what, f"{chunk_id} ({size} bytes)", f"{len(data)} bytes")
    actual = xxhash.xxh3_128_hexdigest(data)
    if actual != chunk_id:
        raise ChecksumError(what, chunk_id, actual)


StoreLike = str | os.PathLike | Store | Repo


def open_repo(
    store: StoreLike,
    *,
    retry: RetryPolicy | None = RetryPolicy(),
    trusted_keys: Keyring | Iterable[TrustedKey | SigningKey | str | os.PathLike] | None = None,
    **options,
) -> Repo:
    """A :class:`Repo` for a URL (``file://``, plain path, ``s3://``, ``memory://``), Store or Repo.

    A remote (``s3://``) store opened from a URL retries throttling, 5xx, timeouts and resets with
    ``retry`` (None: no retries). ``trusted_keys`` (public key files, :class:`TrustedKey` or a
    :class:`Keyring`): the repo uses only versions one of them signed; a Repo given with other
    trusted keys is reopened over the same store with these. An empty list is refused.
    """
    keys = Keyring.of(trusted_keys)
    if isinstance(store, Repo):
        return store if keys is None or keys == store.trusted_keys else store.trusting(keys)
    if isinstance(store, Store):
        return Repo(store, trusted_keys=keys)
    opened = open_store(store, **options)
    if retry is not None and str(store).startswith("s3://"):
        opened = RetryingStore(opened, retry)
    return Repo(opened, trusted_keys=keys)


@dataclass(frozen=True)
class VersionInfo:
    """One committed version as ``weightsync versions`` lists it: parent, keyframe flag, bytes of its
    files and of its own payloads, fraction of elements changed from the parent, creation time."""

    version: int
    parent: int | None
    keyframe: bool
    raw_bytes: int
    payload_bytes: int
    changed_fraction: float
    created: str


def versions(store: StoreLike) -> list[VersionInfo]:
    """Every committed version of ``store``, ascending, as :class:`VersionInfo`."""
    repo = open_repo(store)
    repo.require()
    out = []
    for v in repo.versions():
        m = repo.manifest(v)
        frac = m.stats.get("changed", 0) / max(1, m.stats.get("elements", 0) or 1)
        out.append(VersionInfo(v, m.parent, m.keyframe, m.raw_bytes, m.payload_bytes, frac, m.created))
    return out
