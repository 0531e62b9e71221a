"""The sanitizer drivers' calls (``bench/sanitize.py``, ``bench/sanitize_gated_delta.py``)
under the interpreter at their small shapes: their own checks (finite served rows, slot flags
only on the garbage-cursor slots) hold, so on the GPU only the sanitizer's report decides."""

from __future__ import annotations

import torch

from bench import sanitize, sanitize_gated_delta

CPU = torch.device("cpu")
SMALL = sanitize.SHAPES[:1]


def test_conventional_and_codec_calls_pass_their_checks():
    failures = []
    assert sanitize.conventional(CPU, ["int8:head"], failures, shapes=SMALL) == 2
    assert sanitize.codec(CPU, ["fp8_e4m3:row", "int8:block32"]) == 1
    assert failures == []


def test_replay_and_speculative_calls_with_garbage_cursors_pass_their_checks():
    failures = []
    formats = [("fp32", "fp8_e4m3:row")]
    assert sanitize.replay(CPU, formats, failures, garbage=True, shapes=SMALL, grouped=False) == 2 * sanitize.RING + 1
    assert sanitize.speculative(CPU, formats, failures, garbage=True, shapes=SMALL, draft_lengths=(3, 3)) == 4
    assert failures == []


def test_gated_delta_calls_with_garbage_cursors_pass_their_checks():
    failures = []
    small = sanitize_gated_delta.SHAPES[:1]
    assert sanitize_gated_delta.conventional(CPU, ["fp8_e4m3:block32"], failures, shapes=small) == 4
    assert sanitize_gated_delta.replay(CPU, [("bf16", "int8:row")], failures, garbage=True, shapes=small,
                                       gates=("channel",)) == 2 * sanitize_gated_delta.RING + 2
    assert sanitize_gated_delta.speculative(CPU, [("fp32", "fp8_e4m3:row")], failures, garbage=True, shapes=small,
                                            gates=("scalar",), draft_lengths=(3, 3)) == 4
    assert sanitize_gated_delta.baseline(CPU, ["fp8_e4m3:row"], failures, shapes=small, gates=("scalar",)) == 2
    assert failures == []
