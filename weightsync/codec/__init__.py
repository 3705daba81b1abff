"""How a tensor is coded: bit-exact codecs and the numba kernels beside them."""

from weightsync.codec.tensor import CodecConfig, EncodedTensor, decode_tensor, encode_tensor, rebuild

__all__ = ["CodecConfig", "EncodedTensor", "decode_tensor", "encode_tensor", "rebuild"]
