"""How a tensor is coded: bit-exact block codecs (``abc.Codec``), a registry of them by stored id
and name (``registry``), one module per codec (``full``, ``sparse``, ``dense``, ``arith`` for
``ac``), what they share (``streams``), numba kernels and their cache (``kernels``, ``jit``), and
the payloads that hold them (``payload``).

**Adding a codec**: one module with a :class:`~weightsync.codec.abc.Codec` subclass (new ``id`` and
``name``) decorated with :func:`~weightsync.codec.registry.register`, listed in ``registry.BUILTIN``;
its name added to the codecs ``weightsync.format.manifest`` accepts and its layout to docs/FORMAT.md.
"""

from weightsync.codec.payload import CodecConfig, EncodedTensor, decode_tensor, encode_tensor, rebuild

__all__ = ["CodecConfig", "EncodedTensor", "decode_tensor", "encode_tensor", "rebuild"]
