"""safetensors dtypes as torch dtypes, and the integer views the torch integration moves bits through."""

from __future__ import annotations

import numpy as np
import torch

# torch dtype -> safetensors dtype (the subset weightsync stores that torch has a dtype for)
ST_DTYPE: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


TORCH_DTYPE: dict[str, torch.dtype] = {v: k for k, v in ST_DTYPE.items()}


# element width -> the integer dtype a tensor's bits are viewed as (signed above one byte: torch
# supports every operation the integration needs on those), in torch and in numpy
TORCH_INT: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


NP_INT: dict[int, type] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
