"""``dequantize`` checks its input against its format: codes in the format's storage dtype, and
an fp32 scale of the format's scale shape (or None for unscaled formats)."""

import pytest
import torch

from qstate.formats import QuantizedState, StateFormat, dequantize, quantize


def _q(fmt):
    return quantize(torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0)), fmt)


def test_fp8_codes_viewed_as_uint8_are_rejected():
    q = _q("fp8_e4m3:row")
    with pytest.raises(TypeError, match=r"^q: expected codes of dtype torch.float8_e4m3fn for fp8_e4m3:row, "
                                        r"got torch.uint8"):
        dequantize(QuantizedState(q.data.view(torch.uint8), q.scale, q.fmt))


def test_int8_codes_labelled_fp8_are_rejected():
    q = _q("int8:row")
    with pytest.raises(TypeError, match="^q: expected codes of dtype torch.float8_e4m3fn"):
        dequantize(QuantizedState(q.data, q.scale, StateFormat.parse("fp8_e4m3:row")))


def test_fp32_data_labelled_int8_is_rejected():
    q = _q("int8:row")
    with pytest.raises(TypeError, match="^q: expected codes of dtype torch.int8 for int8:row, got torch.float32"):
        dequantize(QuantizedState(q.data.float(), q.scale, q.fmt))


def test_unscaled_data_in_another_dtype_is_rejected():
    with pytest.raises(TypeError, match="^q: expected codes of dtype torch.bfloat16 for bf16, got torch.float32"):
        dequantize(QuantizedState(torch.zeros(2, 3, 4), None, StateFormat.parse("bf16")))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32])
def test_a_scale_other_than_fp32_is_rejected(dtype):
    q = _q("int8:row")
    with pytest.raises(TypeError, match=f"^q: expected an fp32 scale, got {dtype}"):
        dequantize(QuantizedState(q.data, q.scale.to(dtype), q.fmt))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "int8:row", "fp8_e5m2:head", "fp8_e4m3:block32"])
def test_well_formed_input_still_decodes(fmt):
    q = _q(fmt)
    assert dequantize(q).dtype == torch.float32
