"""Delta-rule profiles from transformers ``config.json`` files.

Field names are those of transformers' config classes:

* Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (GDN, scalar softplus gate): ``linear_num_key_heads``,
  ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``; Qwen3.5 keeps
  them in ``text_config``. Delta-rule layers are the ``"linear_attention"`` entries of
  ``layer_types``, or else every layer but each ``full_attention_interval``-th (4).
* Kimi Linear (KDA, per-channel softplus gate): ``linear_attn_config`` with ``num_heads``,
  ``head_dim`` and ``kda_layers`` (or the flat ``linear_num_heads``, ``linear_head_dim``); key and
  value heads are the same heads. Without a layer list, every layer but layers 4, 8, … (0-based).
* GLM-5.x-next (KDA, bounded gate): as Kimi Linear, with ``linear_lower_bound`` (or
  ``linear_attn_config.gate_lower_bound``; −5 by default); without a layer list, layers
  ``i % 4 != 3``.

A field a config leaves out takes its transformers default, as transformers itself does.
``linear_allow_neg_eigval`` (OLMo-hybrid's option) sets β's range to [0, 2].
"""

from __future__ import annotations

import numbers
from typing import Optional

from ._delta_profile import BOUNDED_INIT, GDN_INIT, KIMI_INIT, DeltaRuleProfile
from ._profile_common import config_count

__all__ = ["is_delta_config", "delta_profile"]

_GDN_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_KDA_KEYS = ("linear_attn_config", "linear_num_heads", "linear_head_dim")
_GDN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_KIMI_TYPES = ("kimi_linear",)
_GLM_TYPES = ("glm5_next", "glm5_next_text")
# transformers' defaults per model type: (num_hidden_layers, GDN heads (HK, HV) or KDA heads).
_DEFAULT_LAYERS = {"qwen3_next": 48, "qwen3_5": 32, "qwen3_5_text": 32, "qwen3_5_moe": 40, "qwen3_5_moe_text": 40,
                   "kimi_linear": 27, "glm5_next": 45, "glm5_next_text": 45}
_GDN_DEFAULTS = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                     linear_value_head_dim=128)
_KDA_DEFAULT_DIM = 128
_KDA_DEFAULT_HEADS = {"kimi_linear": 32, "glm5_next": 64, "glm5_next_text": 64}
_FULL_ATTENTION_INTERVAL = 4
_DEFAULT_LOWER_BOUND = -5.0


def _text(cfg: dict) -> dict:
    """The language model's config: ``text_config`` when a multimodal config nests it."""
    text = cfg.get("text_config")
    return {**text, "model_type": text.get("model_type", cfg.get("model_type"))} if isinstance(text, dict) else cfg


def is_delta_config(cfg: dict) -> bool:
    """Whether ``cfg`` describes a model with gated delta rule layers."""
    text = _text(cfg)
    kind = str(text.get("model_type", ""))
    return kind in _GDN_TYPES + _KIMI_TYPES + _GLM_TYPES or any(k in text for k in _GDN_KEYS + _KDA_KEYS)


def _layers(text: dict, kind: str, kda_layers) -> int:
    types = text.get("layer_types")
    if isinstance(types, list):
        count = sum(1 for t in types if t == "linear_attention")
        if not count:
            raise ValueError(f"config: layer_types {types!r} has no delta-rule layer ('linear_attention')")
        return count
    if isinstance(kda_layers, list):
        if not kda_layers:
            raise ValueError("config: linear_attn_config.kda_layers is empty: no delta-rule layer")
        return len(kda_layers)
    total = text.get("num_hidden_layers", _DEFAULT_LAYERS.get(kind))
    if total is None:
        raise ValueError("config: cannot count the delta-rule layers (no layer_types, linear_attn_config.kda_layers "
                         "or num_hidden_layers)")
    total = config_count("num_hidden_layers", total)
    if kind in _KIMI_TYPES:
        return sum(1 for i in range(total) if not (i and i % 4 == 0))
    if kind in _GLM_TYPES:
        return sum(1 for i in range(total) if i % 4 != 3)
    interval = config_count("full_attention_interval", text.get("full_attention_interval", _FULL_ATTENTION_INTERVAL))
    return sum(1 for i in range(total) if (i + 1) % interval)


def _lower_bound(text: dict, linear: dict, kind: str) -> Optional[float]:
    """The bounded gate's lower bound, or None for the softplus gate."""
    for source, key in ((linear, "gate_lower_bound"), (text, "linear_lower_bound")):
        if key in source:
            value = source[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or value >= 0):
                raise ValueError(f"config: {key}: expected None or a number < 0, got {value!r}")
            return None if value is None else float(value)
    return _DEFAULT_LOWER_BOUND if kind in _GLM_TYPES else None


def delta_profile(cfg: dict, name: str) -> DeltaRuleProfile:
    """The :class:`DeltaRuleProfile` of a delta-rule ``config.json`` (see the module docstring)."""
    text = _text(cfg)
    kind = str(text.get("model_type", ""))
    linear = text.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise ValueError(f"config: linear_attn_config: expected an object, got {type(linear).__name__}")
    neg = text.get("linear_allow_neg_eigval", False)
    if not isinstance(neg, bool):
        raise ValueError(f"config: linear_allow_neg_eigval: expected true or false, got {neg!r}")
    is_kda = kind in _KIMI_TYPES + _GLM_TYPES or (kind not in _GDN_TYPES and any(k in text for k in _KDA_KEYS))
    layers = _layers(text, kind, linear.get("kda_layers"))
    if not is_kda:
        HK, HV, K, V = (config_count(key, text.get(key, _GDN_DEFAULTS[key])) for key in _GDN_KEYS)
        if HV % HK:
            raise ValueError(f"config: linear_num_value_heads: expected a multiple of linear_num_key_heads = {HK}, "
                             f"got {HV}")
        return DeltaRuleProfile(name, HK, HV, K, V, layers, gates=GDN_INIT, allow_neg_eigval=neg)
    heads = linear.get("num_heads", text.get("linear_num_heads", _KDA_DEFAULT_HEADS.get(kind)))
    if heads is None:
        raise ValueError("config: not a complete KDA config; missing linear_attn_config.num_heads (or linear_num_heads)")
    heads = config_count("num_heads", heads)
    dim = config_count("head_dim", linear.get("head_dim", text.get("linear_head_dim", _KDA_DEFAULT_DIM)))
    bound = _lower_bound(text, linear, kind)
    if bound is None:
        return DeltaRuleProfile(name, heads, heads, dim, dim, layers, gate="channel", gate_form="softplus",
                                gates=KIMI_INIT, allow_neg_eigval=neg)
    return DeltaRuleProfile(name, heads, heads, dim, dim, layers, gate="channel", gate_form="bounded",
                            gates=BOUNDED_INIT, lower_bound=bound, allow_neg_eigval=neg)
