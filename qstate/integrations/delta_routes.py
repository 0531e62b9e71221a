"""Where one gated delta rule layer's one-token decode step goes once a model is patched.

transformers calls ``f(query, key, value, g=, beta=, initial_state=, output_final_state=,
use_qk_l2norm_in_kernel=)`` (``torch_recurrent_gated_delta_rule`` for Qwen3-Next / Qwen3.5,
``recurrent_kimi_delta_attention`` for Kimi Linear; docs/design.md#gdn-clients) with
``query, key (batch, 1, HK, K)`` (or HV heads, in releases that repeat them before the call),
``value (batch, 1, HV, V)``, ``g (batch, 1, HV)`` or ``(batch, 1, HV, K)``, ``beta (batch, 1, HV)``
and its cache's fp32 state ``initial_state (batch, HV, K, V)``, and copies the returned state
into its cache. A route turns those into qstate's compact shapes (state ``(slots, HV, V, K)``,
V-first; q and k with either head count, since value head ``h`` reads key head ``h // (HV/HK)``
in both), runs one qstate op on the state it keeps in the scheme's storage and returns the value
that storage holds, transposed back to ``(batch, HV, K, V)``, so that anything transformers does
with its cache sees qstate's state.

Releases before the hub-kernel wrappers (Qwen3-Next and Qwen3.5 up to about 5.19) bind the step
to each layer at construction, ``self.recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
or torch_recurrent_gated_delta_rule`` (fla's function when flash-linear-attention is installed),
and call it through that attribute: :func:`step_attributes` names such attributes, which the patch
routes like the module-level name and puts back on exit. Later releases resolve fla inside the
module-level function, so swapping that name routes every step with or without fla.

A route re-reads transformers' state (``sync``) whenever it is not bit for bit the state the
route last returned (rounded to the cache's dtype): the first step after a prefill (whose chunked function stays as
transformers has it), or a cache changed from outside (a reorder, a reset). The comparison and
the returned copy cost two state reads and a write per step: the patch measures numerics, it
does not save memory.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..formats import QuantizedState, StateFormat, dequantize, quantize
from .decode_routes import ForwardBracket, check_kernels_can_run

_SAME_SIZE_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# fla's one-token decode functions, which a layer of a binding release holds when fla is installed.
FLA_STEP_FUNCTIONS = ("fused_recurrent_gated_delta_rule", "fused_recurrent_kda")


def step_attributes(layer: torch.nn.Module, step: Callable) -> list[str]:
    """Names of ``layer``'s own attributes holding its one-token decode function: transformers'
    module-level ``step`` (as it was before any qstate patch) or one of fla's
    (:data:`FLA_STEP_FUNCTIONS`). The chunked (prefill) functions are not among them."""
    original = getattr(step, "__qstate_original__", step)
    return [name for name, value in vars(layer).items()
            if callable(value) and (value is original or getattr(value, "__name__", None) in FLA_STEP_FUNCTIONS)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, so that a NaN the route returned still counts as its own."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    bits = _SAME_SIZE_INTEGER.get(a.element_size()) if a.dtype.is_floating_point else None
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


class DeltaDecodeStep:
    """One decode token in qstate's shapes: ``q, k (batch, HQK, K)`` (HQK = HK or HV),
    ``v (batch, HV, V)``, ``g (batch, HV)`` or ``(batch, HV, K)`` fp32, ``beta (batch, HV)`` fp32;
    all contiguous. ``use_qk_l2norm`` as transformers asked; ``scale`` fla's keyword (None:
    ``K**-0.5``)."""

    def __init__(self, query, key, value, g, beta, use_qk_l2norm, scale=None):
        for name, t in (("query", query), ("key", key), ("value", value), ("g", g), ("beta", beta)):
            if t.dim() < 3 or t.shape[1] != 1:
                raise ValueError(f"{name}: expected a one-token decode input (batch, 1, ...), got shape "
                                 f"{tuple(t.shape)}")
        self.q = query[:, 0].contiguous()
        self.k = key[:, 0].contiguous()
        self.v = value[:, 0].contiguous()
        self.g = g[:, 0].float().contiguous()
        self.beta = beta[:, 0].float().contiguous()
        self.use_qk_l2norm = bool(use_qk_l2norm)
        self.scale = None if scale is None else float(scale)

    @property
    def gate(self) -> str:
        """``"channel"`` (KDA, one gate per key channel) or ``"scalar"`` (GDN)."""
        return "channel" if self.g.dim() == 3 else "scalar"


class DeltaLayerRoute(ForwardBracket):
    """Base of the delta-rule routes: bookkeeping shared by every scheme.

    Subclasses implement ``sync(state, step)`` (rebuild their storage from transformers' state,
    given V-first ``(batch, HV, V, K)``) and ``decode(step)`` (one token; returns
    ``o (batch, HV, V)`` and the fp32 V-first state the storage now holds).
    """

    def __init__(self, name: str):
        self.name = name
        self.steps = 0
        self._stale = True
        self._returned: Optional[torch.Tensor] = None
        self._stepped = False

    def __call__(self, original: Callable, query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        if initial_state is None or query.shape[1] != 1:
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        if kwargs.get("cu_seqlens") is not None:
            raise ValueError(f"cu_seqlens: layer {self.name}: packed sequences are not supported by the qstate "
                             f"patch; decode with one row per sequence")
        self._stepped = True
        if initial_state.device != value.device:
            raise ValueError(
                f"cache: layer {self.name}'s recurrent state is on {initial_state.device} but its inputs are on "
                f"{value.device}; keep the model and its cache on one device")
        step = DeltaDecodeStep(query, key, value, g, beta, use_qk_l2norm_in_kernel, kwargs.get("scale"))
        if self._stale or self._returned is None or not _bits_equal(initial_state,
                                                                    self._returned.to(initial_state.dtype)):
            check_kernels_can_run(initial_state.device)
            self.sync(initial_state.transpose(-1, -2), step)
        o, state = self.decode(step)
        self.steps += 1
        self._stale = False
        self._returned = state.transpose(-1, -2).contiguous()
        return o[:, None].to(query.dtype), (self._returned.clone() if output_final_state else None)

    def sync(self, state: torch.Tensor, step: DeltaDecodeStep) -> None:
        raise NotImplementedError

    def decode(self, step: DeltaDecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class DeltaConventionalRoute(DeltaLayerRoute):
    """The state stored in ``fmt`` and updated by :func:`qstate.gated_delta_update`.
    Stochastic formats key their noise with ``seed + step``."""

    def __init__(self, name: str, fmt: StateFormat, seed: int = 0):
        from ..ops.gated_delta import gated_delta_update

        super().__init__(name)
        self.fmt = fmt
        self.seed = int(seed)
        self._op = gated_delta_update
        self.codes: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None

    def sync(self, state, step):
        generator = torch.Generator(device=state.device).manual_seed(self.seed + self.steps)
        stored = quantize(state.float().contiguous(), self.fmt, generator=generator if self.fmt.stochastic else None)
        self.codes = stored.data.contiguous()
        self.scale = None if stored.scale is None else stored.scale.contiguous()

    def decode(self, step):
        o = self._op(
            self.codes, step.q, step.k, step.v, step.g, step.beta, scale=step.scale, use_qk_l2norm=step.use_qk_l2norm,
            state_scale=self.scale, state_format=str(self.fmt),
            seed=(self.seed + self.steps) % 2**31 if self.fmt.stochastic else None,  # the ops take 31-bit seeds
        )
        return o, dequantize(QuantizedState(self.codes, self.scale, self.fmt))


class DeltaReplayRoute(DeltaLayerRoute):
    """A :class:`qstate.GatedDeltaReplayCache` (checkpoint, input ring, read copy) and
    :func:`qstate.gated_delta_replay`. transformers' state receives ``cache.materialize``: the
    fp32 state with the ring folded in, which is what a prefill continuing from here starts from.
    ``use_qk_l2norm`` is fixed at each sync (the ring keeps raw keys); a change re-syncs."""

    def __init__(self, name: str, checkpoint: StateFormat, read: Optional[StateFormat], ring_len: int):
        from ..gated_delta_cache import GatedDeltaReplayCache
        from ..ops.gated_delta_replay import gated_delta_replay

        super().__init__(name)
        self.checkpoint, self.read, self.ring_len = checkpoint, read, ring_len
        self._allocate = GatedDeltaReplayCache.allocate
        self._op = gated_delta_replay
        self.cache = None
        self.slots: Optional[torch.Tensor] = None
        self._l2norm: Optional[bool] = None

    def __call__(self, original, query, key, value, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        if self._l2norm is not None and bool(use_qk_l2norm_in_kernel) != self._l2norm:
            self._stale = True
        return super().__call__(original, query, key, value, g, beta, initial_state=initial_state,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

    def sync(self, state, step):
        batch, num_v_heads, head_v_dim, head_k_dim = state.shape
        num_k_heads = step.k.shape[1]
        cache = self.cache
        if (cache is None or cache.num_slots != batch or cache.device != state.device
                or cache.input_dtype != step.k.dtype or cache.num_k_heads != num_k_heads or cache.gate != step.gate):
            self.cache = self._allocate(
                batch, num_k_heads, num_v_heads, head_k_dim, head_v_dim, gate=step.gate, ring_len=self.ring_len,
                checkpoint=str(self.checkpoint), read=None if self.read is None else str(self.read),
                input_dtype=step.k.dtype, device=state.device)
            self.slots = torch.arange(batch, device=state.device, dtype=torch.int32)
        self.cache.reset(self.slots, state)
        self._l2norm = step.use_qk_l2norm

    def decode(self, step):
        v = step.v.to(self.cache.input_dtype)
        o = self._op(self.cache, step.q, step.k, v, step.g, step.beta, scale=step.scale,
                     use_qk_l2norm=step.use_qk_l2norm, slot_indices=self.slots)
        return o, self.cache.materialize(self.slots, use_qk_l2norm=step.use_qk_l2norm)
