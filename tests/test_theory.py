"""Theory against measurement on synthetic heads of fixed decay, and the dead band both sides."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from qstate import profiles
from qstate.analysis import theory
from qstate.analysis.drift import simulate

DECAYS = [0.5, 0.9, 0.99, 0.999, 0.9999]
DT = 0.05  # rms increment u = dt for unit-variance x and B



@pytest.fixture(scope="module")
def synthetic_run():
    # fp32: the engine's fp32 update and output round as much as the state's storage does, which
    # the theory leaves out (4–12× the prediction): it must not claim to apply.
    schemes = ["fp32", "fp8_e4m3:row+sr", "int8:row+sr", "bf16+sr", "fp8_e4m3:row", "int8:row", "bf16", "fp16",
               "replay/fp32/fp8_e4m3:row/16", "replay/fp32/int8:row/8", "replay/bf16/fp8_e4m3:row/16",
               "replay/fp32/16"]
    profile, inputs = theory.synthetic_inputs(DECAYS, 800, batch=2, headdim=16, dstate=64, dt=DT, seed=1)
    return simulate(profile, schemes, 800, inputs=inputs, every=4, seed=1)


def test_report_predicts_with_the_parameters_of_the_inputs_it_ran(synthetic_run):
    """A run on explicit inputs keeps their effective (decay, increment) per head, and the report's
    theory table predicts with them, not with heads re-sampled from the profile."""
    from qstate.analysis.plots import decay_class
    from qstate.analysis.report import theory_table

    decays, increments = synthetic_run.observed_parameters
    assert np.allclose(decays, DECAYS, rtol=1e-6) and np.allclose(increments, DT, rtol=1e-6)
    table = theory_table(synthetic_run)
    j = [str(s) for s in synthetic_run.schemes].index("int8:row+sr")
    measured, predicted, _ = theory.measured_vs_predicted(synthetic_run, j, np.asarray(increments), np.asarray(decays))
    row = next(line for line in table.splitlines() if line.startswith("| int8:row+sr |"))
    classes = decay_class(synthetic_run.decay)
    cells = [f"{np.sqrt(np.mean(measured[classes == c] ** 2)):.2e} / {np.sqrt(np.mean(predicted[classes == c] ** 2)):.2e}*"
             for c in sorted(set(classes.tolist()))]
    assert row == "| int8:row+sr | " + " | ".join(cells) + " |"


def test_theory_within_a_factor_two_where_it_applies(synthetic_run):
    checked = 0
    for j, scheme in enumerate(synthetic_run.schemes):
        measured, predicted, preds = theory.measured_vs_predicted(synthetic_run, j, increments=np.full(5, DT))
        for a, m, p, pr in zip(DECAYS, measured, predicted, preds):
            if pr.applies:
                checked += 1
                assert 0.5 <= m / p <= 2.0, f"{scheme} at a={a}: measured {m:.3g}, predicted {p:.3g}"
    # stochastic schemes and read copies apply at every decay; RNE only with large increments
    assert checked >= 40


def test_fp32_state_is_outside_the_theory_and_fp32_checkpoints_inside():
    for a in DECAYS:
        pred = theory.predict("fp32", a, 50, increment=DT, dstate=64, headdim=16)
        assert not pred.applies and pred.regime == "fp32 arithmetic"
        assert theory.predict("replay/fp32/16", a, 50, increment=DT, dstate=64, headdim=16).applies


def test_fp32_rounding_rms_from_the_binade_of_each_value():
    # Round to nearest in fp32: uniform error of half an ulp, the ulp 2**-23 of the value's binade
    # [2**k, 2**(k+1)), so r² = 2**-46/12 · E[4**k] for v ~ N(0, 1) (not 2**-46/12 · E[v²]).
    mass = [math.erf(2.0 ** (k + 1) / math.sqrt(2)) - math.erf(2.0**k / math.sqrt(2)) for k in range(-160, 10)]
    expected = math.sqrt(2.0**-46 / 12 * sum(4.0**k * p for k, p in zip(range(-160, 10), mass)))
    assert theory.rounding_rms("fp32") == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(decay=0.9, steps=0), ValueError, "steps"), (dict(decay=0.9, steps=-3), ValueError, "steps"),
    (dict(decay=0.9, steps=2.5), TypeError, "steps"), (dict(decay=1.5, steps=10), ValueError, "decay"),
    (dict(decay=-0.5, steps=10), ValueError, "decay"), (dict(decay=float("nan"), steps=10), ValueError, "decay"),
    (dict(decay=1.0, steps=10), ValueError, "decay"), (dict(decay="0.9", steps=10), TypeError, "decay"),
    (dict(decay=0.9, steps=10, increment=0.0), ValueError, "increment"),
    (dict(decay=0.9, steps=10, increment=float("inf")), ValueError, "increment"),
    (dict(decay=0.9, steps=10, dstate=0), ValueError, "dstate"),
    (dict(decay=0.9, steps=10, headdim=-1), ValueError, "headdim"),
    (dict(decay=0.9, steps=10, D=float("nan")), ValueError, "D"),
])
def test_predict_rejects_bad_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=f"^{name}"):
        theory.predict("int8:row", **kwargs)


def test_predict_rejects_block32_with_an_odd_dstate():
    with pytest.raises(ValueError, match="^dstate"):
        theory.predict("replay/fp32/int8:block32/16", 0.9, 10, dstate=40)


@pytest.mark.parametrize("fn", [theory.predicted_stalled_fraction, theory.stagnation_predicted])
@pytest.mark.parametrize("decay,exc", [(2.0, ValueError), (0.0, ValueError), (float("nan"), ValueError),
                                       (None, TypeError)])
def test_stall_predictions_reject_bad_decays(fn, decay, exc):
    with pytest.raises(exc, match="^decay"):
        fn("int8:row", decay)


def test_rounding_rms_and_head_parameters_reject_bad_arguments():
    with pytest.raises(ValueError, match="^dstate"):
        theory.rounding_rms("int8:row", 0)
    with pytest.raises(TypeError, match="^inputs"):
        theory.head_parameters(None)
    _, inputs = theory.synthetic_inputs([0.5], 3)
    with pytest.raises(ValueError, match="^samples"):
        theory.head_parameters(inputs, 0)


@pytest.mark.parametrize("decays,kwargs,exc,name", [
    ([0.5], dict(steps=0), ValueError, "steps"), ([0.5], dict(steps=2.5), TypeError, "steps"),
    ([0.5], dict(steps=3, dt=-1.0), ValueError, "dt"), ([0.5], dict(steps=3, dt=0.0), ValueError, "dt"),
    ([0.5], dict(steps=3, dt=1e-45), ValueError, "dt"), ([0.5], dict(steps=3, batch=0), ValueError, "batch"),
    ([0.5], dict(steps=3, headdim=0), ValueError, "headdim"), ([0.5], dict(steps=3, dstate=0), ValueError, "dstate"),
    ([0.5], dict(steps=3, seed=1.5), TypeError, "seed"), ([0.5], dict(steps=3, D=float("inf")), ValueError, "D"),
    ([], dict(steps=3), ValueError, "decays"), ([float("nan")], dict(steps=3), ValueError, "decays"),
    ([[0.5]], dict(steps=3), ValueError, "decays"),
])
def test_synthetic_inputs_reject_bad_arguments(decays, kwargs, exc, name):
    with pytest.raises(exc, match=f"^{name}"):
        theory.synthetic_inputs(decays, **kwargs)


def test_sqrt_t_growth_as_decay_tends_to_one():
    profile, inputs = theory.synthetic_inputs([0.99999], 400, batch=4, headdim=16, dstate=64, dt=DT, seed=2)
    result = simulate(profile, ["int8:row+sr", "fp16"], 400, inputs=inputs, every=2, seed=2)
    pred = theory.predict("fp16", 0.99999, 400, increment=DT, dstate=64, headdim=16)
    steps = np.arange(1, 401)
    predicted_slope = np.polyfit(np.log(steps[200:]), np.log(pred.state_error[200:]), 1)[0]
    rows = result.summary()
    # Rounding error relative to the value (float grids, per-row scales): the error variance sums
    # r²·σ_S²(k) ∝ k over k ≤ t, so the error grows like t and the state like sqrt(t): the relative
    # error grows like sqrt(t).
    assert predicted_slope == pytest.approx(0.5, abs=0.02)
    assert rows[0]["growth_exponent"] == pytest.approx(0.5, abs=0.15)
    assert rows[1]["growth_exponent"] == pytest.approx(0.5, abs=0.15)


def _dead_band_inputs(fmt_value, increments, steps, decay):
    """Heads of ±u increments (x, B random signs, |x·B| = 1) on a state of one grid value."""
    n = len(increments)
    gen = torch.Generator().manual_seed(0)
    sign = lambda *shape: torch.randint(0, 2, shape, generator=gen).float() * 2 - 1  # noqa: E731
    dt0 = torch.tensor(increments, dtype=torch.float64)
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).float()
    dt_eff = torch.nn.functional.softplus(dt_bias)  # fp32, as the conventional update sees it
    A = (np.log(decay) / dt_eff.double()).float()
    inputs = profiles.DecodeInputs(
        state0=torch.full((1, n, 4, 32), fmt_value), x=sign(steps, 1, n, 4), dt=torch.zeros(steps, 1, n), A=A,
        B=sign(steps, 1, n, 32), C=sign(steps, 1, n, 32), D=torch.ones(n), z=None, dt_bias=dt_bias,
        heads=torch.arange(n))
    return profiles.Profile("dead-band", n, 4, 32, n, 1), inputs, dt_eff.double()


@pytest.mark.parametrize("fmt, value, half_step", [("bf16", 1.5, 2.0**-8), ("fp16", 1.5, 2.0**-11),
                                                  ("bf16", 0.75, 2.0**-9)])
def test_stagnation_flag_exactly_where_the_dead_band_predicts(fmt, value, half_step):
    decay = 1 - 1e-7  # (1 − a)·|S| ≈ 1e-7: the increment alone decides
    profile, inputs, u = _dead_band_inputs(value, [0.8 * half_step, 0.97 * half_step, 1.03 * half_step,
                                                   1.25 * half_step], 40, decay)
    result = simulate(profile, [fmt], 40, inputs=inputs, every=1)
    predicted = [bool(theory.dead_band(fmt, value, decay, du).item() and theory.dead_band(fmt, value, decay, -du).item())
                 for du in u.tolist()]
    assert predicted == [True, True, False, False]  # both sides of the boundary
    assert result.stagnated(0).tolist() == predicted
    stalled = np.nanmean(result.stalled[0][20:], axis=0)
    np.testing.assert_array_equal(stalled, [1.0, 1.0, 0.0, 0.0])


def test_dead_band_on_binade_edges():
    # Below 1.0 the bf16 grid is twice as fine: a decrease of 0.7 · 2^-8 moves 1.0, an increase does not.
    assert not theory.dead_band("bf16", 1.0, 1.0, -0.7 * 2.0**-8).item()
    assert theory.dead_band("bf16", 1.0, 1.0, 0.7 * 2.0**-8).item()
    with pytest.raises(ValueError, match="fmt"):
        theory.dead_band("int8:row", 1.0, 1.0, 0.1)


def test_stagnation_prediction_on_realistic_heads():
    # fp8 e4m3 with round to nearest stagnates on long-memory heads; stochastic rounding never does.
    assert theory.stagnation_predicted("fp8_e4m3:row", 0.9999)
    assert not theory.stagnation_predicted("fp8_e4m3:row", 0.9)
    assert not theory.stagnation_predicted("fp8_e4m3:row+sr", 0.9999)
    # nemotron-h-8b's slowest heads (a ≈ 0.998) keep most fp8 codes, although their rms increment
    # is 1.4 rms half steps: the median element decides, not the rms one.
    assert theory.stagnation_predicted("fp8_e4m3:row", 0.998)
    assert np.sqrt(1 - 0.998**2) > 1.4 * np.sqrt(3) * theory.rounding_rms("fp8_e4m3:row")


def _steady_state_inputs(decays, steps):
    """Synthetic heads started from their exact steady state ``S ~ N(0, dt²/(1 − a²))``, as the
    prediction assumes (from zero, a = 0.9999 would take ~10⁴ steps to get there)."""
    profile, inputs = theory.synthetic_inputs(decays, steps, batch=2, headdim=16, dstate=64, dt=DT, seed=3)
    sigma = DT / torch.sqrt(1 - torch.tensor(decays) ** 2)
    state0 = torch.randn(inputs.state0.shape, generator=torch.Generator().manual_seed(4)) * sigma[:, None, None]
    return profile, dataclasses.replace(inputs, state0=state0)


def test_stagnation_of_scaled_formats_where_the_codes_stall():
    # A per-row scale follows the row maximum every step: the values move, the codes need not.
    decays = [0.99, 0.999, 0.9999]
    expected = {"fp8_e4m3:row": [False, True, True], "int8:row": [False, False, True]}
    predicted = {fmt: [theory.predicted_stalled_fraction(fmt, a, dstate=64, headdim=16) for a in decays]
                 for fmt in expected}
    for fmt, fractions in predicted.items():  # both sides of the boundary, clearly
        assert [p > 0.5 for p in fractions] == expected[fmt], f"{fmt}: {fractions}"
        assert all(abs(p - 0.5) > 0.1 for p in fractions), f"{fmt}: {fractions}"
        assert [theory.stagnation_predicted(fmt, a, dstate=64, headdim=16) for a in decays] == expected[fmt]
    profile, inputs = _steady_state_inputs(decays, 2000)
    result = simulate(profile, list(expected) + ["fp8_e4m3:row+sr"], 2000, inputs=inputs, every=8)
    half = result.recorded_steps >= 1000
    for j, fmt in enumerate(expected):
        assert result.stagnated(j).tolist() == expected[fmt], fmt
        np.testing.assert_allclose(np.nanmean(result.stalled[j][half], axis=0), predicted[fmt], atol=0.05,
                                   err_msg=fmt)
    # Stochastic rounding keeps most codes too, but without bias: not stagnation.
    assert np.nanmean(result.stalled[2][half], axis=0)[-1] > 0.5
    assert not result.stagnated(2).any()


def test_bad_synthetic_decay():
    with pytest.raises(ValueError, match="decays"):
        theory.synthetic_inputs([1.0], 10)
