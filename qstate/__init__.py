"""qstate: numerics of quantized SSM decode state.

Public API (see README.md):

* formats: :class:`StateFormat`, :func:`quantize`, :func:`dequantize`, :class:`QuantizedState`
* :mod:`qstate.reference`: fp64 recurrences (exact, naive quantized, replay)
* :mod:`qstate.profiles`: model shapes and realistic decode inputs
"""

from . import formats, profiles, reference
from .formats import QuantizedState, StateFormat, dequantize, quantize
from .ops import selective_state_update
from .cache import ReplayCache
from .ops.replay import replay_decode

__version__ = "0.1.0"

__all__ = [
    "QuantizedState",
    "ReplayCache",
    "StateFormat",
    "dequantize",
    "formats",
    "profiles",
    "quantize",
    "reference",
    "replay_decode",
    "selective_state_update",
]
