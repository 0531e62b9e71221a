"""kernels/pdl.py: programmatic dependent launch is a GPU-only launch option."""

import torch

from qstate.kernels.common import pdl


def test_pdl_is_off_for_cpu_tensors():
    # The interpreter runs CPU tensors: no griddepcontrol, no launch option.
    assert pdl.enabled(torch.device("cpu")) is False
    assert pdl.launch_options(False) == {}


def test_launch_options_ask_for_pdl_when_enabled():
    assert pdl.launch_options(True) == {"launch_pdl": True}
