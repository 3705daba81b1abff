"""How a tensor is coded: bit-exact block codecs, a registry of them, and the payloads that hold them.

Modules:

- :mod:`~weightsync.codec.abc`: :class:`~weightsync.codec.abc.Codec`, the one interface of a block
  codec (id, name, ``supports(dtype)``, ``encode``/``decode`` of a block against the base);
- :mod:`~weightsync.codec.registry`: the codecs by id (as payloads store them) and by name (as
  manifests do);
- the codecs, one module each: :mod:`~weightsync.codec.full` (1), :mod:`~weightsync.codec.sparse`
  (2), :mod:`~weightsync.codec.dense` (3), :mod:`~weightsync.codec.arith` (4, ``ac``, with its
  numba kernels);
- :mod:`~weightsync.codec.streams`: what they share (byte planes, zigzag, zstd frames);
- :mod:`~weightsync.codec.kernels` and :mod:`~weightsync.codec.jit`: numba kernels and their cache;
- :mod:`~weightsync.codec.payload`: the payload container, which codec codes a tensor
  (:func:`encode_tensor`), :func:`decode_tensor`, :func:`rebuild` and ``warm_up``.

**Adding a codec.** Write one module: a :class:`~weightsync.codec.abc.Codec` subclass with a new
``id`` and ``name``, decorated with :func:`weightsync.codec.registry.register`, and add the module
to :data:`weightsync.codec.registry.BUILTIN` (imported on the first lookup). Decoding then finds
it by the name a manifest gives and checks the id in the payload. Encoding with it is a choice of
:func:`~weightsync.codec.payload.encode_tensor`'s. A new id is a change of the stored format:
document it in docs/FORMAT.md ("Payloads") and add its name to the manifest's codec names
(``weightsync.format.manifest``), or readers refuse it.
"""

from weightsync.codec.payload import CodecConfig, EncodedTensor, decode_tensor, encode_tensor, rebuild

__all__ = ["CodecConfig", "EncodedTensor", "decode_tensor", "encode_tensor", "rebuild"]
