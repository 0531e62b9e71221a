"""Python cost of an eager call, without a GPU: the public ops and their launchers at batch 1 of
nemotron-h-8b's layer (CPU tensors) with every Triton launch replaced by a no-op that stands in
for a compiled GPU kernel, so what is timed is the Python a GPU call runs (its signature and
dispatch entry, value checks, prepared launches; for ops without a prepared launch the argument
plumbing, launch plans and compiled launchers) without the launch.

    python bench/host_overhead.py [--calls 2000] [--clock cpu]

Prints µs per call (the median of five rounds; ``--clock cpu``: of the process's CPU time,
steadier than wall time on a host other work shares): ``selective_state_update`` (fp32 state)
and its launcher, ``replay_decode`` (fp32 checkpoint + fp8_e4m3:row read copy) and its
launcher, ``replay_verify`` of 4 drafts (same cache formats) and its launcher,
``replay_commit`` and its launcher; then the gated delta ops at batch 1 of the Qwen3.5-122B-A10B
layer: ``gated_delta_update`` (fp32 state) and ``gated_delta_replay`` (fp32 checkpoint +
fp8_e4m3:row read copy), which prepare their launches as the first two do.
On CPU tensors ``replay_commit`` also checks the accepted counts on the host, and the gated
delta ops their gates and betas, which they skip on a GPU (it would sync). On a GPU host the
Triton launches add to these (bench/README.md#eager).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qstate  # noqa: E402
from qstate import profiles  # noqa: E402
from qstate.kernels.gated_delta import conventional as delta_conventional  # noqa: E402
from qstate.kernels.gated_delta import replay as delta_replay  # noqa: E402
from qstate.kernels.mamba2 import conventional, replay, speculative  # noqa: E402
from qstate.kernels.common.launch import CompiledLaunch, StandInKernel, replace_kernel  # noqa: E402

_MODULES = (conventional, replay, speculative, delta_conventional, delta_replay)


def _launched_kernels(module) -> list[str]:
    """Names of the kernels ``module`` launches: every one a ``CompiledLaunch`` of it wraps (so a
    kernel added to a launcher is stubbed too, never run by the interpreter here)."""
    wrapped = {id(v.kernel) for v in vars(module).values() if isinstance(v, CompiledLaunch)}
    return [name for name, v in vars(module).items() if id(v) in wrapped]


def _us(fn, calls: int, clock) -> float:
    for _ in range(100):
        fn()
    rounds = []
    for _ in range(5):
        start = clock()
        for _ in range(calls):
            fn()
        rounds.append((clock() - start) / calls * 1e6)
    return statistics.median(rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for module in _MODULES:
        for name in _launched_kernels(module):
            replace_kernel(module, name, StandInKernel(getattr(module, name)), stand_in=True)
    torch.set_num_threads(1)
    prof = profiles.get("nemotron-h-8b")
    H, P, N, G = prof.nheads, prof.headdim, prof.dstate, prof.ngroups
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, P, generator=g).bfloat16()
    z = torch.randn(1, H, P, generator=g).bfloat16()
    dt = torch.rand(1, H, generator=g).bfloat16()
    A, D, dt_bias = -torch.rand(H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g)
    B = torch.randn(1, G, N, generator=g).bfloat16()
    C = torch.randn(1, G, N, generator=g).bfloat16()
    out = torch.empty_like(x)
    state = torch.zeros(1, H, P, N)
    cache = qstate.ReplayCache.allocate(1, H, P, N, G)
    draft_cache = qstate.ReplayCache.allocate(1, H, P, N, G, max_draft=4)
    drafts = {name: t[:, None].expand(1, 4, *t.shape[1:]).contiguous() for name, t in
              (("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z))}
    draft_out = torch.empty_like(drafts["x"])
    accepted = torch.full((1,), 4, dtype=torch.int32)
    fp32 = qstate.formats.StateFormat.parse("fp32")

    def public_conventional():
        qstate.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, out=out)

    def launcher_conventional():
        conventional.launch(state, None, x, dt, A, B, C, D, z, dt_bias, None, out, 0, None, dtype_code=0,
                            granularity=0, stochastic=False, qmax=1.0, emax=0, dt_softplus=True, pad_slot_id=-1,
                            heads_per_group=H // G)

    def public_replay():
        qstate.replay_decode(cache, x, dt, A, B, C, D, z, dt_bias, True, out=out)

    def launcher_replay():
        replay.launch_replay_decode(
            x, dt, A, B, C, D, z, dt_bias, True, None, out, cache.checkpoint, cache.checkpoint_scale, cache.read,
            cache.read_scale, cache.ring_x, cache.ring_dt, cache.ring_B, cache.cursor, cache.generation,
            cache.flush_rows, cache.flush_counters, cache.slot_flags, checkpoint_format=fp32, read_format=cache.read_format, seed=0)

    draft_cache.drafts.fill_(4)  # what a verify records; the stubbed commit kernel never clears it

    def public_verify():
        qstate.replay_verify(draft_cache, drafts["x"], drafts["dt"], A, drafts["B"], drafts["C"], D, drafts["z"],
                             dt_bias, True, out=draft_out)

    def launcher_verify():
        speculative.launch_replay_verify(
            drafts["x"], drafts["dt"], A, drafts["B"], drafts["C"], D, drafts["z"], dt_bias, True, None, draft_out,
            draft_cache.checkpoint, draft_cache.checkpoint_scale, draft_cache.read, draft_cache.read_scale,
            draft_cache.ring_x, draft_cache.ring_dt, draft_cache.ring_B, draft_cache.cursor, draft_cache.generation,
            draft_cache.drafts, draft_cache.flush_rows, draft_cache.flush_counters, draft_cache.slot_flags,
            checkpoint_format=fp32,
            read_format=draft_cache.read_format, seed=0)

    def public_commit():
        qstate.replay_commit(draft_cache, accepted)

    def launcher_commit():
        speculative.launch_replay_commit(accepted, None, draft_cache.cursor, draft_cache.drafts,
                                         draft_cache.commit_errors, draft_cache.slot_flags, 1, draft_cache.capacity)

    delta = profiles.get("qwen3.5-122b-a10b")
    HK, HV, K, V = delta.num_k_heads, delta.num_v_heads, delta.head_k_dim, delta.head_v_dim
    q, k = (torch.randn(1, HK, K, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, HV, V, generator=g).bfloat16()
    gate, beta = -torch.rand(1, HV, generator=g), torch.rand(1, HV, generator=g)
    delta_out = torch.empty_like(v)
    delta_state = torch.zeros(1, HV, V, K)
    delta_cache = qstate.GatedDeltaReplayCache.allocate(1, HK, HV, K, V)

    def public_delta_conventional():
        qstate.gated_delta_update(delta_state, q, k, v, gate, beta, out=delta_out)

    def public_delta_replay():
        qstate.gated_delta_replay(delta_cache, q, k, v, gate, beta, out=delta_out)

    for name, fn in (("selective_state_update", public_conventional), ("  launcher", launcher_conventional),
                     ("replay_decode", public_replay), ("  launcher", launcher_replay),
                     ("replay_verify", public_verify), ("  launcher", launcher_verify),
                     ("replay_commit", public_commit), ("  launcher", launcher_commit),
                     ("gated_delta_update", public_delta_conventional), ("gated_delta_replay", public_delta_replay)):
        print(f"{name:24s} {_us(fn, args.calls, clock):7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
