"""Speculative decoding on gated delta rule layers on the GPU, in the shared harness
(``python3 -m bench.run_gpu --groups gated_delta_speculative``): checks against the fp64
references, then verify + commit of T drafts per row on replay state against the
per-draft-state baseline in the same run.

Cases (bf16 inputs, group ``gated_delta_speculative``), per layer of :data:`LAYERS`, batch 64
and 256, T = 4 and 8:

* ``gdn-spec/<layer>/b<batch>/T<T>/per-draft-state/fp32``: ``gated_delta_update_drafts`` +
  ``gated_delta_commit_drafts`` on an fp32 state (what engines do today).
* ``gdn-spec/<layer>/b<batch>/T<T>/replay/fp32+<read>``: ``gated_delta_replay_verify`` +
  ``gated_delta_replay_commit``, ring_len 16, fp32 checkpoint without a read copy and with an
  ``fp8_e4m3:row`` one.

One timed call is one round. Each row accepts a fixed number of drafts drawn uniformly from
0 … T and the cursors start staggered, so each round flushes its share of rows. Bytes per round
count what the kernels move in the steady state of that pattern (simulated on the host with the
commit's flush rule): the state read (read copy, or checkpoint), the committed ring tokens read,
the drafts appended, the flushes (checkpoint read and written, read copy written, the folded
tokens read), and the inputs and outputs; for the baseline the state read, T states written and
the accepted one copied. ``annotate`` adds each replay case's speed-up over the baseline.
"""

from __future__ import annotations

import torch

import qstate
from qstate import formats
from qstate.reference import gated_delta as reference

from .cases_gated_delta import LAYERS, token, with_constants
from .harness import Case, graph_matches_eager, register

GROUP = "gated_delta_speculative"
TIMED_LAYERS = ("qwen3.5-122b-a10b", "kimi-linear-48b-a3b")
BATCHES = (64, 256)
DRAFTS = (4, 8)
READS = (None, "fp8_e4m3:row")
RING_LEN = 16


def draft_inputs(batch, T, HK, HV, K, V, gate, *, device, dtype=torch.bfloat16, seed=0):
    """``q, k (batch, T, HK, K)``, ``v (batch, T, HV, V)``, ``g``, ``beta`` (batch-major drafts)."""
    time_major = token(batch, HK, HV, K, V, gate, device=device, dtype=dtype, T=T, seed=seed)
    return {n: t.transpose(0, 1).contiguous() for n, t in time_major.items()}


def _token_bytes(HK, HV, K, V, gate, elem=2):
    """One ring token of a row: k per key head, v, g and β per value head."""
    return HK * K * elem + HV * V * elem + HV * (K if gate == "channel" else 1) * 4 + HV * 4


def _io_bytes(batch, T, HK, HV, K, V, gate, elem=2):
    """q, k, v and the outputs of T drafts in ``elem`` bytes; g and β in fp32."""
    return batch * T * ((2 * HK * K + 2 * HV * V) * elem + HV * (K if gate == "channel" else 1) * 4 + HV * 4)


def _acceptance(batch, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, T + 1, (batch,), generator=g), torch.randint(0, RING_LEN, (batch,), generator=g)


def steady_state(accepted, cursor0, rounds=400):
    """Per row and round: mean committed tokens read by the verify, flushes, tokens folded."""
    read = flushes = folded = 0
    for a, n in zip(accepted, cursor0):
        for _ in range(rounds):
            read += n
            n += a
            if n >= RING_LEN:
                flushes += 1
                folded += n
                n = 0
    count = len(accepted) * rounds
    return read / count, flushes / count, folded / count


# ---------------------------------------------------------------------------- correctness


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_rounds(device, batch=3, rounds=8, T=3, L=4):
    """verify/commit against ``decode_speculative`` (fp64) on a small layer (HV/HK 4, V = 96),
    GDN and KDA, fp32 inputs: without a read copy every output, the checkpoint and the final
    state within 1e-5 relative RMS (fp32 sums over K and V; the GPU contracts into FMAs); with
    an ``fp8_e4m3:row`` read copy the read copy is ``quantize`` of the checkpoint bit for bit,
    the final state within 1e-5 and the outputs within 3e-2 (the reference's read copy is built
    from its own fp64 fold: a code may differ by one step)."""
    failures, report = [], []
    HK, HV, K, V = 2, 8, 128, 96
    for gate in ("scalar", "channel"):
        for read in READS:
            g = torch.Generator().manual_seed(3)
            cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=L, read=read,
                                                          input_dtype=torch.float32, device=device, max_draft=T)
            state0 = torch.randn(batch, HV, V, K, generator=g)
            cache.reset(range(batch), state0.to(device))
            inputs = [draft_inputs(batch, T, HK, HV, K, V, gate, device=device, dtype=torch.float32, seed=20 + r)
                      for r in range(rounds)]
            accepted = torch.randint(0, T + 1, (rounds, batch), generator=g)
            outs = []
            for r in range(rounds):
                outs.append(qstate.gated_delta_replay_verify(cache, **inputs[r]).cpu())
                qstate.gated_delta_replay_commit(cache, accepted[r].to(device=device, dtype=torch.int32))
            qstate.gated_delta_replay_check_commits(cache)
            stacked = {n: torch.stack([x[n].transpose(0, 1).cpu() for x in inputs]) for n in inputs[0]}
            o_ref, final, ck = reference.decode_speculative(state0, **stacked, num_accepted=accepted, ring_len=L,
                                                            read=read, return_checkpoint=True)
            y_rel = _rel(torch.stack(outs).transpose(1, 2), o_ref)
            s_rel = _rel(cache.materialize(range(batch)).cpu(), final)
            ck_rel = _rel(cache.checkpoint.cpu(), ck)
            same_read = True
            if read is not None:
                want = formats.quantize(cache.checkpoint_values(range(batch)), read)
                same_read = torch.equal(cache.read.view(torch.uint8), want.data.view(torch.uint8)) and \
                    torch.equal(cache.read_scale, want.scale)
            key = f"gdn-spec {gate} fp32+{read or 'none'}"
            report.append(dict(check=key, y_rel_rms=y_rel, state_rel_rms=s_rel, checkpoint_rel_rms=ck_rel,
                               read_copy_bits=same_read, flags=cache.slot_flags.tolist()))
            y_tol = 1e-5 if read is None else 3e-2
            if not (y_rel <= y_tol and s_rel <= 1e-5 and ck_rel <= 1e-5 and same_read):
                failures.append(f"{key}: y {y_rel:.2e} (tol {y_tol:g}), state {s_rel:.2e}, checkpoint {ck_rel:.2e}, "
                                f"read copy bit for bit {same_read}")
    return failures, report


def check_baseline(device, batch=3, T=4):
    """The per-draft states are those of T ``gated_delta_update`` steps, bit for bit (fp32)."""
    HK, HV, K, V = 2, 8, 128, 96
    inp = draft_inputs(batch, T, HK, HV, K, V, "scalar", device=device, dtype=torch.float32, seed=5)
    state = torch.randn(batch, HV, V, K, generator=torch.Generator().manual_seed(6)).to(device)
    inter = torch.empty(batch, T, HV, V, K, device=device)
    out = qstate.gated_delta_update_drafts(state, **inp, intermediate=inter)
    ref = state.clone()
    same = True
    for t in range(T):
        y = qstate.gated_delta_update(ref, **{n: x[:, t] for n, x in inp.items()})
        same = same and torch.equal(inter[:, t], ref) and torch.equal(out[:, t], y)
    qstate.gated_delta_commit_drafts(state, inter, torch.full((batch,), T, dtype=torch.int32, device=device))
    same = same and torch.equal(state, ref)
    return ([] if same else ["gdn-spec baseline: per-draft states differ from T gated_delta_update steps"],
            [dict(check="gdn-spec baseline == conventional steps (fp32)", bit_exact=same)])


def check_graph(device, batch=64, rounds=12, T=4):
    """Rounds captured in a CUDA graph against the same rounds run eagerly, bit for bit
    (staggered cursors: commits flush some rows every round)."""
    failures = []
    HK, HV, K, V, gate = LAYERS["qwen3.5-122b-a10b"]
    for read in READS:
        def make(read=read):
            cache, inp, _, accepted = _replay_buffers(batch, "qwen3.5-122b-a10b", T, read, device)
            outs = torch.full((rounds, batch, T, HV, V), float("nan"), device=device, dtype=torch.bfloat16)
            return cache, inp, outs, accepted

        def run(buffers):
            cache, inp, outs, accepted = buffers
            for i in range(rounds):
                qstate.gated_delta_replay_verify(cache, **inp, out=outs[i])
                qstate.gated_delta_replay_commit(cache, accepted)

        def tensors(buffers):
            cache, _, outs, _ = buffers
            return dict({k: v for k, v in cache.tensors().items() if v is not None}, outputs=outs)

        failures += graph_matches_eager(f"gdn-spec graph fp32+{read or 'none'}", make, run, tensors)
    return failures


def check_kernel(device):
    """Every check of this module; (failures, report rows)."""
    f1, r1 = check_rounds(device)
    f2, r2 = check_baseline(device)
    f3 = check_graph(device)
    return f1 + f2 + f3, r1 + r2 + [dict(check="gdn-spec CUDA graph == eager", failures=f3)]


# ---------------------------------------------------------------------------- timing


def _replay_buffers(batch, layer, T, read, device):
    HK, HV, K, V, gate = LAYERS[layer]
    accepted, cursor0 = _acceptance(batch, T)
    cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=RING_LEN, read=read,
                                                  device=device, max_draft=T)
    cache.cursor.copy_(cursor0.to(device=device, dtype=torch.int32))
    out = torch.empty(batch, T, HV, V, device=device, dtype=torch.bfloat16)
    return cache, draft_inputs(batch, T, HK, HV, K, V, gate, device=device), out, \
        accepted.to(device=device, dtype=torch.int32)


def replay_case(batch, layer, T, read, device):
    HK, HV, K, V, gate = LAYERS[layer]
    accepted, cursor0 = _acceptance(batch, T)
    read_tokens, flush_rate, folded = steady_state(accepted.tolist(), cursor0.tolist())
    ck = HV * V * K * 4
    rd = ck if read is None else HV * V * K + HV * V * 4
    per_token = _token_bytes(HK, HV, K, V, gate)
    per_row = rd + (read_tokens + T) * per_token + flush_rate * (2 * ck + (0 if read is None else rd)) \
        + folded * per_token
    moved = int(batch * per_row + _io_bytes(batch, T, HK, HV, K, V, gate))
    probe = qstate.GatedDeltaReplayCache.allocate(1, HK, HV, K, V, gate=gate, ring_len=RING_LEN, read=read,
                                                  device="meta", max_draft=T)

    def run(buffers):
        cache, inp, out, acc = buffers
        qstate.gated_delta_replay_verify(cache, **inp, out=out)
        qstate.gated_delta_replay_commit(cache, acc)

    return Case(GROUP, f"gdn-spec/{layer}/b{batch}/T{T}/replay/fp32+{read or 'none'}",
                dict(model=layer, batch=batch, format=f"replay fp32 + {read or 'no read'}, L{RING_LEN}",
                     op="verify+commit", inputs=f"bf16, T={T}, flush {flush_rate:.3f}/round"),
                moved, lambda: _replay_buffers(batch, layer, T, read, device), run,
                set_bytes=int(probe.nbytes * batch))


def baseline_case(batch, layer, T, device):
    HK, HV, K, V, gate = LAYERS[layer]
    accepted, _ = _acceptance(batch, T)
    state_bytes = HV * V * K * 4
    committing = int((accepted > 0).sum())
    moved = int(batch * state_bytes * (1 + T) + committing * 2 * state_bytes + _io_bytes(batch, T, HK, HV, K, V, gate))

    def make():
        state = torch.zeros(batch, HV, V, K, device=device)
        inter = torch.zeros(batch, T, HV, V, K, device=device)
        out = torch.empty(batch, T, HV, V, device=device, dtype=torch.bfloat16)
        return state, inter, draft_inputs(batch, T, HK, HV, K, V, gate, device=device), out, \
            accepted.to(device=device, dtype=torch.int32)

    def run(buffers):
        state, inter, inp, out, acc = buffers
        qstate.gated_delta_update_drafts(state, **inp, intermediate=inter, out=out)
        qstate.gated_delta_commit_drafts(state, inter, acc)

    return Case(GROUP, f"gdn-spec/{layer}/b{batch}/T{T}/per-draft-state/fp32",
                dict(model=layer, batch=batch, format="per-draft states fp32", op="drafts+commit",
                     inputs=f"bf16, T={T}"),
                moved, make, run, set_bytes=batch * state_bytes * (1 + T))


@register(GROUP)
def timing_cases(device):
    out = []
    for layer in TIMED_LAYERS:
        for batch in BATCHES:
            for T in DRAFTS:
                out.append(baseline_case(batch, layer, T, device))
                out += [replay_case(batch, layer, T, read, device) for read in READS]
    return out


def annotate(by_group):
    """Each replay case's speed-up over the per-draft-state baseline of its layer, batch and T."""
    rows = by_group.get(GROUP, [])
    baselines = {r["name"].split("/per-draft-state")[0]: r["us"] for r in rows if "/per-draft-state/" in r["name"]}
    for r in rows:
        key = r["name"].split("/replay/")[0]
        if "/replay/" in r["name"] and key in baselines:
            r["params"]["speedup_vs_per_draft_state"] = round(baselines[key] / r["us"], 2)


_SPECULATIVE = "qstate.kernels.gated_delta.speculative"
SWEEP = {
    "default": {},
    "sweep-unrolled": {"SWEEP_GROUP": 0},
}


def sweep_cases(device):
    """The verify's and commit fold's variants and tiles against the default (``bench.run_gpu --sweep
    gated_delta_speculative``): both timed layers at batch 256, T = 4, both reads."""
    out = []
    for layer in TIMED_LAYERS:
        for read in READS:
            for tag, constants in SWEEP.items():
                case = replay_case(256, layer, 4, read, device)
                case.group = f"sweep-{GROUP}"
                case.name = f"{case.name}/{tag}"
                case.params = dict(case.params, variant=tag, format=f"{case.params['format']} [{tag}]")
                case.run = with_constants(_SPECULATIVE, constants, case.run)
                out.append(case)
    return out
