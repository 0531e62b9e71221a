"""The delta-rule drift engine reproduces qstate.reference.gated_delta; scheme strings carry the ring
kind; the CLI and the report work on delta-rule models; the corrected ring leaks, the inputs ring
does not; the theory stands beside the measurement."""

import json

import numpy as np
import pytest
import torch

from qstate import profiles
from qstate._delta_profile import KIMI_INIT
from qstate.analysis import theory_delta
from qstate.analysis.drift import simulate
from qstate.analysis.engine_delta import CorrectedRingGroup, DeltaExact, DeltaNaive, DeltaStepInputs, InputRingGroup
from qstate.analysis.schemes import Scheme, parse_schemes
from qstate.cli import main
from qstate.reference import gated_delta as gd

EPS64 = 2.0**-52
NAIVE_FORMATS = ("fp32", "bf16", "fp16", "fp8_e4m3:row", "int8:row", "fp8_e5m2:row+sr")


def tiny(gate: str, steps: int = 23, seed: int = 3, state0: bool = True):
    """A tiny GDN or KDA profile (HK = 2, HV = 4, K = 8, V = 6) and its inputs, from a random state."""
    kw = dict(gate="channel", gates=KIMI_INIT) if gate == "channel" else {}
    p = profiles.DeltaRuleProfile(f"tiny-{gate}", 2, 4, 8, 6, 1, **kw)
    inp = p.sample_inputs(steps, 2, seed=seed)
    if state0:
        inp.state0.normal_(generator=torch.Generator().manual_seed(seed))
    return p, inp


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_exact_and_naive_match_the_reference(gate):
    p, inp = tiny(gate)
    s = DeltaStepInputs.build(inp, "cpu")
    T = inp.q.shape[0]
    ex = DeltaExact(inp.state0)
    o = torch.stack([ex.step(s, i) for i in range(T)])
    o_ref, S_ref = gd.decode_exact(**inp.kwargs())
    assert rel(o, o_ref) < 64 * EPS64 and rel(ex.state, S_ref) < 64 * EPS64
    seed = 11
    gens = [torch.Generator().manual_seed(seed) if Scheme.parse(f).fmt.stochastic else None for f in NAIVE_FORMATS]
    naive = DeltaNaive([Scheme.conventional(f) for f in NAIVE_FORMATS], inp.state0, gens)
    on = torch.stack([naive.step(s, i, keep_codes=False) for i in range(T)])
    for j, fmt in enumerate(NAIVE_FORMATS):
        o_n, S_n = gd.decode_naive(**inp.kwargs(), fmt=fmt, seed=seed)
        # Same fp32 operations on the same stored codes: equal up to the fp32 summation order of the
        # two matvecs, whose difference stays far below one rounding of any stored format.
        assert rel(on[:, j], o_n) < 1e-6, fmt
        assert rel(naive.state[j], S_n) < 1e-6, fmt


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("ring", ["inputs", "corrected"])
@pytest.mark.parametrize("ring_len", [1, 3, 5])
def test_replay_matches_the_reference(gate, ring, ring_len):
    p, inp = tiny(gate)
    s = DeltaStepInputs.build(inp, "cpu")
    T = inp.q.shape[0]
    combos = [("fp32", None), ("fp32", "fp8_e4m3:row"), ("bf16", "int8:row")]
    schemes = [Scheme.replay(ck, rd, ring_len, ring) for ck, rd in combos]
    group = (InputRingGroup if ring == "inputs" else CorrectedRingGroup)(schemes, inp.state0, [None] * len(schemes))
    ex = DeltaExact(inp.state0)
    outs = []
    for i in range(T):
        ex.step(s, i)
        outs.append(group.step(s, i, ex.state))
    o = torch.stack(outs, dim=1)  # [k, T, batch, HV, V]
    for j, (ck, rd) in enumerate(combos):
        o_r, S_r, C_r = gd.decode_replay(**inp.kwargs(), checkpoint=ck, read=rd, ring_len=ring_len, ring=ring,
                                         return_checkpoint=True)
        # fp64 algebra in another order (closed-form ring product): fp64 rounding apart.
        assert rel(o[j], o_r) < 1e-12, (ck, rd)
        assert rel(group.state()[j], S_r) < 1e-12, (ck, rd)
        assert torch.equal(group.checkpoint[j], C_r), (ck, rd)


def test_simulate_errors_are_the_reference_errors():
    p, inp = tiny("channel", state0=False)
    schemes = ["int8:row", "replay/fp32/fp8_e4m3:row/4/inputs", "replay/fp32/fp8_e4m3:row/4/corrected"]
    r = simulate(p, schemes, 23, inputs=inp, every=1)
    o_ref, _ = gd.decode_exact(**inp.kwargs())
    runs = [gd.decode_naive(**inp.kwargs(), fmt="int8:row")[0]] + [
        gd.decode_replay(**inp.kwargs(), read="fp8_e4m3:row", ring_len=4, ring=ring)[0]
        for ring in ("inputs", "corrected")]
    for j, o in enumerate(runs):
        err = ((o.double() - o_ref).square().sum(dim=(1, 3)).sqrt() / o_ref.square().sum(dim=(1, 3)).sqrt()).numpy()
        np.testing.assert_allclose(r.output_error[j], err, rtol=1e-5, atol=1e-12)
    assert np.isnan(r.checkpoint_error[0]).all() and np.isfinite(r.checkpoint_error[1:]).all()
    assert r.to_dict()["profile"]["family"] == "gated_delta"


def test_scheme_strings_carry_the_ring_kind():
    for text in ("replay/fp32/fp8_e4m3:row/16/inputs", "replay/fp32/16/corrected", "replay/bf16/int8:row/8"):
        assert str(Scheme.parse(text)) == text
    assert Scheme.parse("replay/fp32/16/corrected").ring == "corrected"
    for bad, words in (("replay/fp32/16/sideways", "'sideways'"), ("replay/fp32/fp8_e4m3:row/inputs", "ring_len"),
                       ("replay/fp32/fp8_e4m3:row/x/y", "ring_len")):
        with pytest.raises(ValueError, match=words):
            Scheme.parse(bad)
    with pytest.raises(ValueError, match="ring"):
        Scheme.replay("fp32", None, 16, "outputs")
    with pytest.raises(ValueError, match="delta-rule layers only"):
        simulate("nemotron-h-8b", "replay/fp32/fp8_e4m3:row/4/corrected", 4, heads=1, batch=1)
    delta = profiles.get("qwen3.5-9b")
    inputs_ring, corrected = parse_schemes("replay/fp32/fp8_e4m3:row/16/inputs,replay/fp32/fp8_e4m3:row/16/corrected")
    # A corrected ring keeps d (V, fp32) in place of v (V, bf16) and β (fp32).
    assert corrected.bytes_per_step(delta) > inputs_ring.bytes_per_step(delta)


def test_corrected_ring_leaks_into_the_checkpoint_and_inputs_ring_does_not():
    p = profiles.DeltaRuleProfile("tiny-slow", 2, 2, 16, 8, 1, gates=profiles.GateDistribution(a_min=0.01, a_max=0.02))
    schemes = ["replay/fp32/fp8_e4m3:row/4/inputs", "replay/fp32/fp8_e4m3:row/4/corrected"]
    r = simulate(p, schemes, 160, batch=2, every=1)
    inputs_ck, corrected_ck = r.checkpoint_curve(0), r.checkpoint_curve(1)
    assert inputs_ck[3:].max() < 4 * 2.0**-24  # within fp32 rounding
    assert corrected_ck[-1] > 100 * inputs_ck[-1] and corrected_ck[-1] > 3 * corrected_ck[3]
    heads = theory_delta.head_parameters(p, r.heads)
    for j in range(2):
        measured, predicted, preds = theory_delta.measured_vs_predicted(r, j, heads)
        assert np.all(predicted / measured < 3) and np.all(measured / predicted < 3), r.schemes[j]
        pred_ck = np.sqrt(np.mean([pr.checkpoint_error[-1] ** 2 for pr in preds]))
        assert 1 / 3 < pred_ck / r.checkpoint_curve(j)[-1] < 3, r.schemes[j]


def test_cli_drift_and_choose_on_delta_models(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["drift", "--model", "qwen3.5-9b", "--steps", "24", "--heads", "2", "--batch", "1", "--out", str(out),
                 "--schemes", "int8:row,replay/fp32/fp8_e4m3:row/8/inputs,replay/fp32/fp8_e4m3:row/8/corrected"]) == 0
    report = (out / "report.md").read_text()
    assert "Delta-rule layer (scalar gate" in report and "## Checkpoint error" in report
    assert "| replay/fp32/fp8_e4m3:row/8/corrected | 3 |" in report
    data = json.loads((out / "drift.json").read_text())
    assert data["profile"]["num_v_heads"] == 32 and len(data["checkpoint_error"]) == 3
    code = main(["choose", "--model", "kimi-linear-48b-a3b", "--tolerance", "0.05", "--steps", "24", "--heads", "2",
                 "--candidates", "fp16,int8:row,replay/fp32/fp8_e4m3:row/8"])
    text = capsys.readouterr().out
    assert code == 0 and "Recommended (traffic" in text
    assert main(["models"]) == 0 and "kimi-linear-48b-a3b" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["drift", "--model", "qwen3.5-9b", "--steps", "8", "--schemes", "replay/fp32/8/sideways",
              "--out", str(tmp_path / "bad")])
    assert exc.value.code == 2 and "'sideways'" in capsys.readouterr().err
