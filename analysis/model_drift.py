"""Model-level drift: what a storage scheme does to a real model's next-token distributions.

:func:`model_drift` decodes a transformers Mamba-2 / Nemotron-H model twice or more over the
same tokens (teacher forcing): once unpatched (transformers' own fp32-state decode, the
reference) choosing the tokens greedily, then once per scheme with the model patched by
:func:`qstate.integrations.transformers.patch` and fed the reference's tokens. Prefill is the
same in every run, so the differences come from the decode steps alone. Per sequence and
decode step it records

* ``kl``: ``KL(p_ref ‖ p_scheme)`` of the next-token distributions, in nats (fp64 softmax);
* ``top1``: whether the two argmax tokens agree;
* ``max_abs_logit``: ``max |logit_scheme − logit_ref|`` over the vocabulary.

A replay scheme's logits depend on where the step stands in its ring's cycle (the flushing
token's outputs read no read copy), so the summary's means cover whole measurement cycles, the
rule of :func:`qstate.analysis.drift.measurement_cycle` (the least common multiple of the run's
ring lengths), ending at the last step; the maxima cover every step; the plot shows the mean KL
per cycle. :meth:`ModelDrift.measures` says what each figure covers.

A scheme whose logits stop being finite is reported as failed at the first such step (1-based
decode step), never as a number.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Sequence, Union

import torch

from .drift import measurement_cycle
from .schemes import Scheme, parse_schemes

__all__ = ["SchemeDrift", "ModelDrift", "model_drift", "hf_model_report"]

SUMMARY_FIELDS = ("scheme", "bytes_per_step", "mean_kl", "max_kl", "final_kl", "top1_agreement",
                  "max_abs_logit", "failed_at")


@dataclasses.dataclass
class SchemeDrift:
    """Per-token metrics of one scheme, each ``(batch, new_tokens)``; ``failed_at`` is the first
    decode step (1-based) with a non-finite logit, or None."""

    scheme: Scheme
    kl: torch.Tensor
    top1: torch.Tensor
    max_abs_logit: torch.Tensor
    failed_at: Optional[int]

    @classmethod
    def compare(cls, scheme: Scheme, reference: torch.Tensor, logits: torch.Tensor) -> "SchemeDrift":
        """Metrics of ``logits`` against ``reference``, both ``(batch, new_tokens, vocab)``."""
        reference, logits = reference.cpu(), logits.cpu()
        finite = torch.isfinite(logits).all(dim=-1).all(dim=0)  # [new_tokens]
        failed_at = None if bool(finite.all()) else int((~finite).nonzero()[0, 0]) + 1
        log_ref = torch.log_softmax(reference.double(), dim=-1)
        log_new = torch.log_softmax(logits.double(), dim=-1)
        kl = (log_ref.exp() * (log_ref - log_new)).sum(-1).clamp(min=0.0)
        top1 = logits.argmax(-1) == reference.argmax(-1)
        max_abs = (logits.double() - reference.double()).abs().amax(-1)
        if failed_at is not None:
            bad = torch.arange(kl.shape[1]) >= failed_at - 1
            kl[:, bad] = math.nan
            max_abs[:, bad] = math.nan
            top1[:, bad] = False
        return cls(scheme, kl, top1, max_abs, failed_at)

    def per_cycle(self, cycle: Optional[int]) -> dict:
        """``kl`` and ``top1_agreement`` per measurement cycle of ``cycle`` steps, mean over the
        sequences and the cycle's steps, ``(cycles,)``; cycles end at the last step, the first
        ``new_tokens mod cycle`` steps fall in none (no cycle when ``cycle`` is None)."""
        steps = self.kl.shape[1]
        count = 0 if cycle is None else steps // cycle

        def means(t: torch.Tensor) -> torch.Tensor:
            if not count:
                return torch.zeros(0, dtype=torch.float64)
            return t.double()[:, steps - count * cycle:].reshape(t.shape[0], count, cycle).mean(dim=(0, 2))

        return {"kl": means(self.kl), "top1_agreement": means(self.top1)}

    def summary(self, profile=None, *, cycle: Optional[int]) -> dict:
        """One row of ``SUMMARY_FIELDS``: ``mean_kl`` and ``top1_agreement`` are means over the
        sequences and every whole measurement cycle of ``cycle`` steps ending at the last step,
        ``final_kl`` over the last cycle (all three None when ``cycle`` is None: no whole cycle);
        ``max_kl`` and ``max_abs_logit`` are maxima over every step; ``bytes_per_step`` per state
        element when ``profile`` is given. A failed scheme has None for every figure."""
        ok = self.failed_at is None
        cycles = self.per_cycle(cycle)
        whole = ok and cycles["kl"].numel() > 0

        def over_steps(t: torch.Tensor) -> Optional[float]:
            return float(t.max()) if ok else None

        def over_cycles(t: torch.Tensor) -> Optional[float]:
            return float(t) if whole else None

        return {
            "scheme": str(self.scheme),
            "bytes_per_step": None if profile is None else self.scheme.bytes_per_step(profile),
            "mean_kl": over_cycles(cycles["kl"].mean()),
            "max_kl": over_steps(self.kl),
            "final_kl": over_cycles(cycles["kl"][-1:].mean()),
            "top1_agreement": over_cycles(cycles["top1_agreement"].mean()),
            "max_abs_logit": over_steps(self.max_abs_logit),
            "failed_at": self.failed_at,
        }


@dataclasses.dataclass
class ModelDrift:
    """The result of :func:`model_drift`: the teacher-forced ``tokens (batch, new_tokens)`` and
    one :class:`SchemeDrift` per scheme, in the order given; ``profile`` is the model's layer shape."""

    tokens: torch.Tensor
    schemes: list[SchemeDrift]
    profile: object = None

    def __getitem__(self, scheme: Union[str, Scheme]) -> SchemeDrift:
        key = str(Scheme.parse(scheme))
        for entry in self.schemes:
            if str(entry.scheme) == key:
                return entry
        raise KeyError(f"scheme: {key!r} is not in this result; it has {[str(s.scheme) for s in self.schemes]}")

    @property
    def cycle(self) -> Optional[int]:
        """Steps in one measurement cycle of the run (:func:`qstate.analysis.drift.measurement_cycle`
        of its schemes), or None when the run is shorter than one cycle."""
        try:
            return measurement_cycle([entry.scheme for entry in self.schemes], int(self.tokens.shape[1]))
        except ValueError:
            return None

    @property
    def cycle_steps(self) -> list[int]:
        """The last decode step of each measurement cycle; cycle ``c`` covers ``cycle_steps[c] −
        cycle + 1 … cycle_steps[c]``."""
        steps, cycle = int(self.tokens.shape[1]), self.cycle
        return [] if cycle is None else list(range(steps % cycle + cycle, steps + 1, cycle))

    def summary(self) -> list[dict]:
        """One row per scheme with the fields of ``SUMMARY_FIELDS``; :meth:`measures` says what each covers."""
        return [entry.summary(self.profile, cycle=self.cycle) for entry in self.schemes]

    def measures(self) -> dict:
        """What each summary figure and curve of this run covers, field → sentence (the report's
        text and the ``measures`` entry of the JSON)."""
        steps, cycle = int(self.tokens.shape[1]), self.cycle
        rings = sorted({entry.scheme.ring_len for entry in self.schemes if entry.scheme.is_replay})
        if cycle is None:
            whole = (f"none: the run's {steps} decode steps are fewer than one whole cycle of every replay ring "
                     f"(ring lengths {', '.join(map(str, rings))}), so mean_kl, final_kl and top1_agreement "
                     "are not given")
            first = None
        else:
            first = self.cycle_steps[0] - cycle + 1
            kind = (f"one cycle of the ring of {rings[0]}" if len(rings) == 1 else
                    f"whole cycles of every ring length: the least common multiple of {', '.join(map(str, rings))}"
                    if rings else "no replay scheme in the run")
            whole = (f"{cycle} steps ({kind}); the {len(self.cycle_steps)} cycles cover decode steps {first}–{steps}"
                     + (f", steps 1–{first - 1} fall in none" if first > 1 else ""))
        return {
            "kl": "KL(p_ref ‖ p_scheme) of the next-token distributions after one decode step, in nats",
            "cycle": f"a measurement cycle is {whole}; every scheme is measured over the same cycles",
            "mean_kl": (f"mean KL over the sequences and decode steps {first}–{steps} (the whole cycles)"
                        if cycle else "not given (no whole cycle)"),
            "final_kl": (f"mean KL over the sequences and the last cycle, decode steps {steps - cycle + 1}–{steps}"
                         if cycle else "not given (no whole cycle)"),
            "top1_agreement": (f"share of the sequences and decode steps {first}–{steps} whose argmax token equals "
                               "the reference's" if cycle else "not given (no whole cycle)"),
            "max_kl": f"the largest KL over the sequences and every decode step 1–{steps}",
            "max_abs_logit": f"the largest |logit − reference logit| over the sequences, the vocabulary and every "
                             f"decode step 1–{steps}",
            "per_cycle": "per measurement cycle, the mean over the sequences and the cycle's steps",
            "per_step": "per decode step, the mean (kl, top1_agreement) or maximum (max_abs_logit) over the "
                        "sequences; raw data, a replay scheme's saw-tooth over its ring included",
            "bytes_per_step": "HBM bytes of one decode step per state element (ring and scales included)",
        }

    def to_markdown(self) -> str:
        """The summary table followed by what each figure covers."""
        rows = self.summary()

        def cell(v) -> str:
            if v is None:
                return "–"
            if isinstance(v, float):
                return f"{v:.3g}"
            return str(v)

        lines = ["| " + " | ".join(SUMMARY_FIELDS) + " |", "|" + "---|" * len(SUMMARY_FIELDS)]
        lines += ["| " + " | ".join(cell(row[f]) for f in SUMMARY_FIELDS) + " |" for row in rows]
        measures = self.measures()
        lines += [""] + [f"- `{field}`: {measures[field]}" for field in ("cycle",) + SUMMARY_FIELDS[2:-1]]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()

    def to_json(self, path: Union[str, os.PathLike]) -> None:
        """Summary rows, what each covers, and the per-cycle and per-step metrics of every scheme."""
        cycle = self.cycle
        payload = {
            "new_tokens": int(self.tokens.shape[1]),
            "batch": int(self.tokens.shape[0]),
            "cycle": cycle,
            "cycle_steps": self.cycle_steps,
            "measures": self.measures(),
            "summary": self.summary(),
            "per_cycle": {str(e.scheme): {k: _json_floats(v) for k, v in e.per_cycle(cycle).items()}
                          for e in self.schemes},
            "per_step": {
                str(e.scheme): {
                    "kl": _json_floats(e.kl.mean(0)),
                    "top1_agreement": _json_floats(e.top1.double().mean(0)),
                    "max_abs_logit": _json_floats(e.max_abs_logit.amax(0)),
                }
                for e in self.schemes
            },
        }
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=1)

    def plot(self, path: Union[str, os.PathLike]) -> None:
        """Mean KL per measurement cycle (over the sequences and the cycle's steps) at the cycle's
        middle step, one line per scheme, log scale."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        cycle = self.cycle
        if cycle is None:
            ax.text(0.5, 0.5, self.measures()["cycle"], ha="center", va="center", wrap=True, fontsize=8,
                    transform=ax.transAxes)
        else:
            middles = [step - (cycle - 1) / 2 for step in self.cycle_steps]
            for entry in self.schemes:
                ax.plot(middles, entry.per_cycle(cycle)["kl"].clamp(min=1e-12), marker=".", label=str(entry.scheme))
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        ax.set_xlabel("decode step (middle of the measurement cycle)")
        ax.set_ylabel(f"KL(reference ‖ scheme), nats, mean over {cycle or 'a'}-step cycle")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _json_floats(t: torch.Tensor) -> list:
    return [None if not math.isfinite(v) else v for v in t.double().tolist()]


def model_drift(model, input_ids: torch.Tensor, schemes: Union[str, Scheme, Sequence], new_tokens: int = 64, *,
                seed: int = 0) -> ModelDrift:
    """Teacher-forced drift of ``model`` under each scheme against the unpatched model.

    ``model``: a transformers ``Mamba2ForCausalLM`` / ``NemotronHForCausalLM``, or a Qwen3-Next,
    Qwen3.5, Qwen3.5-MoE or Kimi Linear causal LM (not patched);
    ``input_ids (batch, prompt_len)`` on the model's device; ``schemes``: scheme strings or
    :class:`Scheme` objects (or one comma-separated string); ``new_tokens`` decode steps, fed
    the reference's greedy tokens; ``seed`` keys stochastic rounding. Returns a :class:`ModelDrift`.
    Raises ``RuntimeError`` when qstate did not run every decode step of every layer (a model
    whose decode bypasses transformers' step function), rather than report its logits.
    """
    from qstate import profiles
    from qstate.integrations.transformers import decode_logits, find_delta_layers, find_layers, patch

    parsed = parse_schemes(schemes)
    layers = find_layers(model)
    if getattr(model, "_qstate_patch", None) is not None:
        raise ValueError("model: it is patched by qstate; model_drift needs the unpatched model as its reference")
    if find_delta_layers(model):
        profile = profiles.from_hf_config(model.config.to_dict())
    else:
        first = layers[0][1]
        profile = profiles.Profile(type(model).__name__, first.num_heads, first.head_dim, first.ssm_state_size,
                                   first.n_groups, len(layers))
    tokens, reference = decode_logits(model, input_ids, new_tokens)
    results = []
    for scheme in parsed:
        with patch(model, scheme, seed=seed) as patched:
            _, logits = decode_logits(model, input_ids, new_tokens, tokens=tokens)
        missing = patched.missed_steps(new_tokens)
        if missing:
            # logits equal to the reference's would report the scheme as free
            raise RuntimeError(
                f"model_drift: expected qstate to run all {new_tokens} decode steps of every recurrent layer under "
                f"{scheme}, got {missing} (steps per layer): the model's decode did not call transformers' step "
                f"function (mamba2_selective_state_update, torch_recurrent_gated_delta_rule or "
                f"recurrent_kimi_delta_attention), for example after kernelize()")
        results.append(SchemeDrift.compare(scheme, reference, logits))
    return ModelDrift(tokens.cpu(), results, profile)


DEFAULT_HF_SCHEMES = ("fp32", "replay/fp32/16", "bf16", "fp8_e4m3:row", "replay/fp32/fp8_e4m3:row/16")


def hf_model_report(path: Union[str, os.PathLike], schemes=DEFAULT_HF_SCHEMES, new_tokens: int = 64, *,
                    prompt: Optional[str] = None, prompt_tokens: int = 32, batch: int = 1, seed: int = 0,
                    device: str = "cpu", out: Union[str, os.PathLike] = "report",
                    plot: bool = True) -> ModelDrift:
    """:func:`model_drift` of the transformers model saved at ``path`` (local weights, no download).

    The prompt is ``prompt`` encoded by the model's tokenizer, else ``batch`` rows of
    ``prompt_tokens`` token ids drawn uniformly with ``seed``. On the CPU the model is loaded in
    fp32 (the Triton interpreter runs fp32), elsewhere in its saved dtype. Writes
    ``model_drift.md``, ``model_drift.json`` and (with ``plot``; it needs matplotlib)
    ``model_drift.png`` into ``out``.
    """
    from qstate.integrations.hf_import import import_transformers

    transformers = import_transformers()
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"hf-model: expected a folder with config.json (local weights), got {path!r}")
    from qstate.integrations.decode_routes import check_kernels_can_run

    try:
        check_kernels_can_run(device)
    except RuntimeError as err:
        raise ValueError(str(err)) from None
    dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    if prompt is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        input_ids = tokenizer([prompt] * batch, return_tensors="pt").input_ids
    else:
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), generator=generator)
    result = model_drift(model, input_ids.to(device), schemes, new_tokens, seed=seed)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model_drift.md"), "w") as fh:
        fh.write(f"# Model-level drift: {path}\n\n{new_tokens} teacher-forced decode steps, batch "
                 f"{input_ids.shape[0]}, prompt {input_ids.shape[1]} tokens; each scheme against the "
                 f"unpatched model (KL in nats; each figure's span below the table).\n\n"
                 f"{result.to_markdown()}\n")
    result.to_json(os.path.join(out, "model_drift.json"))
    if plot:
        result.plot(os.path.join(out, "model_drift.png"))
    return result
