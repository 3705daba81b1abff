"""Ed25519 keys: a publisher's :class:`SigningKey` signs what it commits, a reader's :class:`Keyring`
(the public keys it trusts) checks every manifest before anything uses it (docs/FORMAT.md
section 7; key files: docs/OPERATIONS.md, "Signed versions").

Key files: a private key is PEM PKCS#8 (``-----BEGIN PRIVATE KEY-----``, as ``weightsync keygen``
and ``openssl genpkey -algorithm ed25519`` write it) or an unencrypted OpenSSH private key
(``ssh-keygen -t ed25519 -N ''``). A public key file holds one or more keys, each an OpenSSH line
(``ssh-ed25519 AAAA... comment``, as ``weightsync keygen`` writes ``OUT.pub``) or a PEM
``PUBLIC KEY`` block; blank lines and lines starting with ``#`` are skipped."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from weightsync.errors import FormatError, SignatureError, UsageError
from weightsync.format.signatures import (
    Signature,
    Signatures,
    key_id,
    manifest_sha256,
    signatures_from_json,
    signatures_to_json,
    signed_message,
)

_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----.*?-----END \1-----", re.DOTALL)
MAX_KEY_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class TrustedKey:
    """A public key a reader trusts: its id (:func:`weightsync.format.signatures.key_id`), its raw
    32 bytes, and where it was read from (for messages)."""

    key_id: str
    raw: bytes = field(repr=False)
    source: str = field(default="", compare=False)

    def verifies(self, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` is this key's Ed25519 signature of ``message``."""
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
            return True
        except InvalidSignature:
            return False

    def openssh(self) -> str:
        """The key as one OpenSSH line, its id as the comment (what ``weightsync keygen`` writes)."""
        line = Ed25519PublicKey.from_public_bytes(self.raw).public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        return f"{line.decode()} weightsync:{self.key_id}"


def _trusted(public: Ed25519PublicKey, source: str) -> TrustedKey:
    raw = public.public_bytes(*_RAW)
    return TrustedKey(key_id(raw), raw, source)


@dataclass(frozen=True)
class SigningKey:
    """A publisher's private key (never printed) and its id."""

    key_id: str
    private: Ed25519PrivateKey = field(repr=False, compare=False)
    source: str = field(default="", compare=False)

    @classmethod
    def generate(cls) -> SigningKey:
        """A new random key."""
        return cls.of(Ed25519PrivateKey.generate())

    @classmethod
    def of(cls, private: Ed25519PrivateKey, source: str = "") -> SigningKey:
        """The signing key of a ``cryptography`` Ed25519 private key."""
        return cls(key_id(private.public_key().public_bytes(*_RAW)), private, source)

    def public(self) -> TrustedKey:
        """The public half, as a reader trusts it."""
        return _trusted(self.private.public_key(), self.source)

    def sign(self, version: int, manifest: bytes) -> bytes:
        """The signatures document (docs/FORMAT.md section 7) of ``version`` whose stored manifest
        is ``manifest``, signed with this key alone."""
        digest = manifest_sha256(manifest)
        sig = Signature(self.key_id, self.private.sign(signed_message(version, digest)))
        return signatures_to_json(Signatures(version, digest.hex(), (sig,)))

    def pem(self) -> bytes:
        """The private key as PEM PKCS#8, unencrypted (protect the file instead)."""
        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


@dataclass(frozen=True)
class Keyring:
    """The public keys a reader trusts (at least one): a version is used only if one of them signed
    it (:meth:`verify`). Two keys while a publisher's key is rotated, one otherwise."""

    keys: tuple[TrustedKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise UsageError("no trusted key given: a keyring that trusts nothing would refuse every version")

    @property
    def ids(self) -> tuple[str, ...]:
        """The trusted keys' ids, each once, in order."""
        return tuple(dict.fromkeys(k.key_id for k in self.keys))

    @classmethod
    def of(cls, items: Keyring | Iterable[TrustedKey | SigningKey | str | os.PathLike] | None) -> Keyring | None:
        """A keyring from trusted keys, signing keys (their public halves) or public key files;
        None stays None (no checks). An empty list is refused, never taken as "no checks"."""
        if items is None or isinstance(items, Keyring):
            return items
        if isinstance(items, (str, os.PathLike)):
            items = [items]
        keys: list[TrustedKey] = []
        for item in items:
            if isinstance(item, TrustedKey):
                keys.append(item)
            elif isinstance(item, SigningKey):
                keys.append(item.public())
            elif isinstance(item, (str, os.PathLike)):
                keys.extend(read_public_keys(item))
            else:
                raise UsageError(f"a trusted key is a public key file or a TrustedKey, not {type(item).__name__}")
        return cls(tuple(dict.fromkeys(keys)))

    def verify(self, where: str, version: int, manifest: bytes, document: bytes | None) -> TrustedKey:
        """The trusted key that signed ``version`` whose stored manifest is ``manifest``, given its
        signatures ``document`` (None: there is none). Raises :class:`SignatureError` (``where``
        names the version in its one line) unless one of the keys signed exactly these bytes as
        this version."""
        trusted = f"trusted key{'s' if len(self.ids) > 1 else ''} {', '.join(self.ids)}"
        if document is None:
            raise SignatureError(where, version, f"it is not signed ({trusted})")
        try:
            doc = signatures_from_json(document, "its signatures")
        except FormatError as exc:
            raise SignatureError(where, version, f"malformed signatures ({exc})") from None
        if doc.version != version:
            raise SignatureError(where, version, f"its signatures are those of version {doc.version}")
        digest = manifest_sha256(manifest)
        if doc.manifest_sha256 != digest.hex():
            raise SignatureError(where, version, "the manifest is not the one signed (its SHA-256 differs)")
        known = [s for s in doc.signatures if s.key_id in self.ids]
        if not known:
            unknown = ", ".join(dict.fromkeys(s.key_id for s in doc.signatures))
            raise SignatureError(where, version, f"signed by unknown key {unknown} only ({trusted})")
        message = signed_message(version, digest)
        for sig in known:
            for key in self.keys:
                if key.key_id == sig.key_id and key.verifies(sig.signature, message):
                    return key
        bad = ", ".join(dict.fromkeys(s.key_id for s in known))
        raise SignatureError(where, version, f"the signature of key {bad} does not verify")


def _read(path: str | os.PathLike, what: str) -> bytes:
    try:  # without blocking on a FIFO (or a device) at open, and refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{what} {os.fspath(path)} is not a regular file")
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {what} {os.fspath(path)}: {exc.strerror or exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise UsageError(f"{what} {os.fspath(path)} is over {MAX_KEY_FILE_BYTES} bytes: not a key file")
    return data


def parse_public_keys(data: bytes, source: str) -> list[TrustedKey]:
    """The Ed25519 public keys in a public key file's bytes (module docstring); :class:`UsageError`
    names ``source`` unless there is at least one and every entry is one."""
    if b"PRIVATE KEY" in data:
        raise UsageError(f"{source} holds a private key: readers trust the public key (weightsync keygen's OUT.pub)")
    keys = []
    for m in _PEM_BLOCK.finditer(data):
        keys.append(_public_of(lambda: serialization.load_pem_public_key(m.group(0)), source))
    rest = _PEM_BLOCK.sub(b"", data)
    for line in rest.splitlines():
        line = line.strip()
        if line and not line.startswith(b"#"):
            keys.append(_public_of(lambda: serialization.load_ssh_public_key(line), source))
    if not keys:
        raise UsageError(f"{source} holds no public key")
    return keys


def _public_of(load, source: str) -> TrustedKey:
    try:
        key = load()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise UsageError(f"{source}: not an Ed25519 public key ({_first_line(exc)})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"{source}: a {type(key).__name__.removesuffix('PublicKey')} key; weightsync uses Ed25519")
    return _trusted(key, source)


def read_public_keys(path: str | os.PathLike) -> list[TrustedKey]:
    """The public keys of a file (:func:`parse_public_keys`)."""
    return parse_public_keys(_read(path, "public key file"), os.fspath(path))


def parse_signing_key(data: bytes, source: str) -> SigningKey:
    """The Ed25519 private key of a private key file's bytes (module docstring)."""
    if b"PRIVATE KEY-----" not in data:
        hint = " (it holds a public key: sign with the private one)" if data.lstrip().startswith(b"ssh-") else ""
        raise UsageError(f"{source}: not a PEM or OpenSSH private key{hint}")
    try:
        if b"BEGIN OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, None)
        else:
            key = serialization.load_pem_private_key(data, None)
    except TypeError:  # a password is needed
        raise UsageError(f"{source}: the key is encrypted; give an unencrypted key (and protect its file)") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise UsageError(f"{source}: not a usable private key ({_first_line(exc)})") from None
    if not isinstance(key, Ed25519PrivateKey):
        kind = type(key).__name__.removesuffix("PrivateKey")
        raise UsageError(f"{source}: a {kind} key; weightsync signs with Ed25519 (weightsync keygen)")
    return SigningKey.of(key, source)


def read_signing_key(path: str | os.PathLike) -> SigningKey:
    """The signing key of a private key file (:func:`parse_signing_key`)."""
    return parse_signing_key(_read(path, "signing key"), os.fspath(path))


def write_key_pair(out: str | os.PathLike) -> SigningKey:
    """A new key pair: the private key in ``out`` (PEM PKCS#8, mode 0600) and the public key in
    ``out.pub`` (one OpenSSH line). Refuses, writing nothing, if either file exists."""
    private, public = Path(out), Path(f"{os.fspath(out)}.pub")
    for p in (private, public):
        if os.path.lexists(p):
            raise UsageError(f"{p} exists; not overwriting a key (choose another name or remove it)")
    key = SigningKey.generate()
    _create(private, key.pem(), 0o600)
    try:
        _create(public, (key.public().openssh() + "\n").encode(), 0o644)
    except BaseException:
        private.unlink(missing_ok=True)
        raise
    return key


def _create(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except FileExistsError:
        raise UsageError(f"{path} exists; not overwriting a key") from None
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:120] if text else type(exc).__name__
