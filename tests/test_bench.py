"""The benchmark helpers that run on the CPU too (the GPU timing itself runs through bench/run_gpu.py)."""

import os
import subprocess
import sys

import pytest
import torch

from bench import breakdown
from qstate.kernels.mamba2 import speculative


def test_set_constant_sets_a_launcher_constant_to_a_literal(monkeypatch):
    monkeypatch.setattr(speculative, "FLUSH_TILE", speculative.FLUSH_TILE)
    breakdown.set_constant("qstate.kernels.mamba2.speculative.FLUSH_TILE = (16, 4)")
    assert speculative.FLUSH_TILE == (16, 4)


def test_set_constant_reaches_a_cached_launch_plan(monkeypatch):
    """Launchers cache their plans per call signature; a tuning constant set for a sweep must
    still reach the next launch (set_constant clears the plans)."""
    from qstate.formats import StateFormat

    fp32, fp8 = StateFormat.parse("fp32"), StateFormat.parse("fp8_e4m3:row")
    signature = (256, 4, 128, 64, 128, 8, 20, torch.device("cpu"), fp32, fp8, torch.bfloat16, True, True, True, True,
                 False, None, None)
    plan = speculative._verify_plan(*signature)
    assert speculative._verify_plan(*signature) is plan
    assert plan.flush_constexprs["BLOCK_P"] == speculative.FLUSH_TILE[0] != 16
    monkeypatch.setattr(speculative, "FLUSH_TILE", speculative.FLUSH_TILE)
    breakdown.set_constant("qstate.kernels.mamba2.speculative.FLUSH_TILE = (16, 4)")
    assert speculative._verify_plan(*signature).flush_constexprs["BLOCK_P"] == 16


@pytest.mark.parametrize("assignment, message", [
    ("FLUSH_TILE", "expected MODULE.NAME=VALUE"),
    ("qstate.kernels.mamba2.speculative.NO_SUCH_TILE=(1, 1)", "has no attribute 'NO_SUCH_TILE'"),
])
def test_set_constant_rejects_what_it_cannot_set(assignment, message):
    with pytest.raises(ValueError, match=message):
        breakdown.set_constant(assignment)


def test_sass_count_compiles_a_kernel_for_sm90_without_a_gpu():
    """The offline instruction count: the conventional kernel compiled by Triton's ptxas. In its
    own process: this one imported the kernels for the interpreter (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "bench.sass_count", "conventional", "--format", "fp8_e4m3:row"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.strip()
    assert line.startswith("_conventional_kernel: grid (2, 128, 256), 1 warps")  # the fused path's fp8 row tile
    per_element = float(line.split(": ")[-1].split()[0])
    assert 0.05 < per_element < 5.0  # a real listing, not an empty one


def test_sass_count_compiles_the_gpu_plans_fused_setting():
    """``--set ...conventional.FUSED_ON_GPU=False`` lists the references' order: the constexprs
    handed to Triton's compiler are the launch's GPU plan's (stubbed compiler, nothing built)."""
    script = """
import sys
import triton
from bench import sass_count
from bench.breakdown import set_constant
seen = []
triton.compiler.ASTSource = lambda fn, signature, constexprs, attrs: seen.append(constexprs["FUSED"])
triton.compile = lambda source, target, options: None
set_constant("qstate.kernels.gated_delta.conventional.FUSED_ON_GPU=" + sys.argv[1])
(name, kernel, grid, args, kwargs), = sass_count.launch_gdn_conventional("int8:row")
sass_count.compile_sm90(kernel, args, kwargs)
print(seen)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for value in ("True", "False"):
        result = subprocess.run([sys.executable, "-c", script, value], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[-1] == f"[{value}]"


def test_sass_count_records_every_gated_delta_launch_of_both_gate_kinds():
    """Each ``gdn-*`` op of ``bench.sass_count`` reaches its kernels through the op's launcher
    (the cache's tensors in the launcher's order) for GDN and KDA layers; recorded, not built."""
    script = """
from bench import sass_count
for layer in ("qwen3.5-122b-a10b", "kimi-linear-48b-a3b"):
    for launch in (sass_count.launch_gdn_conventional, sass_count.launch_gdn_replay, sass_count.launch_gdn_verify,
                   sass_count.launch_gdn_commit):
        arg = "int8:row" if launch is sass_count.launch_gdn_conventional else "fp8_e4m3:row"
        print(layer, " ".join(sorted({name for name, *_ in launch(arg, batch=2, layer=layer)})))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    kernels = ["_conventional_kernel", "_replay_flush_kernel _replay_step_kernel", "_verify_kernel",
               "_commit_cursor_kernel _commit_fold_kernel _commit_list_kernel"]
    assert result.stdout.splitlines() == [f"{layer} {names}" for layer in ("qwen3.5-122b-a10b", "kimi-linear-48b-a3b")
                                          for names in kernels]


def test_host_overhead_times_the_ops_python_without_launching():
    """In its own process: it replaces the kernels of the modules it imports with no-ops."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "host_overhead.py")
    result = subprocess.run([sys.executable, script, "--calls", "3"], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["selective_state_update", "launcher", "replay_decode", "launcher",
                                                    "replay_verify", "launcher", "replay_commit", "launcher",
                                                    "gated_delta_update", "gated_delta_replay"]
    assert all(float(line.split()[-2]) > 0 for line in lines)


def test_run_case_lists_cases_and_rejects_unknown_names(capsys):
    from bench import run_case
    assert run_case.main(["--list"]) == 0
    assert "replay/b256/fp32+fp8_e4m3:row/L16/per-head/normal-step" in capsys.readouterr().out.split("\n")
    assert run_case.main(["no-such-case"]) == 2


def test_traffic_check_puts_predicted_and_measured_speed_ups_side_by_side():
    from bench import traffic_check
    results = {traffic_check.CASES["fp32"]: dict(us=600.0, pct_copy=90.0),
               traffic_check.CASES["int8:row"]: dict(us=300.0, pct_copy=45.0)}
    rows = traffic_check.table(results).splitlines()
    assert len(rows) == 4  # header, rule, fp32, int8:row
    assert rows[2].startswith("| `fp32` | 8.00 | 1.00× | 600.0 | 1.00× | 90 % |")
    # 8 bytes against 2.06 (codes and a row scale per 128 elements): 3.88× predicted, 2× measured.
    assert rows[3].startswith("| `int8:row` | 2.06 | 3.88× | 300.0 | 2.00× |")
    with pytest.raises(ValueError, match="fp32 baseline"):
        traffic_check.table({traffic_check.CASES["int8:row"]: dict(us=1.0, pct_copy=1.0)})


def test_gpu_check_covers_the_head_loop_launches():
    """cases_conventional.check_kernel runs every format whose GPU launch depends on the grid at
    a shape whose launch on a GPU takes kernel.HEAD_LOOP_CONFIGS' configuration."""
    from bench import cases_conventional
    from qstate import formats
    from qstate.kernels.common import codec
    from qstate.kernels.mamba2 import conventional

    shapes = cases_conventional._check_shapes()
    assert set(shapes[0][2]) == set(cases_conventional.ALL_FORMATS)
    head_loop = [(prof, batch, texts) for prof, batch, texts, flag in shapes if flag]
    assert [sorted(texts) for _, _, texts in head_loop] == [["bf16+sr", "fp16+sr", "int8:row", "int8:row+sr"]]
    for prof, batch, texts in head_loop:
        for text in texts:
            fmt = formats.StateFormat.parse(text)
            config = conventional.launch_config(fmt.storage_dtype.itemsize, prof.headdim, prof.dstate,
                                                codec.granularity_code(fmt), batch, prof.nheads,
                                                prof.nheads // prof.ngroups, True, fmt.stochastic,
                                                codec.dtype_code(fmt))
            assert config[3] == conventional.HEAD_LOOP_CONFIGS[(codec.dtype_code(fmt), fmt.stochastic)][2]


def test_read_kernel_sums_each_block_and_the_table_names_the_read_ceiling():
    """harness._read_kernel (the read ceiling's kernel) sums each block, the ragged last one
    included; a run's table states the read ceiling when its JSON has one (older JSONs do not)."""
    import triton

    from bench import harness

    src = torch.arange(10, dtype=torch.float32)
    sums = torch.full((3,), float("nan"))
    harness._read_kernel[(3,)](src, sums, 10, BLOCK=4)
    assert sums.tolist() == [6.0, 22.0, 17.0]
    payload = dict(environment=dict(date="d", gpu="g", commit="c", torch="t", triton=triton.__version__),
                   command="cmd", copy_ceiling_gbs=4060.0, results=[])
    assert "reading alone" not in harness.markdown_table(payload)
    assert "reading alone: 4650 GB/s" in harness.markdown_table(dict(payload, read_ceiling_gbs=4650.0))
