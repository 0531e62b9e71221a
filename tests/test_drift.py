"""Drift engine: reproduces the fp64 references scheme by scheme, records what it promises,
reports failures as failures, and rejects bad arguments by name."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from qstate import profiles, reference
from qstate.analysis import drift
from qstate.analysis.drift import measurement_cycle, recorded_steps, simulate
from qstate.analysis.plots import final_by_class

TINY = profiles.Profile("tiny", 6, 16, 64, 2, 1)
SCHEMES = ["fp32", "bf16", "fp8_e4m3:row", "int8:block32", "fp8_e4m3:row+sr", "replay/fp32/5",
           "replay/fp32/fp8_e4m3:row/5", "replay/bf16/int8:row/7", "replay/int8:row/fp8_e5m2:row+sr/5"]
T, BATCH, SEED = 40, 2, 3



def per_head_rel(a, b, dims):
    return ((a.double() - b).square().sum(dim=dims).sqrt() / b.square().sum(dim=dims).sqrt()).numpy()


@pytest.fixture(scope="module")
def run():
    inputs = TINY.sample_inputs(T, BATCH, seed=SEED)
    result = simulate(TINY, SCHEMES, T, batch=BATCH, seed=SEED)
    y_exact, s_exact = reference.decode_exact(**inputs.kwargs())
    return inputs, result, y_exact, s_exact


def test_engine_reproduces_the_references(run):
    inputs, result, y_exact, s_exact = run
    for j, scheme in enumerate(result.schemes):
        gen = torch.Generator().manual_seed(SEED + j)  # the engine seeds scheme j's noise with seed + j
        if scheme.is_replay:
            y, _ = reference.decode_replay(**inputs.kwargs(), checkpoint=scheme.checkpoint, read=scheme.read,
                                           ring_len=scheme.ring_len, generator=gen)
            # Same fp64 ring algebra: only fp64 rounding differs (order of sums).
            np.testing.assert_allclose(result.output_error[j], per_head_rel(y, y_exact, (1, 3)),
                                       rtol=1e-6, atol=1e-13, err_msg=str(scheme))
        else:
            y, state = reference.decode_naive(**inputs.kwargs(), fmt=scheme.fmt, generator=gen)
            # The stored state is bit for bit the reference's, so its error is the same number ...
            np.testing.assert_allclose(result.state_error[j, -1], per_head_rel(state, s_exact, (0, 2, 3)),
                                       rtol=1e-12, err_msg=str(scheme))
            # ... and outputs differ only by the fp32 summation order over dstate (64 terms):
            # |Δy| ≲ 64 · 2^-24 · Σ|S·C| — far below 1e-5 of ‖y‖ here.
            np.testing.assert_allclose(result.output_error[j], per_head_rel(y, y_exact, (1, 3)),
                                       rtol=0, atol=1e-5, err_msg=str(scheme))


def _reference_codes(monkeypatch, fmt: str) -> list:
    """The codes (grid values) of every state the reference stores in ``fmt``, in order."""
    stored, quantize = [], reference.mamba2.quantize

    def recording(x, f, **kwargs):
        q = quantize(x, f, **kwargs)
        if str(q.fmt) == fmt:
            stored.append(q.data.float())
        return q

    monkeypatch.setattr(reference.mamba2, "quantize", recording)
    return stored


def _unchanged(new, old):
    return (new == old).double().mean(dim=(0, 2, 3)).numpy()


@pytest.mark.parametrize("fmt", ["fp8_e4m3:row", "int8:row", "bf16"])
def test_conventional_stall_counts_unchanged_codes(monkeypatch, fmt):
    # Recording every 3rd step: the engine keeps codes only at a recorded step and the one before.
    inputs = TINY.sample_inputs(T, BATCH, seed=SEED)
    result = simulate(TINY, [fmt], T, inputs=inputs, every=3)
    codes = _reference_codes(monkeypatch, fmt)
    reference.decode_naive(**inputs.kwargs(), fmt=fmt)
    assert len(codes) == T + 1  # the initial state, then one per step
    for r, t in enumerate(result.recorded_steps):
        np.testing.assert_array_equal(result.stalled[0, r], _unchanged(codes[t], codes[t - 1]), err_msg=f"step {t}")


def test_replay_stall_counts_unchanged_checkpoint_codes(monkeypatch):
    L, ck = 5, "int8:row"
    inputs = TINY.sample_inputs(T, BATCH, seed=SEED)
    result = simulate(TINY, [f"replay/{ck}/fp8_e4m3:row/{L}"], T, inputs=inputs)
    codes = _reference_codes(monkeypatch, ck)
    reference.decode_replay(**inputs.kwargs(), checkpoint=ck, read="fp8_e4m3:row", ring_len=L)
    assert len(codes) == T // L + 1  # the initial checkpoint, then one per flush
    for r, t in enumerate(result.recorded_steps):
        flushes = t // L  # the stall of the last flush holds until the next one
        expected = _unchanged(codes[flushes], codes[flushes - 1]) if flushes else np.zeros(TINY.nheads)
        np.testing.assert_array_equal(result.stalled[0, r], expected, err_msg=f"step {t}")


def test_a_read_copy_error_shows_when_the_ring_length_divides_the_record_interval():
    """A flushing token outputs from the fold (no read copy): records aligned with the flushes
    would show the read-copy scheme as exact as the one without a read copy."""
    result = simulate(TINY, ["replay/fp32/16", "replay/fp32/fp8_e4m3:row/16"], 256, batch=1, every=16, seed=1)
    no_read, read = np.nanmax(result.output_error, axis=(1, 2))
    assert read > 100 * no_read


def test_cycle_figures_are_rms_over_the_recorded_steps_of_each_cycle(run):
    """Every step is recorded here (every=1): each cycle's error is the RMS of the recorded errors of
    its steps, the last cycle ends at the last step, and final_error is the p99 over heads of that."""
    _, result, _, _ = run
    assert result.cycle == 35  # the least common multiple of the ring lengths 5 and 7
    assert "is 35 steps (whole cycles of every ring length: the least common multiple of 5, 7)" in result.measures()["cycle"]
    assert result.recorded_steps.tolist() == list(range(1, T + 1)) and result.cycle_steps.tolist() == [T]
    for j, row in enumerate(result.summary()):
        last = result.output_error[j][T - 35:]
        np.testing.assert_allclose(result.cycle_error[j, -1], np.sqrt(np.mean(last ** 2, axis=0)), rtol=1e-12)
        assert row["final_error"] == pytest.approx(np.quantile(np.sqrt(np.mean(last ** 2, axis=0)), 0.99), rel=1e-12)


@pytest.fixture(scope="module")
def nemotron():
    """A small run of the default profile with rings of 16: the issue's case."""
    schemes = ["fp32", "replay/fp32/16", "replay/fp32/fp8_e4m3:row/16"]
    return simulate("nemotron-h-8b", schemes, 96, batch=1, heads=4, every=16, seed=0)


def test_final_figures_of_a_read_copy_cover_its_whole_cycle(nemotron):
    """The last step is a flushing token, whose output reads no read copy: at that step alone the
    fp8 read-copy scheme looks as exact as an fp32 checkpoint. Over the whole last cycle its error
    is the read copy's, far above conventional fp32's, in the summary and in the decay-class plot."""
    rows = {r["scheme"]: r for r in nemotron.summary()}
    j_fp32, j_read = 0, 2
    assert nemotron.output_error[j_read, -1].max() < 1e-6  # the flushing token
    assert rows["replay/fp32/fp8_e4m3:row/16"]["final_error"] > 100 * rows["fp32"]["final_error"]
    assert rows["replay/fp32/fp8_e4m3:row/16"]["final_error"] > 100 * rows["replay/fp32/16"]["final_error"]
    by_class_read, by_class_fp32 = final_by_class(nemotron, j_read), final_by_class(nemotron, j_fp32)
    present = np.isfinite(by_class_fp32)
    assert present.any() and np.all(by_class_read[present] > 100 * by_class_fp32[present])
    # max_error and p99_error take each head's largest error over every step, records or not
    assert np.all(nemotron.peak_error >= np.max(nemotron.output_error, axis=1) * (1 - 1e-12))
    assert rows["fp32"]["max_error"] == pytest.approx(nemotron.peak_error[j_fp32].max(), rel=1e-12)
    first, last = nemotron.final_window()
    assert (first, last) == (81, 96) and "81–96" in nemotron.measures()["final_error"]


def test_per_cycle_curves_have_no_saw_tooth(nemotron):
    """Single steps of a read-copy scheme swing over decades within a ring cycle (no read copy at the
    flush); its per-cycle RMS moves by far less from one cycle to the next."""
    later = nemotron.recorded_steps > 16  # the first cycle reads a copy of the zero initial state: exact
    single = np.sqrt(np.mean(nemotron.output_error[2] ** 2, axis=1))[later]  # RMS over heads, one step each
    assert single.max() > 1e3 * single.min()
    curve = nemotron.cycle_curve(2)[1:]
    assert nemotron.cycle_middles.tolist() == [8.5 + 16 * c for c in range(6)]
    assert np.all(np.isfinite(curve)) and np.max(np.abs(np.diff(np.log10(curve)))) < 1


def test_report_and_json_say_what_each_figure_covers(nemotron, tmp_path):
    from qstate.analysis.report import write_report

    text = open(write_report(nemotron, tmp_path, plot=False)).read()
    measures = nemotron.measures()
    for name in ("cycle", "final_error", "max_error", "p99_error", "growth_exponent", "stagnated_fraction"):
        assert f"- `{name}`: {measures[name]}." in text
    assert "over the last cycle, steps 81–96" in text and "16 steps (one cycle of the ring of 16)" in text
    assert "over every step of steps 49–96 (whole measurement cycles)" in text  # the theory table
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["measures"] == measures and len(data["peak_error"]) == 3


def test_measurement_cycle_holds_whole_cycles_of_every_ring():
    assert measurement_cycle(["fp32", "replay/fp32/8", "replay/fp32/fp8_e4m3:row/12"], 100) == 24
    assert measurement_cycle(["replay/fp32/16", "replay/bf16/int8:row/16"], 16) == 16
    assert measurement_cycle(["fp32", "bf16"], 100) == drift.DEFAULT_CYCLE
    assert measurement_cycle(["fp32"], 5) == 5
    with pytest.raises(ValueError, match="steps: expected at least 35"):
        measurement_cycle(["replay/fp32/5", "replay/fp32/7"], 34)
    with pytest.raises(ValueError, match=r"steps: expected at least 16 \(one whole cycle of the ring of 16\), got 8"):
        measurement_cycle(["replay/fp32/16"], 8)


def test_cli_refuses_a_run_shorter_than_a_cycle(tmp_path, capsys):
    from qstate.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["drift", "--model", "nemotron-h-8b", "--steps", "8", "--heads", "2", "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2 and "steps: expected at least 16" in capsys.readouterr().err


def test_records_about_every_kth_step_staggered_and_the_last():
    """Records step k·every − (k − 1) mod every, so they visit every residue modulo ``every``."""
    result = simulate(TINY, ["fp32"], 10, batch=1, every=4)
    assert result.recorded_steps.tolist() == [4, 7, 10]
    assert sorted(t % 16 for t in recorded_steps(16 * 16, 16)[:16]) == list(range(16))
    assert result.output_error.shape == (1, 3, TINY.nheads)


def test_long_runs_sample_inputs_chunk_by_chunk(monkeypatch):
    # Beyond one chunk the head parameters stay those of chunk 0 and the run stays finite.
    monkeypatch.setattr(drift, "_CHUNK_ELEMENTS", BATCH * TINY.nheads * TINY.headdim * 7)
    chunks = list(drift._input_chunks(TINY, 20, BATCH, list(range(TINY.nheads)), SEED, None))
    assert [c.x.shape[0] for c in chunks] == [7, 7, 6]
    assert all(torch.equal(c.A, chunks[0].A) and torch.equal(c.dt_bias, chunks[0].dt_bias) for c in chunks)
    first = TINY.sample_inputs(7, BATCH, seed=SEED)
    assert torch.equal(chunks[0].x, first.x)
    result = simulate(TINY, ["fp8_e4m3:row"], 20, batch=BATCH, seed=SEED)
    assert np.isfinite(result.output_error).all()


def test_summary_rows_and_json(tmp_path, run):
    _, result, _, _ = run
    rows = result.summary()
    assert [r["scheme"] for r in rows] == SCHEMES
    for row in rows:
        assert set(drift.Summary.columns) <= set(row)
        assert row["failed_at"] is None and 0 <= row["stagnated_fraction"] <= 1
        assert row["p99_error"] <= row["max_error"]
    text = str(rows)
    assert text.startswith("| scheme |") and "replay/fp32/fp8_e4m3:row/5" in text
    result.to_json(tmp_path / "drift.json")
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["schemes"] == SCHEMES and len(data["output_error"][0]) == T
    assert data["cycle"] == 35 and data["cycle_steps"] == [T] and len(data["cycle_error"][0]) == 1
    assert set(drift.Summary.columns) - {"scheme", "failed_at"} <= set(data["measures"])
    result.plot(tmp_path / "drift.png")
    assert (tmp_path / "drift.png").stat().st_size > 0


def test_overflow_is_a_failure_with_its_step():
    inputs = TINY.sample_inputs(12, 1, seed=1)
    huge = dataclasses.replace(inputs, x=inputs.x * 1e19, B=inputs.B * 1e19)  # fp64 fine, fp32 overflows
    result = simulate(TINY, ["fp32", "bf16", "replay/fp32/4"], 12, inputs=huge)
    # The conventional update runs in fp32 (as a kernel does) and overflows, whatever the storage;
    # replay computes in fp64 and its checkpoints stay in range here.
    assert isinstance(result.failed_at["fp32"], int) and 1 <= result.failed_at["fp32"] <= 12
    assert isinstance(result.failed_at["bf16"], int)
    assert "replay/fp32/4" not in result.failed_at and result.summary()[2]["max_error"] < 1e-6
    row = result.summary()[0]
    assert row["failed_at"] == result.failed_at["fp32"] and row["p99_error"] is None
    assert np.isnan(result.output_error[0]).all()


@pytest.mark.parametrize("kwargs, name", [
    (dict(steps=0), "steps"), (dict(steps=5, every=0), "every"), (dict(steps=5, heads=[0, 6]), "heads"),
    (dict(steps=5, batch=0), "batch"), (dict(steps=5, schemes="fp9"), "scheme"),
    (dict(steps=5, schemes=["replay/fp32/8"]), "steps"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    kwargs = {"schemes": ["fp32"], **kwargs}
    with pytest.raises((ValueError, TypeError), match=name):
        simulate(TINY, kwargs.pop("schemes"), kwargs.pop("steps"), **kwargs)
