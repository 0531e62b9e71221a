"""The tensor-core product (kernels/common/exact_dot.py) against fp64 under the interpreter: every state
format whose codes are exact in bf16, with bf16/fp16/fp32 inputs. ``bench/run_gpu.py`` runs the
same check on the GPU, where the tensor cores do the products."""

import pytest
import torch

from bench import cases_exact_dot
from qstate import formats
from qstate.kernels.common import exact_dot


def test_products_within_fp32_summation_of_exact_products():
    failures, report = cases_exact_dot.check_kernel(torch.device("cpu"))
    assert failures == []
    assert len(report) == len(cases_exact_dot.STATE_FORMATS) * len(cases_exact_dot.INPUT_DTYPES)


@pytest.mark.parametrize("text, exact", [
    ("bf16", True), ("fp8_e4m3:row", True), ("fp8_e5m2:head", True), ("int8:row", True), ("fp8_e4m3", True),
    ("fp32", False), ("fp16", False), ("fp8_e4m3:block32", False), ("int8:block32", False),
])
def test_which_formats_take_the_tensor_core_product(text, exact):
    assert exact_dot.exact_in_bf16(formats.StateFormat.parse(text)) is exact


def test_input_parts_name_the_dtype():
    assert [exact_dot.input_parts(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [1, 2, 3]
    with pytest.raises(TypeError, match="float64"):
        exact_dot.input_parts(torch.float64)
