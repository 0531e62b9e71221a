"""fp64 plain-torch references, one module per layer family.

* :mod:`qstate.reference.mamba2`: Mamba-2 selective state update (exact, naive quantized, replay);
  its functions are also this package's own (``qstate.reference.decode_exact`` is Mamba-2's).
* :mod:`qstate.reference.gated_delta`: the gated delta rule of GDN and KDA layers.
"""

from . import gated_delta, mamba2
from .mamba2 import decode_exact, decode_naive, decode_replay, mamba2_step, process_dt

__all__ = ["mamba2_step", "decode_exact", "decode_naive", "decode_replay", "process_dt", "mamba2", "gated_delta"]
