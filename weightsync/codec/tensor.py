"""Former home of the tensor codecs, now :mod:`weightsync.codec.payload`: kept for the imports in
sync/, service/ and torch/ (publish, pull, selection, flags, runtime, hostpatch)."""

from weightsync.codec.payload import (  # noqa: F401
    CodecConfig,
    EncodedTensor,
    encode_sparse_from_changes,
    encode_tensor,
    rebuild,
    warm_up,
)
from weightsync.codec.streams import SLICE_BYTES  # noqa: F401
