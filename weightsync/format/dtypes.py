"""The safetensors dtype table: element width and the unsigned integer view used for bit-exact math."""

from __future__ import annotations

import numpy as np

from weightsync.errors import CheckpointError

# safetensors dtype name -> element size in bytes. Every codec works on unsigned integer views of
# this width, so float payloads (NaN bits, -0.0, subnormals) are never touched by float arithmetic.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


EXPONENT_FIELD: dict[str, tuple[int, int]] = {
    "BF16": (7, 8),
    "F16": (10, 5),
    "F32": (23, 8),
}
"""dtype -> (shift, bits) of the exponent field within the unsigned view (the sign bit excluded): the
context of the ``ac`` and ``ans`` codecs; other dtypes have one context."""


UINT_VIEW: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}
INT_VIEW: dict[int, np.dtype] = {
    1: np.dtype("<i1"),
    2: np.dtype("<i2"),
    4: np.dtype("<i4"),
    8: np.dtype("<i8"),
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype; :class:`CheckpointError` for one this code does not know."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise CheckpointError(f"unsupported safetensors dtype {dtype!r}") from None
