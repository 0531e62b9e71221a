"""qstate: numerics of quantized SSM decode state.

Public API (see README.md):

* formats: :class:`StateFormat`, :func:`quantize`, :func:`dequantize`, :class:`QuantizedState`
* :mod:`qstate.reference`: fp64 recurrences (exact, naive quantized, replay)
* :mod:`qstate.profiles`: model shapes and realistic decode inputs
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Without a GPU the same Triton kernels run under the interpreter, which has to be chosen
    # before any kernel is defined; an explicit TRITON_INTERPRET setting is left alone.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from . import formats, profiles, reference  # noqa: E402
from .formats import QuantizedState, StateFormat, dequantize, quantize  # noqa: E402
from .ops import selective_state_update  # noqa: E402
from .cache import SLOT_BAD_CURSOR, SLOT_NONFINITE, ReplayCache  # noqa: E402
from .ops.replay import replay_decode  # noqa: E402
from .ops.speculative import replay_check_commits, replay_commit, replay_verify  # noqa: E402
from .ops.gated_delta import gated_delta_update  # noqa: E402
from .gated_delta_cache import GatedDeltaReplayCache  # noqa: E402
from .ops.gated_delta_replay import gated_delta_replay  # noqa: E402
from .ops.gated_delta_speculative import (gated_delta_commit_drafts, gated_delta_replay_check_commits,  # noqa: E402
                                          gated_delta_replay_commit, gated_delta_replay_verify,
                                          gated_delta_update_drafts)

__version__ = "0.1.0"

__all__ = [
    "QuantizedState",
    "ReplayCache",
    "SLOT_BAD_CURSOR",
    "SLOT_NONFINITE",
    "StateFormat",
    "GatedDeltaReplayCache",
    "dequantize",
    "formats",
    "gated_delta_commit_drafts",
    "gated_delta_replay",
    "gated_delta_replay_check_commits",
    "gated_delta_replay_commit",
    "gated_delta_replay_verify",
    "gated_delta_update",
    "gated_delta_update_drafts",
    "profiles",
    "quantize",
    "reference",
    "replay_decode",
    "replay_check_commits",
    "replay_commit",
    "replay_verify",
    "selective_state_update",
]
