"""Speculative decoding on the GPU: verify + commit of T = 4 drafts per row on replay
state against the per-draft-state baseline, Nemotron-H-8B layer, batch 1, 16, 64 and 256, with
staggered cursors (the headline) and aligned ones; ``annotate`` reports each round's speed-up
over the baseline in the same run and checks ``TARGETS``.

One timed call is one round: ``replay_verify`` + ``replay_commit`` (replay), or
``selective_state_update_drafts`` + ``commit_drafts`` (baseline, fp32 state). Each row accepts a
fixed number of drafts drawn uniformly from 0 … T; staggered cursors give every round its share
of early flushes, aligned ones (all 0) flush together. Bytes per round count what the kernels move in the steady
state of that acceptance pattern (simulated on the host with the same flush rule): the state
read (read copy, or checkpoint), the flushes (checkpoint read and written, read copy written),
the committed ring tokens read, the drafts appended, and the decode inputs and outputs.
"""

from __future__ import annotations

import torch

from qstate import reference
from qstate.cache import ReplayCache
from qstate.ops.conventional import selective_state_update
from qstate.ops.speculative import (commit_drafts, replay_check_commits, replay_commit, replay_verify,
                                    selective_state_update_drafts)

from . import harness

LAYER = dict(nheads=128, headdim=64, dstate=128, ngroups=8)  # Nemotron-H-8B
T_DRAFT = 4
RING_LEN = 16


def draft_inputs(batch, T, nheads, headdim, dstate, ngroups, *, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, T, nheads, headdim, generator=g).to(device, dtype),
        dt=(0.5 * torch.randn(batch, T, nheads, generator=g)).to(device, dtype),
        A=(-(0.5 + 3.5 * torch.rand(nheads, generator=g))).to(device),
        B=torch.randn(batch, T, ngroups, dstate, generator=g).to(device, dtype),
        C=torch.randn(batch, T, ngroups, dstate, generator=g).to(device, dtype),
        D=torch.randn(nheads, generator=g).to(device),
        z=torch.randn(batch, T, nheads, headdim, generator=g).to(device, dtype),
        dt_bias=(-2.0 + 0.5 * torch.randn(nheads, generator=g)).to(device),
    )


def io_bytes(batch, T, nheads, headdim, dstate, ngroups, elem=2):
    """x, z, y, B, C, dt of T tokens per row."""
    return batch * T * (3 * nheads * headdim * elem + 2 * ngroups * dstate * elem + nheads * elem)


def steady_state(accepted, cursor0, T, capacity, rounds=400):
    """Mean committed tokens read and fraction of flushing rows per round (host simulation)."""
    tokens = flushes = 0
    for a, n in zip(accepted, cursor0):
        for _ in range(rounds):
            if n > 0 and n + 2 * T > capacity:
                flushes += 1
                tokens += n
                n = 0
            else:
                tokens += n
            n += a
    count = len(accepted) * rounds
    return tokens / count, flushes / count


# ---------------------------------------------------------------------------- correctness


def check_kernel(device):
    """verify/commit against the fp64 reference over the accepted tokens, small shape, on the GPU;
    the baseline against T conventional steps (bit for bit, fp32 state).

    Outputs: each row's accepted tokens between two flushes against ``decode_replay`` started
    from the kernel's own checkpoint (the same read format, no flush inside), so a read copy is
    the same rounding on both sides and the outputs differ by fp32 arithmetic only: ≤ 1e-5
    relative RMS (the κ·u bounds of tests/mamba2/test_replay.py are ~1e-6 at these sizes), plus
    one bf16 rounding of the outputs with bf16 inputs. State: the final materialized state
    against ``decode_exact`` over every accepted token, ≤ 1e-5 (fp32 checkpoint)."""
    failures, report = [], []
    shape = dict(nheads=8, headdim=64, dstate=128, ngroups=2)
    H, P, N = shape["nheads"], shape["headdim"], shape["dstate"]
    batch, rounds = 3, 12
    # Ring 4 and the timed cases' ring of 16 (with room for 4 drafts its fold tile is 32 tokens).
    for dtype, read, ring_len in [(d, r, L) for d in (torch.float32, torch.bfloat16)
                                  for r in (None, "fp8_e4m3:row") for L in (4, 16)]:
        g = torch.Generator().manual_seed(7)
        cache = ReplayCache.allocate(batch, **shape, ring_len=ring_len, read=read, input_dtype=dtype, device=device,
                                     max_draft=4)
        state0 = torch.randn(batch, H, P, N, generator=g)
        cache.reset(list(range(batch)), state0)
        history = [dict(x=[], dt=[], B=[], C=[], z=[], y=[]) for _ in range(batch)]
        # Per row: the checkpoint the current segment started from and its accepted tokens.
        segments = [dict(start=cache.checkpoint_values([row])[0].cpu(), x=[], dt=[], B=[], C=[], z=[], y=[])
                    for row in range(batch)]
        closed = []
        params = None
        for r in range(rounds * ring_len // 4):  # a few flushes at either ring length
            T = (1, 2, 4)[r % 3]
            inp = draft_inputs(batch, T, **shape, device=device, dtype=dtype, seed=100 + r)
            params = {k: inp.pop(k) for k in ("A", "D", "dt_bias")} if params is None else params
            for k in ("A", "D", "dt_bias"):
                inp.pop(k, None)
            generation = cache.generation.cpu().clone()
            y = replay_verify(cache, **inp, **params, dt_softplus=True)
            for row in torch.nonzero(cache.generation.cpu() != generation).flatten().tolist():
                # This verify flushed the row first: its drafts read the new checkpoint's read copy.
                closed.append(segments[row])
                segments[row] = dict(start=cache.checkpoint_values([row])[0].cpu(), x=[], dt=[], B=[], C=[],
                                     z=[], y=[])
            accepted = torch.randint(0, T + 1, (batch,), generator=g)
            replay_commit(cache, accepted.to(device=device, dtype=torch.int32))
            for row in range(batch):
                a = int(accepted[row])
                for k in ("x", "dt", "B", "C", "z"):
                    history[row][k] += list(inp[k][row, :a].cpu())
                    segments[row][k] += list(inp[k][row, :a].cpu())
                history[row]["y"] += list(y[row, :a].cpu())
                segments[row]["y"] += list(y[row, :a].cpu())
        replay_check_commits(cache)
        final = cache.materialize(list(range(batch)), params["A"]).double().cpu()
        cpu_params = {k: v.cpu() for k, v in params.items()}
        y_err = y_norm = s_err = s_norm = 0.0
        for seg in closed + segments:
            if not seg["x"]:
                continue
            stack = {k: torch.stack(seg[k])[:, None] for k in ("x", "dt", "B", "C", "z")}
            y_ref, _ = reference.decode_replay(seg["start"][None], **stack, **cpu_params, dt_softplus=True,
                                               checkpoint="fp32", read=read, ring_len=10**6)
            y_err += float((torch.stack(seg["y"]).double() - y_ref[:, 0]).norm() ** 2)
            y_norm += float(y_ref.norm() ** 2)
        for row in range(batch):
            h = history[row]
            if not h["x"]:
                continue
            stack = {k: torch.stack(h[k])[:, None] for k in ("x", "dt", "B", "C", "z")}
            _, S_ref = reference.decode_exact(state0[row:row + 1], **stack, **cpu_params, dt_softplus=True)
            s_err += float((final[row] - S_ref[0]).norm() ** 2)
            s_norm += float(S_ref.norm() ** 2)
        y_rel, s_rel = (y_err / y_norm) ** 0.5, (s_err / s_norm) ** 0.5
        y_tol = 1e-5 + (1e-2 if dtype == torch.bfloat16 else 0.0)
        key = f"verify/commit {read} {str(dtype).replace('torch.', '')} L{ring_len}"
        report.append(dict(check=key, y_rel_rms=y_rel, state_rel_rms=s_rel, flushes=cache.generation.tolist()))
        if not (y_rel <= y_tol and s_rel <= 1e-5):
            failures.append(f"{key}: y rel {y_rel:.2e} (tol {y_tol:g}), state rel {s_rel:.2e} (tol 1e-5)")
    # Baseline: the stored per-draft states are the states of T conventional steps.
    g = torch.Generator().manual_seed(9)
    inp = draft_inputs(batch, T_DRAFT, **shape, device=device, dtype=torch.float32, seed=11)
    params = {k: inp.pop(k) for k in ("A", "D", "dt_bias")}
    state = torch.randn(batch, H, P, N, generator=g).to(device)
    inter = torch.empty((batch, T_DRAFT, H, P, N), device=device)
    selective_state_update_drafts(state, **inp, **params, dt_softplus=True, intermediate=inter)
    ref = state.clone()
    same = True
    for t in range(T_DRAFT):
        selective_state_update(ref, **{k: v[:, t] for k, v in inp.items()}, **params, dt_softplus=True)
        same = same and torch.equal(inter[:, t], ref)
    commit_drafts(state, inter, torch.full((batch,), T_DRAFT, dtype=torch.int32, device=device))
    same = same and torch.equal(state, ref)
    report.append(dict(check="baseline states == conventional steps (fp32)", bit_exact=same))
    if not same:
        failures.append("baseline: per-draft states differ from T conventional steps")
    return failures, report


# ---------------------------------------------------------------------------- timing


def _acceptance(batch, seed, phase="staggered"):
    """Accepted drafts per row (uniform in 0 … T) and the starting cursors: spread over the
    ring (``staggered``, as a serving engine's admissions leave them) or all 0 (``aligned``)."""
    g = torch.Generator().manual_seed(seed)
    accepted = torch.randint(0, T_DRAFT + 1, (batch,), generator=g)
    capacity = RING_LEN + T_DRAFT
    cursor0 = torch.randint(0, capacity - 2 * T_DRAFT + 1, (batch,), generator=g)
    return accepted, cursor0 if phase == "staggered" else torch.zeros_like(cursor0)


def _replay_case(batch, read, device, phase="staggered"):
    H, P, N, G = (LAYER[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    probe = ReplayCache.allocate(1, **LAYER, ring_len=RING_LEN, read=read, device="meta", max_draft=T_DRAFT)
    accepted, cursor0 = _acceptance(batch, 0, phase)
    mean_tokens, flush_rate = steady_state(accepted.tolist(), cursor0.tolist(), T_DRAFT, probe.capacity)
    ck = H * P * N * 4
    rd = ck if read is None else H * P * N * 1 + H * P * 4
    per_token = H * (P * 2 + 4) + G * N * 2
    per_row = ((1 - flush_rate) * rd + flush_rate * (2 * ck + (0 if read is None else rd))
               + mean_tokens * per_token + T_DRAFT * per_token)
    moved = int(batch * per_row + io_bytes(batch, T_DRAFT, **LAYER))

    def make_buffers():
        cache = ReplayCache.allocate(batch, **LAYER, ring_len=RING_LEN, read=read, device=device, max_draft=T_DRAFT)
        cache.reset(list(range(batch)))
        cache.cursor.copy_(cursor0.to(device=device, dtype=torch.int32))
        inp = draft_inputs(batch, T_DRAFT, **LAYER, device=device)
        out = torch.empty(batch, T_DRAFT, H, P, device=device, dtype=torch.bfloat16)
        return cache, inp, out, accepted.to(device=device, dtype=torch.int32)

    def run(buffers):
        cache, inp, out, acc = buffers
        replay_verify(cache, **inp, dt_softplus=True, out=out)
        replay_commit(cache, acc)

    name = f"spec replay fp32{'' if read is None else '+' + read} b{batch} T{T_DRAFT}" + (
        "" if phase == "staggered" else " aligned")
    return harness.Case(
        group="speculative", name=name,
        params=dict(model="nemotron-h-8b", batch=batch, format=f"replay fp32{'' if read is None else ' + ' + read}",
                    inputs=f"bf16, T={T_DRAFT}, L={RING_LEN}, {phase}, flush {flush_rate:.2f}/round", read=read,
                    phase=phase, kernel="replay"),
        bytes_moved=moved, make_buffers=make_buffers, run=run, set_bytes=int(probe.nbytes * batch))


def _baseline_case(batch, device):
    H, P, N = (LAYER[k] for k in ("nheads", "headdim", "dstate"))
    accepted, _ = _acceptance(batch, 0)
    state_bytes = H * P * N * 4
    committing = int((accepted > 0).sum())
    moved = int(batch * state_bytes * (1 + T_DRAFT) + committing * 2 * state_bytes + io_bytes(batch, T_DRAFT, **LAYER))

    def make_buffers():
        state = torch.zeros(batch, H, P, N, device=device)
        inter = torch.zeros(batch, T_DRAFT, H, P, N, device=device)
        inp = draft_inputs(batch, T_DRAFT, **LAYER, device=device)
        out = torch.empty(batch, T_DRAFT, H, P, device=device, dtype=torch.bfloat16)
        return state, inter, inp, out, accepted.to(device=device, dtype=torch.int32)

    def run(buffers):
        state, inter, inp, out, acc = buffers
        selective_state_update_drafts(state, **inp, dt_softplus=True, intermediate=inter, out=out)
        commit_drafts(state, inter, acc)

    return harness.Case(
        group="speculative", name=f"spec per-draft-state fp32 b{batch} T{T_DRAFT}",
        params=dict(model="nemotron-h-8b", batch=batch, format="per-draft states fp32",
                    inputs=f"bf16, T={T_DRAFT}", kernel="per-draft-state"),
        bytes_moved=moved, make_buffers=make_buffers, run=run, set_bytes=batch * state_bytes * (1 + T_DRAFT))


def eager_overhead(device, layer=LAYER):
    """µs per eager round at batch 1, fp32 checkpoint + fp8_e4m3:row read copy, T = 4, every draft
    accepted: the public ``replay_verify`` + ``replay_commit`` and their launchers alone (five
    kernel launches a round either way)."""
    from qstate.kernels.mamba2.speculative import launch_replay_commit, launch_replay_verify

    H, P = layer["nheads"], layer["headdim"]
    cache = ReplayCache.allocate(1, **layer, ring_len=RING_LEN, read="fp8_e4m3:row", device=device,
                                 max_draft=T_DRAFT)
    cache.reset([0])
    inp = draft_inputs(1, T_DRAFT, **layer, device=device)
    out = torch.empty(1, T_DRAFT, H, P, device=device, dtype=torch.bfloat16)
    accepted = torch.full((1,), T_DRAFT, dtype=torch.int32, device=device)

    def public():
        replay_verify(cache, **inp, dt_softplus=True, out=out)
        replay_commit(cache, accepted)

    def launchers():
        launch_replay_verify(
            *(inp[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")), True, None, out,
            cache.checkpoint, cache.checkpoint_scale, cache.read, cache.read_scale, cache.ring_x, cache.ring_dt,
            cache.ring_B, cache.cursor, cache.generation, cache.drafts, cache.flush_rows, cache.flush_counters,
            cache.slot_flags, checkpoint_format=cache.checkpoint_format, read_format=cache.read_format,
            seed=cache.seed)
        launch_replay_commit(accepted, None, cache.cursor, cache.drafts, cache.commit_errors, cache.slot_flags,
                             cache.num_slots, cache.capacity)

    return dict(public_us=harness.eager_us(public), launcher_us=harness.eager_us(launchers))


# The least speed-up of a replay round over the per-draft-state baseline timed in the same run:
# (read copy, batch, pattern) → x (the fp8 read copy's round at 5×).
TARGETS = {("fp8_e4m3:row", 256, "staggered"): dict(x=5.0)}


@harness.register("speculative")
def cases(device):
    """Staggered cursors first (the headline), then aligned, at batches 1, 16, 64 and 256, with
    the per-draft-state baseline (the conventional kernel's speculative form) at each batch."""
    out = []
    for batch in (1, 16, 64, 256):
        out.append(_baseline_case(batch, device))
        out += [_replay_case(batch, read, device, phase) for phase in ("staggered", "aligned")
                for read in (None, "fp8_e4m3:row")]
    return out


def annotate(by_group):
    """Each replay round's speed-up over the per-draft-state baseline at its batch, same run
    (``x_per_draft_state``), and whether it meets ``TARGETS`` (``target_met``)."""
    rows = by_group.get("speculative", [])
    base = {r["params"]["batch"]: r["us"] for r in rows if r["params"].get("kernel") == "per-draft-state"}
    for r in rows:
        p = r["params"]
        if p.get("kernel") != "replay" or p["batch"] not in base:
            continue
        r["x_per_draft_state"] = base[p["batch"]] / r["us"]
        target = TARGETS.get((p.get("read"), p["batch"], p.get("phase")))
        verdict = ""
        if target is not None:
            r["target"], r["target_met"] = target, r["x_per_draft_state"] >= target["x"]
            verdict = "  target met" if r["target_met"] else f"  MISSED target {target}"
        print(f"{r['name']:60s} {r['us']:8.1f} us  {r['x_per_draft_state']:5.2f}x per-draft-state{verdict}", flush=True)
