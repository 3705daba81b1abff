"""Store keys and limits (docs/FORMAT.md): where the marker, head, manifests, signatures, parts,
chunks and fleet records live, the bounds readers enforce, and the check every stored file path passes."""

from __future__ import annotations

import re

from weightsync.errors import FormatError

FORMAT_VERSION = 1
STATE_DIR = ".weightsync"  # a local folder's own state (docs/FORMAT.md section 5): never published nor installed


MARKER_KEY = "weightsync.json"
HEAD_KEY = "HEAD"
VERSIONS_PREFIX = "versions/"
CHUNKS_PREFIX = "chunks/"
FLEET_PREFIX = "fleet/"
PARTS_PREFIX = "parts/"
SIGNATURES_PREFIX = "signatures/"
LAZY_PREFIX = "lazy/"
MAX_WORLD = 99999  # ranks of one multi-rank publish (part keys hold five digits)
MAX_VERSION = 10**18
MAX_SIZE = 1 << 50  # 1 PiB: larger declared sizes are rejected as hostile
MAX_PATH_BYTES = 4096  # a file path, UTF-8 (Linux PATH_MAX)
MAX_PATH_DEPTH = 255  # components of a file path
MAX_NAME_BYTES = 255  # one component, UTF-8 (NAME_MAX)
MAX_INFO_DEPTH = 32  # nesting of the informational objects (codec_config, stats)
MAX_SHAPE_DIMS = 64  # dimensions of a segment's shape


def version_key(version: int) -> str:
    """The key of ``version``'s manifest."""
    return f"{VERSIONS_PREFIX}{version:020d}.json"


def parse_version_key(key: str) -> int | None:
    """The version a manifest key names, or None for any other key."""
    m = re.fullmatch(r"versions/([0-9]{20})\.json", key)
    return int(m.group(1)) if m else None


def signature_key(version: int) -> str:
    """The key of ``version``'s signatures (docs/FORMAT.md section 7)."""
    return f"{SIGNATURES_PREFIX}{version:020d}.json"


def parse_signature_key(key: str) -> int | None:
    """The version a signatures key names, or None for any other key."""
    m = re.fullmatch(r"signatures/([0-9]{20})\.json", key)
    return int(m.group(1)) if m else None


def lazy_key(version: int) -> str:
    """The key of the note saying which chunks of ``version`` a mirror has not copied yet (section 1)."""
    return f"{LAZY_PREFIX}{version:020d}.json"


def parse_lazy_key(key: str) -> int | None:
    """The version a lazy-chunks note names, or None for any other key."""
    m = re.fullmatch(r"lazy/([0-9]{20})\.json", key)
    return int(m.group(1)) if m else None


def parts_prefix(version: int) -> str:
    """Where the parts of a multi-rank publish of ``version`` live (section 6 of docs/FORMAT.md)."""
    return f"{PARTS_PREFIX}{version:020d}/"


def part_key(version: int, rank: int, world: int) -> str:
    """The key of rank ``rank`` of ``world``'s part of ``version``."""
    return f"{parts_prefix(version)}{rank:05d}-of-{world:05d}.json"


def refused_key(version: int, world: int) -> str:
    """The key of a committer's refusal of ``version``'s parts for a ``world``-rank publish (section 6
    of docs/FORMAT.md)."""
    return f"{parts_prefix(version)}refused-of-{world:05d}.json"


def parse_refused_key(key: str) -> tuple[int, int] | None:
    """``(version, world)`` of a refusal key, or None for any other key."""
    m = re.fullmatch(r"parts/([0-9]{20})/refused-of-([0-9]{5})\.json", key)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_part_key(key: str) -> tuple[int, int, int] | None:
    """``(version, rank, world)`` of a part key, or None for any other key."""
    m = re.fullmatch(r"parts/([0-9]{20})/([0-9]{5})-of-([0-9]{5})\.json", key)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}\Z")  # \Z: "$" takes a final newline
"""A daemon's id (a subscriber's names its fleet record's key)."""


def chunk_key(chunk_id: str) -> str:
    """The key of a chunk (fanned out by the id's first two hex digits)."""
    return f"{CHUNKS_PREFIX}{chunk_id[:2]}/{chunk_id}"


def parse_chunk_key(key: str) -> str | None:
    """The chunk id of a chunk key, or None for any other key (under ``chunks/`` or not)."""
    m = re.fullmatch(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{30})", key)
    return m.group(2) if m else None


def check_path(path: str) -> str:
    """A file path from a manifest: relative, normalized, inside the target, not ``.weightsync``,
    and one that file systems take: at most MAX_PATH_BYTES, MAX_PATH_DEPTH components of at most
    MAX_NAME_BYTES each (a deeper path overflowed the stack of recursive ``mkdir(parents=True)``)."""
    parts = path.split("/")
    try:
        raw = path.encode("utf-8", "surrogateescape")  # as os.fsencode: the bytes of the file name
    except UnicodeEncodeError:  # a lone surrogate names no file
        raw = None
    if (
        raw is None
        or not path
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(p in ("", ".", "..") for p in parts)
        or parts[0] == ".weightsync"
    ):
        why = ""
    elif len(raw) > MAX_PATH_BYTES:
        why = f" (over {MAX_PATH_BYTES} bytes)"
    elif len(parts) > MAX_PATH_DEPTH:
        why = f" (over {MAX_PATH_DEPTH} components)"
    elif max(map(len, raw.split(b"/"))) > MAX_NAME_BYTES:
        why = f" (a component over {MAX_NAME_BYTES} bytes)"
    else:
        return path
    shown = repr(path) if len(path) <= 200 else f"{path[:100]!r}... ({len(path)} characters)"
    raise FormatError(f"unsafe file path in manifest{why}: {shown}")
