"""The signatures of a version (docs/FORMAT.md section 7): the message a publisher's key signs, the
stored document that holds one or more signatures, and key ids.

Pure: bytes in, validated dataclasses out, and back. Which keys to trust and the Ed25519 arithmetic
are :mod:`weightsync.store.signing`'s."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass

from weightsync.errors import FormatError
from weightsync.format.keys import FORMAT_VERSION, MAX_VERSION

DOMAIN = b"weightsync-manifest-v1\x00"  # what the signed message starts with: never a valid message of another protocol
ALGORITHM = "ed25519"
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
MAX_SIGNATURES = 16  # signatures in one document (one per key signing the version)
MAX_DOCUMENT_BYTES = 64 << 10  # a larger document is refused before it is parsed
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Signature:
    """One key's signature of a version: the key's id (:func:`key_id`), the algorithm and the 64 bytes."""

    key_id: str
    signature: bytes
    algorithm: str = ALGORITHM


@dataclass(frozen=True)
class Signatures:
    """The document stored beside version ``version``'s manifest: the manifest's SHA-256 (hex) and the
    signatures of :func:`signed_message`, one per key."""

    version: int
    manifest_sha256: str
    signatures: tuple[Signature, ...]


def key_id(raw_public_key: bytes) -> str:
    """A key's id: the first 8 bytes of the SHA-256 of its 32 raw public bytes, 16 hex digits.
    It names the key a signature was made with; the signature is still checked against the key."""
    return hashlib.sha256(raw_public_key).hexdigest()[:16]


def manifest_sha256(manifest: bytes) -> bytes:
    """The SHA-256 of a manifest's stored bytes (32 bytes; the document holds its hex)."""
    return hashlib.sha256(manifest).digest()


def signed_message(version: int, digest: bytes) -> bytes:
    """What a key signs for ``version`` whose stored manifest has the SHA-256 ``digest``
    (:func:`manifest_sha256`): :data:`DOMAIN`, the version as 8 bytes little-endian, the digest
    (63 bytes). A signature of one version is no signature of another, nor of anything but a
    weightsync manifest."""
    if not 0 <= version <= MAX_VERSION:
        raise FormatError(f"version {version} is outside the format's range 0..{MAX_VERSION}")
    if len(digest) != 32:
        raise FormatError(f"a manifest digest is 32 bytes, not {len(digest)}")
    return DOMAIN + version.to_bytes(8, "little") + digest


def signatures_to_json(doc: Signatures) -> bytes:
    """The stored document (sorted keys, no spaces)."""
    body = {
        "format": "weightsync.signatures",
        "format_version": FORMAT_VERSION,
        "version": doc.version,
        "manifest_sha256": doc.manifest_sha256,
        "signatures": [
            {"key_id": s.key_id, "algorithm": s.algorithm, "signature": base64.b64encode(s.signature).decode()}
            for s in doc.signatures
        ],
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signatures_from_json(data: bytes, what: str = "signatures") -> Signatures:
    """Parse and validate a stored signatures document; :class:`FormatError` says what is wrong.
    Checks the form only: whether a signature verifies is the reader's keyring's question."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise FormatError(f"{what}: {len(data)} bytes, over the {MAX_DOCUMENT_BYTES} a signatures document may have")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise FormatError(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what}: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != "weightsync.signatures":
        raise FormatError(f"{what}: not a weightsync signatures document")
    if doc.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"{what}: not of format version {FORMAT_VERSION}")
    version = doc.get("version")
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise FormatError(f"{what}: field 'version' missing or out of range")
    digest = doc.get("manifest_sha256")
    if type(digest) is not str or not _SHA256.fullmatch(digest):
        raise FormatError(f"{what}: field 'manifest_sha256' is not 64 lowercase hex digits")
    entries = doc.get("signatures")
    if type(entries) is not list or not 1 <= len(entries) <= MAX_SIGNATURES:
        raise FormatError(f"{what}: field 'signatures' must be a list of 1 to {MAX_SIGNATURES} signatures")
    return Signatures(version, digest, tuple(_signature(e, f"{what} signature {i}") for i, e in enumerate(entries)))


def _signature(entry: object, what: str) -> Signature:
    if not isinstance(entry, dict):
        raise FormatError(f"{what}: not an object")
    kid, algorithm, text = entry.get("key_id"), entry.get("algorithm"), entry.get("signature")
    if type(kid) is not str or not _KEY_ID.fullmatch(kid):
        raise FormatError(f"{what}: 'key_id' is not 16 lowercase hex digits")
    if algorithm != ALGORITHM:
        raise FormatError(f"{what}: algorithm must be {ALGORITHM!r}")
    if type(text) is not str:
        raise FormatError(f"{what}: 'signature' must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise FormatError(f"{what}: 'signature' is not base64") from None
    if len(raw) != SIGNATURE_BYTES:
        raise FormatError(f"{what}: 'signature' holds {len(raw)} bytes, not {SIGNATURE_BYTES}")
    return Signature(kid, raw, algorithm)
