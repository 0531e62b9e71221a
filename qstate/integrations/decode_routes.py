"""Where one Mamba-2 layer's one-token decode step goes once a model is patched.

transformers calls ``mamba2_selective_state_update(state, x, dt, A, B, C, D, dt_bias=…,
dt_softplus=True, z=…)`` with its own fp32 state tensor ``state (batch, nheads, headdim, dstate)``
and mamba_ssm's tied-stride expanded parameters. A route turns those into qstate's compact shapes
(docs/design.md#recurrence), runs one qstate op on the state it keeps in the scheme's storage, and writes
the value that storage holds back into transformers' tensor, so that anything transformers does
with its cache (a further prefill chunk, beam reordering, cropping) sees qstate's state. That
write, and the copy of it each route keeps (below), cost two fp32 state writes per step and one
more state per layer: the patch measures numerics, it does not save memory.

A route re-reads transformers' tensor (``sync``) whenever it may have changed behind its back:
the first step after a prefill, or a state that no longer holds the route's own last write. A
new tensor object holding exactly that write is followed, not re-read: transformers >= 5.25
steps a clone of its cache's state and copies it back, so every step brings a new object.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Callable, Optional

import torch

from ..formats import QuantizedState, StateFormat, dequantize, quantize
from ..reference import process_dt


@dataclasses.dataclass
class DecodeStep:
    """One decode token in compact shapes: ``x, z (batch, nheads, headdim)``, ``dt (batch, nheads)``,
    ``B, C (batch, ngroups, dstate)``, ``A, D, dt_bias (nheads,)``; all contiguous."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: Optional[torch.Tensor]
    z: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    dt_softplus: bool

    @classmethod
    def from_transformers(cls, x, dt, A, B, C, D, dt_bias, dt_softplus, z) -> "DecodeStep":
        """Compact views of transformers' arguments (expanded ones must be tied, stride 0)."""
        return cls(
            x=x.contiguous(), dt=_untie("dt", dt, 3).contiguous(), A=_untie("A", _untie("A", A, 3), 2).contiguous(),
            B=B.contiguous(), C=C.contiguous(),
            D=None if D is None else _untie("D", D, 2).contiguous(), z=None if z is None else z.contiguous(),
            dt_bias=None if dt_bias is None else _untie("dt_bias", dt_bias, 2).contiguous(),
            dt_softplus=bool(dt_softplus),
        )


def _untie(name: str, t: torch.Tensor, expanded_ndim: int) -> torch.Tensor:
    """Drop the last dimension of a tied-stride expanded tensor; leave a compact one as it is."""
    if t.dim() != expanded_ndim:
        return t
    if t.shape[-1] > 1 and t.stride(-1) != 0 and not torch.equal(t, t[..., :1].expand_as(t)):
        raise ValueError(
            f"{name}: expected mamba_ssm's tied form (the last dimension a stride-0 expansion), "
            f"got shape {tuple(t.shape)} with strides {t.stride()} and values that differ along it")
    return t[..., 0]


def check_kernels_can_run(device: torch.device) -> None:
    """qstate's Triton kernels run on CPU tensors only under the interpreter, which Triton reads
    when the kernels are defined: ``TRITON_INTERPRET=1`` must be set before ``import qstate``."""
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "device: the model is on the CPU, where qstate's kernels need the Triton interpreter; "
            "start Python with TRITON_INTERPRET=1 set (before importing qstate), or move the model to a GPU")


_SAME_SIZE_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, so that a NaN the route wrote still counts as its own."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    bits = _SAME_SIZE_INTEGER.get(a.element_size()) if a.dtype.is_floating_point else None
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _version(t: torch.Tensor) -> Optional[int]:
    """The tensor's in-place version counter; None where torch keeps none (inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


class ForwardBracket:
    """What a route does around each call of its patched layer (``begin_forward``, the call,
    ``end_forward``): a call that took no decode step (the chunked path ran: a prefill, or no
    cache was given) leaves transformers' state the truth, so the next step rebuilds from it.
    Subclasses set ``_stepped`` (a decode step ran in this call) and ``_stale``."""

    def begin_forward(self) -> None:
        self._stepped = False

    def end_forward(self) -> None:
        if not self._stepped:
            self._stale = True


class LayerRoute(ForwardBracket):
    """Base of the routes: bookkeeping shared by every scheme.

    Subclasses implement ``sync(state, step)`` (rebuild their storage from transformers' state)
    and ``decode(state, step)`` (one token; returns ``y (batch, nheads, headdim)`` and leaves
    transformers' ``state`` equal to what the storage holds).

    A write to ``state`` from outside (a prefill, a beam reorder, a reset) makes the next step
    rebuild the storage from it. The route keeps a copy of the state it last wrote (one more
    state per layer). The tensor it wrote, with its version counter unmoved, is its own; any
    other tensor, or one without a version counter (``torch.inference_mode`` keeps none), is
    compared with that copy bit for bit: equal, the route follows it (``follow``, for a route
    whose storage is transformers' tensor itself); different, it syncs.
    """

    def __init__(self, name: str):
        self.name = name
        self.steps = 0
        self._stale = True
        self._bound: Optional[weakref.ref] = None
        self._bound_version: Optional[int] = None
        self._written: Optional[torch.Tensor] = None
        self._stepped = False

    def _holds_own_write(self, state: torch.Tensor) -> bool:
        if self._stale or self._written is None:
            return False
        version = _version(state)
        if self._bound() is state and version is not None:
            return version == self._bound_version
        return _same_bits(state, self._written)

    def __call__(self, original: Callable, state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                 dt_softplus=False, z=None, **kwargs):
        self._stepped = True
        if state.device != hidden_states.device:
            raise ValueError(
                f"cache: layer {self.name}'s recurrent state is on {state.device} but its inputs are on "
                f"{hidden_states.device}; keep the model and its cache on one device")
        step = DecodeStep.from_transformers(hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z)
        if not self._holds_own_write(state):
            check_kernels_can_run(state.device)
            self.sync(state, step)
        elif self._bound() is not state:
            self.follow(state, step)
        y = self.decode(state, step)
        self.steps += 1
        self._stale = False
        self._bound = weakref.ref(state)
        self._bound_version = _version(state)
        self._written = state.clone()
        return y.to(hidden_states.dtype)

    def sync(self, state: torch.Tensor, step: DecodeStep) -> None:
        raise NotImplementedError

    def follow(self, state: torch.Tensor, step: DecodeStep) -> None:
        """``state`` is a new tensor holding exactly the route's last write; by default the
        storage is the route's own and needs nothing."""

    def decode(self, state: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        raise NotImplementedError


class ConventionalRoute(LayerRoute):
    """The state stored in ``fmt`` and updated by :func:`qstate.selective_state_update`.

    An fp32 format over transformers' own fp32 state updates that tensor in place.
    Stochastic formats key their noise with ``seed + step``.
    """

    def __init__(self, name: str, fmt: StateFormat, seed: int = 0):
        from ..ops.conventional import selective_state_update

        super().__init__(name)
        self.fmt = fmt
        self.seed = int(seed)
        self._op = selective_state_update
        self.codes: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self._in_place = False

    def _can_step_in_place(self, state) -> bool:
        return self.fmt.dtype == "fp32" and state.dtype == torch.float32 and state.is_contiguous()

    def sync(self, state, step):
        self._in_place = self._can_step_in_place(state)
        if self._in_place:
            self.codes, self.scale = state, None
            return
        generator = torch.Generator(device=state.device).manual_seed(self.seed + self.steps)
        stored = quantize(state, self.fmt, generator=generator if self.fmt.stochastic else None)
        self.codes = stored.data.contiguous()
        self.scale = None if stored.scale is None else stored.scale.contiguous()

    def follow(self, state, step):
        if not self._in_place:
            return
        # the storage is transformers' tensor itself: step the copy it now holds
        if self._can_step_in_place(state):
            self.codes = state
        else:
            self.sync(state, step)

    def decode(self, state, step):
        y = self._op(
            self.codes, step.x, step.dt, step.A, step.B, step.C, step.D, step.z, step.dt_bias, step.dt_softplus,
            state_scale=self.scale, state_format=str(self.fmt),
            seed=(self.seed + self.steps) % 2**31 if self.fmt.stochastic else None,  # the ops take 31-bit seeds
        )
        if not self._in_place:
            state.copy_(dequantize(QuantizedState(self.codes, self.scale, self.fmt)))
        return y


class ReplayRoute(LayerRoute):
    """A :class:`qstate.ReplayCache` (checkpoint, ring, read copy) and :func:`qstate.replay_decode`.

    After each step transformers' state receives ``cache.materialize``: the fp32 state with the
    ring folded in, which is what a prefill continuing from here must start from.
    """

    def __init__(self, name: str, checkpoint: StateFormat, read: Optional[StateFormat], ring_len: int,
                 seed: int = 0):
        from ..cache import ReplayCache
        from ..ops.replay import replay_decode

        super().__init__(name)
        self.checkpoint, self.read, self.ring_len, self.seed = checkpoint, read, ring_len, int(seed)
        self._allocate = ReplayCache.allocate
        self._op = replay_decode
        self.cache = None
        self.slots: Optional[torch.Tensor] = None

    def sync(self, state, step):
        batch, nheads, headdim, dstate = state.shape
        cache = self.cache
        if (cache is None or cache.num_slots != batch or cache.device != state.device
                or cache.input_dtype != step.x.dtype):
            self.cache = self._allocate(
                batch, nheads, headdim, dstate, step.B.shape[1], ring_len=self.ring_len,
                checkpoint=str(self.checkpoint), read=None if self.read is None else str(self.read),
                input_dtype=step.x.dtype, device=state.device, seed=self.seed)
            self.slots = torch.arange(batch, device=state.device, dtype=torch.int32)
        generator = torch.Generator(device=state.device).manual_seed(self.seed + self.steps)
        self.cache.reset(self.slots, state, generator=generator if self.checkpoint.stochastic else None)

    def decode(self, state, step):
        y = self._op(self.cache, step.x, step.dt, step.A, step.B, step.C, step.D, step.z, step.dt_bias,
                     step.dt_softplus, slot_indices=self.slots)
        state.copy_(self.cache.materialize(self.slots, step.A))
        return y


class ObserverRoute:
    """Runs transformers' own step and hands what it saw to ``record(step, dt, decay, state)``:
    the compact step, processed ``dt (batch, nheads)``, decay ``exp(dt·A) (batch, nheads)`` and the
    new state. Used by calibration."""

    def __init__(self, name: str, record: Callable):
        self.name = name
        self.steps = 0
        self._record = record

    def begin_forward(self) -> None:
        pass

    def end_forward(self) -> None:
        pass

    def __call__(self, original: Callable, state, hidden_states, dt, A, B, C, D=None, dt_bias=None,
                 dt_softplus=False, z=None, **kwargs):
        step = DecodeStep.from_transformers(hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z)
        y = original(state, hidden_states, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z, **kwargs)
        dtp = process_dt(step.dt.float(), None if step.dt_bias is None else step.dt_bias.float(), step.dt_softplus)
        self._record(step, dtp, torch.exp(dtp * step.A.float()), state)
        self.steps += 1
        return y
