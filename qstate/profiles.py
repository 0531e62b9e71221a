"""Model profiles: layer shapes, parameter distributions and realistic decode inputs.

Two layer families, each with its own profile class:

* ``family = "mamba2"``: :class:`Profile` (Mamba-2 selective state update; inputs for
  :mod:`qstate.reference.mamba2`), distributions described in :mod:`qstate._mamba2_profile`;
* ``family = "gated_delta"``: :class:`DeltaRuleProfile` (gated delta rule, GDN and KDA; inputs for
  :mod:`qstate.reference.gated_delta`), distributions described in :mod:`qstate._delta_profile`.

:func:`get` and :func:`names` cover the built-in models of both; :func:`from_hf_config` reads a
transformers ``config.json``; :func:`calibrate` measures a model's own decode.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Union

from ._delta_config import delta_profile, is_delta_config
from ._delta_profile import PROFILES as _DELTA_PROFILES
from ._delta_profile import DeltaRuleInputs, DeltaRuleProfile, GateDistribution
from ._mamba2_profile import DecayDistribution, DecodeInputs, Profile
from ._profile_common import config_count
from .calibration import CalibratedDeltaProfile, CalibratedProfile, calibrate

__all__ = ["DecayDistribution", "Profile", "DecodeInputs", "GateDistribution", "DeltaRuleProfile",
           "DeltaRuleInputs", "FAMILIES", "get", "names", "from_hf_config", "calibrate", "CalibratedProfile",
           "CalibratedDeltaProfile"]

FAMILIES = ("mamba2", "gated_delta")
AnyProfile = Union[Profile, DeltaRuleProfile]

_PROFILES = {
    p.name: p
    for p in (
        Profile("mamba2-2.7b", 80, 64, 128, 1, 64),
        Profile("nemotron-h-8b", 128, 64, 128, 8, 24),
        Profile("nemotron-nano-9b-v2", 128, 80, 128, 8, 27),
        Profile("nemotron-3-nano-30b-a3b", 64, 64, 128, 8, 23),
        Profile("nemotron-3-super-120b-a12b", 128, 64, 128, 8, 40),
        *_DELTA_PROFILES,
    )
}


def names(family: Optional[str] = None) -> list[str]:
    """Names of the built-in profiles, of one ``family`` (``"mamba2"``, ``"gated_delta"``) or all."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family: expected None or one of {list(FAMILIES)}, got {family!r}")
    return sorted(n for n, p in _PROFILES.items() if family is None or p.family == family)


def get(name: Union[str, Profile, DeltaRuleProfile]) -> AnyProfile:
    """The built-in profile called ``name`` (see :func:`names`); a profile is returned as it is."""
    if isinstance(name, (Profile, DeltaRuleProfile)):
        return name
    if not isinstance(name, str):
        raise TypeError(f"profile: expected a model name (str), a Profile or a DeltaRuleProfile, "
                        f"got {type(name).__name__}")
    if name not in _PROFILES:
        raise ValueError(f"profile: unknown model {name!r}; expected one of {names()}")
    return _PROFILES[name]


# One sequence's state of one layer; larger does not fit the kernels' 32-bit offsets.
MAX_STATE_ELEMENTS = 2**31

_ALIASES = {
    "nheads": ("mamba_num_heads", "num_heads"),
    "headdim": ("mamba_head_dim", "head_dim"),
    "dstate": ("ssm_state_size", "state_size"),
    "ngroups": ("mamba_n_groups", "n_groups"),
    "dt_min": ("mamba_dt_min", "time_step_min"),
    "dt_max": ("mamba_dt_max", "time_step_max"),
    "dt_floor": ("mamba_dt_init_floor", "time_step_floor"),
}


def _first(cfg: dict, key: str) -> Optional[tuple[str, object]]:
    """``(config key, value)`` of the first alias of ``key`` set in ``cfg``; None when none is."""
    return next(((k, cfg[k]) for k in _ALIASES[key] if cfg.get(k) is not None), None)


def _ssm_layers(cfg: dict) -> int:
    # A pattern or block list without Mamba layers describes a model with none: counting all
    # its layers instead would be wrong.
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if "M" not in pattern:
            raise ValueError(f"config: hybrid_override_pattern {pattern!r} has no Mamba-2 layer ('M')")
        return pattern.count("M")
    for key in ("layers_block_type", "layer_types"):
        block_types = cfg.get(key)
        if isinstance(block_types, list):
            count = sum(1 for b in block_types if str(b).lower() in ("mamba", "m"))
            if not count:
                raise ValueError(f"config: {key} {block_types!r} has no Mamba-2 layer ('mamba')")
            return count
    if cfg.get("num_hidden_layers") is None:
        raise ValueError("config: cannot count the SSM layers (no hybrid_override_pattern, layers_block_type, "
                         "layer_types or num_hidden_layers)")
    return config_count("num_hidden_layers", cfg["num_hidden_layers"])


def _read_config(config: Union[str, os.PathLike, dict]) -> tuple[dict, str]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as fh:
            try:
                cfg = json.load(fh)
            except json.JSONDecodeError as err:
                raise ValueError(f"config: expected JSON in {path}, got a syntax error: {err}") from None
            except UnicodeDecodeError as err:
                raise ValueError(f"config: expected UTF-8 JSON in {path}, got {err.reason} at byte {err.start}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"config: expected a JSON object in {path}, got a {type(cfg).__name__}")
        name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-config"
    elif isinstance(config, dict):
        cfg, name = config, config.get("_name_or_path", "hf-config")
    else:
        raise TypeError(f"config: expected a path or a dict, got {type(config).__name__}")
    return cfg, str(name)


def from_hf_config(config: Union[str, os.PathLike, dict]) -> Union[Profile, DeltaRuleProfile]:
    """A profile from a transformers ``config.json``, a path (file or folder) or a dict.

    Mamba-2 layers: Mamba2 and NemotronH configs give a :class:`Profile`. Delta-rule layers:
    Qwen3-Next, Qwen3.5, Qwen3.5-MoE (their ``text_config``), Kimi Linear and GLM-5.x-next
    configs give a :class:`DeltaRuleProfile` (see :func:`qstate._delta_config.delta_profile`).
    """
    cfg, name = _read_config(config)
    if is_delta_config(cfg):
        return delta_profile(cfg, name)
    fields = {k: _first(cfg, k) for k in ("nheads", "headdim", "dstate", "ngroups")}
    missing = [f"{k} ({' or '.join(_ALIASES[k])})" for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"config: not a Mamba-2 config; missing {', '.join(missing)}")
    shape = [config_count(*found) for found in fields.values()]
    if math.prod(shape[:3]) > MAX_STATE_ELEMENTS:
        raise ValueError(f"config: nheads × headdim × dstate = {' × '.join(map(str, shape[:3]))} state elements "
                         f"per sequence, expected at most 2**31 (the kernels' 32-bit offsets)")
    layers = _ssm_layers(cfg)
    steps = {k: found for k in ("dt_min", "dt_max", "dt_floor") if (found := _first(cfg, k)) is not None}
    try:
        decay = DecayDistribution(**{k: value for k, (_, value) in steps.items()})
    except (TypeError, ValueError) as err:
        given = ", ".join(f"{key} = {value!r}" for key, value in steps.values())
        raise type(err)(f"config: time steps ({given}): {err}") from None
    return Profile(str(name), *shape, layers, decay)
