"""dtype names and resolve_dtype: one rule for checkpoints, the engine and random models."""

import pytest
import torch

from detinfer.dtypes import DTYPES, LOAD_DTYPES, dtype_name, resolve_dtype


def test_resolve_dtype():
    assert resolve_dtype(None, None) is torch.float32
    assert resolve_dtype(None, torch.bfloat16, "cuda") is torch.bfloat16  # None: the checkpoint's, any device
    assert resolve_dtype("auto", torch.float16, "cuda") is torch.float16
    assert resolve_dtype("auto", None, "cuda") is torch.bfloat16
    assert resolve_dtype("auto", torch.bfloat16, "cpu") is torch.float32
    assert resolve_dtype("float64", None) is torch.float64 and resolve_dtype(torch.float16) is torch.float16
    for name, dt in LOAD_DTYPES.items():
        assert dtype_name(dt) == name and resolve_dtype(name) is dt
    assert set(DTYPES) == {"float32", "float16", "bfloat16"}
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype(torch.int32)

