"""Storage schemes of the decode state and what they cost (docs/design.md#conventional-decode, #replay).

A scheme is one of

* **conventional** ``fmt``: the state is stored in ``fmt`` and re-quantized every step
  (``fp32`` is today's serving default);
* **replay** ``(checkpoint, read, ring_len)``: an fp32 (or quantized) checkpoint, a ring of the
  last ``ring_len`` inputs and, optionally, a low-precision read copy of the checkpoint.

String form (used by the CLI, in tables and in JSON; :meth:`Scheme.parse` round-trips it):

====================================  ==============================================
``fp8_e4m3:row``                      conventional, state in that format
``replay/fp32/16``                    replay, fp32 checkpoint, no read copy, ring 16
``replay/fp32/fp8_e4m3:row/16``       replay, fp32 checkpoint, fp8 read copy, ring 16
``replay/fp32/fp8_e4m3:row/16/inputs``  delta rule: the same with the ring kind named
====================================  ==============================================

The ring kind (``inputs`` or ``corrected``, :data:`RING_KINDS`) applies to delta-rule layers
only (:mod:`qstate.reference.gated_delta`); without it a delta-rule replay keeps an ``inputs``
ring, and a Mamba-2 replay (whose ring always holds inputs) refuses ``corrected``.

Bytes are per state element (``headdim × dstate`` per head and sequence for Mamba-2, ``V × K``
for the delta rule); derivation in ``analysis/README.md``. Mamba-2 ring tokens hold ``x`` and
``B`` in ``input_bytes`` (bf16: 2) and an fp32 ``dt``; ``B`` is shared by the ``nheads / ngroups``
heads of a group. Delta-rule ring tokens hold ``k̂`` (shared by the ``HV / HK`` value heads of a
key head) in ``input_bytes``, the fp32 gate (one or ``K`` per head) and, for an ``inputs`` ring,
``v`` in ``input_bytes`` and an fp32 ``β``, for a ``corrected`` ring the fp32 corrected value ``d``
(``V``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from qstate import profiles as _profiles
from qstate.formats import StateFormat, as_format

__all__ = ["Scheme", "parse_schemes", "DEFAULT_SCHEMES", "DELTA_DEFAULT_SCHEMES", "RING_KINDS", "candidate_schemes",
           "default_schemes"]

REPLAY = "replay"
RING_KINDS = ("inputs", "corrected")


def _is_delta(profile) -> bool:
    return profile.family == "gated_delta"


def _element_bytes(fmt: StateFormat, profile) -> float:
    if _is_delta(profile):  # scale groups run over K: "row" is one scale per V-row
        return fmt.bytes_per_element(profile.head_k_dim, profile.head_v_dim)
    return fmt.bytes_per_element(profile.dstate, profile.headdim)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One way to store the state. Build with :meth:`conventional`, :meth:`replay` or :meth:`parse`."""

    kind: str  # "conventional" or "replay"
    fmt: Optional[StateFormat] = None  # conventional: the stored format
    checkpoint: Optional[StateFormat] = None  # replay
    read: Optional[StateFormat] = None  # replay: read copy, None reads the checkpoint
    ring_len: int = 0  # replay
    ring: Optional[str] = None  # replay of a delta-rule layer: "inputs" or "corrected"; None: inputs

    @classmethod
    def conventional(cls, fmt: Union[str, StateFormat]) -> "Scheme":
        """The state stored in ``fmt`` and re-quantized at every step."""
        return cls("conventional", fmt=as_format(fmt, "fmt"))

    @classmethod
    def replay(cls, checkpoint: Union[str, StateFormat] = "fp32", read: Union[None, str, StateFormat] = None,
               ring_len: int = 16, ring: Optional[str] = None) -> "Scheme":
        """Checkpoint in ``checkpoint``, ring of ``ring_len`` tokens, read copy in ``read`` (or none);
        ``ring``: the delta rule's ring kind (:data:`RING_KINDS`), None for the default (inputs)."""
        if isinstance(ring_len, bool) or not isinstance(ring_len, int) or ring_len < 1:
            raise ValueError(f"ring_len: expected an int >= 1, got {ring_len!r}")
        if ring is not None and ring not in RING_KINDS:
            raise ValueError(f"ring: expected None or one of {list(RING_KINDS)}, got {ring!r}")
        return cls(REPLAY, checkpoint=as_format(checkpoint, "checkpoint"),
                   read=None if read is None else as_format(read, "read"), ring_len=ring_len, ring=ring)

    @classmethod
    def parse(cls, text: Union[str, "Scheme"]) -> "Scheme":
        """Parse the string form (see the module docstring)."""
        if isinstance(text, Scheme):
            return text
        if not isinstance(text, str):
            raise TypeError(f"scheme: expected a str or Scheme, got {type(text).__name__}")
        parts = text.strip().split("/")
        try:
            if parts[0] != REPLAY:
                if len(parts) != 1:
                    raise ValueError("a conventional scheme is a single format")
                return cls.conventional(parts[0])
            ring = None
            if len(parts) > 1 and not parts[-1].isdigit() and not parts[-2].isdigit():
                raise ValueError("expected replay/<checkpoint>[/<read>]/<ring_len>[/<ring>]")
            if len(parts) > 1 and not parts[-1].isdigit():
                ring = parts.pop()
                if ring not in RING_KINDS:
                    raise ValueError(f"the ring kind after the ring length is one of {list(RING_KINDS)}, "
                                     f"got {ring!r}")
            if len(parts) not in (3, 4) or not parts[-1].isdigit():
                raise ValueError("expected replay/<checkpoint>[/<read>]/<ring_len>[/<ring>]")
            read = parts[2] if len(parts) == 4 else None
            return cls.replay(parts[1], read, int(parts[-1]), ring)
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"scheme: cannot parse {text!r} ({err}); expected '<format>' (conventional) or "
                "'replay/<checkpoint>[/<read>]/<ring_len>[/<ring>]', e.g. 'fp8_e4m3:row', "
                "'replay/fp32/fp8_e4m3:row/16' or 'replay/fp32/fp8_e4m3:row/16/corrected' (delta rule)"
            ) from None

    def __str__(self) -> str:
        if self.kind != REPLAY:
            return str(self.fmt)
        read = f"/{self.read}" if self.read is not None else ""
        ring = f"/{self.ring}" if self.ring is not None else ""
        return f"{REPLAY}/{self.checkpoint}{read}/{self.ring_len}{ring}"

    @property
    def is_replay(self) -> bool:
        return self.kind == REPLAY

    def _ring_token_bytes(self, profile, input_bytes: float) -> float:
        """Bytes of one ring token per state element. Mamba-2: x (headdim), B (dstate, per group),
        dt (fp32). Delta rule: k̂ (K, per key head), the fp32 gate (1 or K), and v (V) with an fp32 β
        (inputs ring) or the fp32 corrected value d (V, corrected ring)."""
        if _is_delta(profile):
            K, V = profile.head_k_dim, profile.head_v_dim
            k = K * input_bytes * profile.num_k_heads / profile.num_v_heads
            own = V * 4.0 if self.ring == "corrected" else V * input_bytes + 4.0
            return (k + 4.0 * profile.gate_channels + own) / (K * V)
        heads_per_group = profile.nheads // profile.ngroups
        per_head = profile.headdim * input_bytes + profile.dstate * input_bytes / heads_per_group + 4.0
        return per_head / (profile.headdim * profile.dstate)

    def bytes_per_step(self, profile, input_bytes: float = 2.0) -> float:
        """HBM bytes per decode step and state element, scales and ring included.

        Conventional: read and write the state, ``2·s``. Replay: over a cycle of ``L`` steps the
        read copy is read ``L − 1`` times and written once, the checkpoint read and written once,
        ``s_read + 2·s_ck / L`` (without a read copy ``s_ck + s_ck / L``); the ring adds the
        tokens read each step (on average ``(L + 1) / 2``), one token written, and the ``L``
        tokens the flush reads (one per step on average).
        """
        profile = _profiles.get(profile)
        if not self.is_replay:
            return 2.0 * _element_bytes(self.fmt, profile)
        L = self.ring_len
        ck = _element_bytes(self.checkpoint, profile)
        state = ck + ck / L if self.read is None else _element_bytes(self.read, profile) + 2.0 * ck / L
        ring = ((L + 1) / 2.0 + 2.0) * self._ring_token_bytes(profile, input_bytes)
        return state + ring

    def bytes_resident(self, profile, input_bytes: float = 2.0) -> float:
        """Bytes held per state element: the state, or checkpoint + read copy + ring capacity."""
        profile = _profiles.get(profile)
        if not self.is_replay:
            return _element_bytes(self.fmt, profile)
        read = 0.0 if self.read is None else _element_bytes(self.read, profile)
        return _element_bytes(self.checkpoint, profile) + read + self.ring_len * self._ring_token_bytes(
            profile, input_bytes)


def parse_schemes(spec) -> list[Scheme]:
    """Schemes from a comma-separated string or a sequence of strings / Schemes."""
    if isinstance(spec, (str, Scheme)):
        spec = [s for s in str(spec).split(",") if s.strip()] if isinstance(spec, str) else [spec]
    elif not isinstance(spec, (list, tuple)):
        raise TypeError(f"schemes: expected a comma-separated string, a Scheme or a list of them, "
                        f"got {type(spec).__name__}")
    schemes = [Scheme.parse(s) for s in spec]
    if not schemes:
        raise ValueError("schemes: expected at least one scheme, got none")
    return schemes


DEFAULT_SCHEMES = (
    "fp32", "bf16", "fp16", "fp8_e4m3:row", "fp8_e4m3:row+sr", "int8:row",
    "replay/fp32/16", "replay/fp32/fp8_e4m3:row/16", "replay/fp32/int8:row/16", "replay/bf16/fp8_e4m3:row/16",
)

# Delta-rule layers: naive states in the formats public reports use, and replay with an fp8
# read copy under both ring kinds (the corrected ring shows its leak into the checkpoint).
DELTA_DEFAULT_SCHEMES = (
    "fp32", "bf16", "fp16", "fp8_e4m3:row", "int8:row",
    "replay/fp32/16/inputs", "replay/fp32/fp8_e4m3:row/16/inputs", "replay/fp32/fp8_e4m3:row/16/corrected",
)


def default_schemes(profile) -> tuple:
    """The default schemes of ``qstate drift`` for the profile's layer family."""
    return DELTA_DEFAULT_SCHEMES if _is_delta(_profiles.get(profile)) else DEFAULT_SCHEMES


CONVENTIONAL_FORMATS = ("fp32", "bf16", "fp16") + tuple(
    f"{d}:{g}" for d in ("fp8_e4m3", "fp8_e5m2", "int8") for g in ("row", "head", "block32"))
CHECKPOINTS = ("fp32", "bf16", "fp16", "int8:row")
READS = (None, "bf16", "fp8_e4m3:row", "fp8_e5m2:row", "int8:row")
RING_LENS = (8, 16, 32)


def candidate_schemes() -> list[Scheme]:
    """The chooser's default candidates: conventional in every format of docs/design.md#formats (round to
    nearest), and replay with every checkpoint × read copy × ring length above (72 schemes)."""
    conv = [Scheme.conventional(f) for f in CONVENTIONAL_FORMATS]
    replay = [Scheme.replay(c, r, L) for c in CHECKPOINTS for r in READS for L in RING_LENS]
    return conv + replay
