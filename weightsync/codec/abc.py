"""The interface every block codec implements (docs/FORMAT.md, "Payloads").

A codec codes one block of a payload: at most ``block_elems`` elements of one tensor, as the
unsigned integer view of the element width (``<u1``, ``<u2``, ``<u4``, ``<u8``). The payload
container around the blocks (header, block lengths) and the choice of a codec per tensor are
:mod:`weightsync.codec.payload`'s; a codec sees only its block and the same block of the base.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from weightsync.format.dtypes import ITEMSIZE

if TYPE_CHECKING:
    from weightsync.codec.payload import CodecConfig


class Codec(ABC):
    """One block codec, registered under the id its payloads store (:mod:`weightsync.codec.registry`).

    **Bit-exact.** Every operation is on the unsigned integer view of the element width, arithmetic
    wraps modulo 2^(8w): NaN payloads, -0.0, infinities and subnormals round-trip bit for bit, and
    ``decode(encode(old, new))`` writes exactly ``new``. ``encode`` is deterministic: the same
    block, base and config give the same bytes on every machine (those bytes are the stored
    format, pinned by tests/fixtures/golden).

    **Thread-safe.** A codec is a stateless singleton: any number of threads may encode or decode
    different blocks with it at once (zstd contexts are per thread, the numba kernels release the
    GIL). A decode writes only its ``out``.

    **Hostile input.** ``decode`` checks everything it reads and raises
    :class:`~weightsync.errors.FormatError` (naming ``what``) for a block that does not decode to
    exactly ``out.size`` elements; it never reads or writes outside its arrays.
    """

    id: ClassVar[int]
    """The codec id as stored in a payload's header (1..255, unique)."""

    name: ClassVar[str]
    """The codec's name as stored in a manifest's ``codec`` fields (unique)."""

    needs_base: ClassVar[bool] = True
    """Whether blocks are coded against the same block of the base (False for ``full`` only)."""

    invertible: ClassVar[bool] = False
    """Whether a block can also be decoded backward (:meth:`decode_backward`): the base it was
    coded against recovered from the block and its result alone. True for codecs that store the
    differences themselves (``sparse``, ``dense``) or list what the new values' contexts cannot
    give (``ans``); False where decoding needs the old values (``ac``'s contexts) or there is no
    base (``full``)."""

    apart: ClassVar[bool] = False
    """Whether a payload keeps what only a backward decode reads apart, in a reverse payload
    (:meth:`encode_apart`; ``ans``'s exception lists): a forward pull then never fetches it."""

    def supports(self, dtype: str) -> bool:
        """Whether the codec takes elements of safetensors ``dtype`` (every dtype unless overridden)."""
        return dtype in ITEMSIZE

    @abstractmethod
    def encode(self, dtype: str, old: np.ndarray | None, new: np.ndarray, config: CodecConfig) -> tuple[bytes, int]:
        """The block coding ``new`` against ``old`` (same length and unsigned view; None when not
        :attr:`needs_base`), and how many elements differ from ``old`` (all of them without one).
        Never modifies its arguments."""

    def encode_apart(
        self, dtype: str, old: np.ndarray | None, new: np.ndarray, config: CodecConfig
    ) -> tuple[bytes, bytes, int]:
        """:meth:`encode` of a codec whose blocks keep their backward-only part apart (:attr:`apart`):
        the block, that part (empty where the block needs none) and the changed count. A backward
        decode is given the part as ``reverse``."""
        raise NotImplementedError(f"codec {self.name!r} keeps nothing apart")

    @abstractmethod
    def decode(
        self, dtype: str, block: memoryview, old: np.ndarray | None, out: np.ndarray, what: str, hasher=None
    ) -> None:
        """Write the elements ``block`` codes into ``out`` (the unsigned view, same length as
        ``old``). ``out`` may be ``old`` itself (decoding in place); any other overlap is refused
        before this is called. ``hasher`` (anything with ``update``), if given, is fed ``out``'s
        bytes once, in order, after or while they are written."""

    def decode_backward(
        self, dtype: str, block: memoryview, new: np.ndarray, out: np.ndarray, what: str, hasher=None
    ) -> None:
        """Write into ``out`` the base that ``block`` was coded against, given the block's result
        ``new`` (unsigned views of one length): ``decode_backward(encode(old, new), new)`` writes
        exactly ``old``. Only for :attr:`invertible` codecs (others raise NotImplementedError).
        ``out`` may be ``new`` itself (in place); ``hasher`` as :meth:`decode`'s. The same rules on
        hostile input as :meth:`decode`: :class:`~weightsync.errors.FormatError` naming ``what``
        for a block that does not fit ``out``, never a read or write outside the arrays."""
        raise NotImplementedError(f"codec {self.name!r} cannot decode backward")

    def __repr__(self) -> str:
        return f"<codec {self.name!r} (id {self.id})>"
