"""The sanitizer driver's calls (``bench/sanitize.py``) under the interpreter at its small shape:
its own checks (finite served rows, slot flags only on the garbage-cursor slots) hold, so on
the GPU only the sanitizer's report decides."""

from __future__ import annotations

import torch

from bench import sanitize

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
