"""Replay decode of the gated delta rule (qstate.gated_delta_replay, GatedDeltaReplayCache) under
the interpreter, against qstate.reference.gated_delta.

Each step's output is checked against the exact recurrence (fp64) run from what the kernel
reads (the read copy, or the checkpoint at a flush) over the slot's ring and the current token:
the adjoint sweep is exact, so the only error is fp32 rounding of sums over K and V and of the
fold, ``(n + 1) · K · 2**-24`` relative times a factor 8 for the ratio of the sums of magnitudes
(below 4 for random data). The read copy is compared bit for bit with ``quantize`` of the stored
checkpoint. End to end, outputs, checkpoints and the materialized state are compared with
``decode_replay(ring="inputs")``: with an fp32 checkpoint and no read copy they differ by fp32
rounding only.
"""

import pytest
import torch

import qstate
from qstate import formats
from qstate.reference import gated_delta as reference

from helpers.gated_delta import bits_of, rel_rms, token, tokens
from helpers.launches import assert_launched_as_computed

NAMES = ("q", "k", "v", "g", "beta")


def bound(K, steps):
    return steps * K * 2.0**-24 * 8


def allocate(num_slots, *, channel, ring_len, read, checkpoint="fp32", HK=1, HV=2, K=32, V=16,
             input_dtype=torch.float32):
    return qstate.GatedDeltaReplayCache.allocate(num_slots, HK, HV, K, V, gate="channel" if channel else "scalar",
                                                 ring_len=ring_len, checkpoint=checkpoint, read=read,
                                                 input_dtype=input_dtype)


class Tracker:
    """The tokens in each slot's ring, to compute each step's expected output."""

    def __init__(self, cache):
        self.cache = cache
        self.rings = {s: [] for s in range(cache.num_slots)}

    def reset(self, slot):
        self.rings[slot] = []

    def step(self, inp, slots, **kw):
        """Run one step; return (out, expected) for the live rows."""
        cache = self.cache
        expected = []
        for row, slot in enumerate(slots):
            if slot < 0:
                continue
            n = int(cache.cursor[slot])
            assert n == len(self.rings[slot])
            base = cache.checkpoint_values(slot) if n == cache.ring_len - 1 else cache.read_values(slot)
            ring = self.rings[slot] + [{name: inp[name][row:row + 1] for name in NAMES}]
            stacked = {name: torch.stack([t[name] for t in ring]) for name in NAMES}
            o, _ = reference.decode_exact(base, *(stacked[name] for name in NAMES), **kw)
            expected.append(o[-1, 0])
            self.rings[slot] = [] if n == cache.ring_len - 1 else ring
        out = torch.full(inp["v"].shape, float("nan"), dtype=inp["v"].dtype)
        indices = torch.tensor(slots, dtype=torch.int32)
        qstate.gated_delta_replay(cache, **inp, slot_indices=indices, out=out, **kw)
        live = [row for row, slot in enumerate(slots) if slot >= 0]
        return out, out[live], torch.stack(expected)


def check_read_copy(cache):
    if cache.read_format is None:
        return
    want = formats.quantize(cache.checkpoint_values(range(cache.num_slots)), cache.read_format)
    assert torch.equal(bits_of(cache.read), bits_of(want.data))
    if want.scale is not None:
        assert torch.equal(bits_of(cache.read_scale), bits_of(want.scale))


CASES = [
    # (channel, ring_len, checkpoint, read)
    (False, 1, "fp32", None),
    (False, 4, "fp32", "fp8_e4m3:row"),
    (True, 4, "fp32", "int8:row"),
    (True, 4, "bf16", "fp8_e5m2:row"),
    (False, 4, "fp16", "bf16"),
    (True, 16, "fp32", "fp8_e4m3:row"),
]


@pytest.mark.parametrize("channel,ring_len,checkpoint,read", CASES)
def test_each_step_against_the_exact_recurrence_from_what_it_reads(channel, ring_len, checkpoint, read):
    steps = ring_len + 1 if ring_len > 1 else 3
    slots = [1, 0] if ring_len < 16 else [0]  # the long ring on one row: the interpreter pays per program
    cache = allocate(2, channel=channel, ring_len=ring_len, read=read, checkpoint=checkpoint)
    cache.reset([0, 1], torch.randn(2, 2, 16, 32, generator=torch.Generator().manual_seed(5)))
    tracker = Tracker(cache)
    for t in range(steps):
        inp = token(len(slots), 1, 2, 32, 16, channel=channel, seed=t)
        _, out, expected = tracker.step(inp, slots)
        assert rel_rms(out, expected) < bound(32, ring_len), f"step {t}"
        check_read_copy(cache)
    assert cache.cursor[0] == steps % ring_len


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_against_decode_replay_end_to_end(channel):
    """fp32 checkpoint, no read copy, HV/HK 4 (GDN) or 2 (KDA), bf16 inputs: outputs, the last
    stored checkpoint and the materialized state equal decode_replay's within fp32 rounding."""
    T, L, HK, HV, K, V = 5, 4, 1, 2 if channel else 4, 32, 24
    inp = tokens(T, 2, HK, HV, K, V, channel=channel, dtype=torch.bfloat16)
    state0 = torch.randn(2, HV, V, K, generator=torch.Generator().manual_seed(3))
    cache = allocate(2, channel=channel, ring_len=L, read=None, HK=HK, HV=HV, K=K, V=V, input_dtype=torch.bfloat16)
    cache.reset([0, 1], state0)
    outs = [qstate.gated_delta_replay(cache, *(inp[n][t] for n in NAMES)).float() for t in range(T)]
    o_ref, final, ck = reference.decode_replay(state0, *(inp[n] for n in NAMES), ring_len=L, return_checkpoint=True)
    # bf16 outputs: one rounding of 2**-9 relative.
    assert rel_rms(torch.stack(outs), o_ref) < 2.0**-8
    assert rel_rms(cache.checkpoint, ck) < bound(K, L)
    assert rel_rms(cache.materialize([0, 1]), final) < bound(K, T)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_staggered_cursors_slot_indices_padding_and_reset(monkeypatch, chunked):
    """Slots advanced to different cursors, then steps over all of them with padding rows; a
    mid-stream reset starts its slot afresh; untouched slots stay bit for bit. ``chunked``: the
    GPU's shape, V in tiles of 4 rows (the flush's too), 2 chunks a step program."""
    from qstate.kernels.gated_delta import replay
    if chunked:
        monkeypatch.setattr(replay, "INTERPRETER_SPLIT", (4, 2))
    L = 4
    cache = allocate(5, channel=True, ring_len=L, read="fp8_e4m3:row")
    cache.reset(range(5), torch.randn(5, 2, 16, 32, generator=torch.Generator().manual_seed(9)))
    tracker = Tracker(cache)
    for t, slots in enumerate(([0], [0, 2], [2, 3, 0])):
        tracker.step(token(len(slots), 1, 2, 32, 16, channel=True, seed=20 + t), slots)
    assert cache.cursor.tolist() == [3, 0, 2, 1, 0]
    untouched = {name: t.clone() for name, t in cache.tensors().items() if t is not None}
    for t in range(3):
        slots = [3, -1, 0, 2]
        full, out, expected = tracker.step(token(4, 1, 2, 32, 16, channel=True, seed=30 + t), slots)
        assert torch.equal(full[1], torch.zeros_like(full[1]))
        assert rel_rms(out, expected) < bound(32, L)
        check_read_copy(cache)
        if t == 1:
            cache.reset([2], torch.randn(1, 2, 16, 32))
            tracker.reset(2)
    for name in ("checkpoint", "read", "read_scale", "ring_k", "ring_v", "ring_g", "ring_beta", "ring_inverse"):
        for slot in (1, 4):
            assert torch.equal(bits_of(getattr(cache, name)[slot]), bits_of(untouched[name][slot])), name
    assert cache.cursor.tolist() == [2, 0, 1, 0, 0]


@pytest.mark.parametrize("in_sweep", [True, False], ids=["in-sweep", "loop"])
def test_ring_inverse_rows_kept_by_the_steps_and_rebuilt_by_from_tensors(monkeypatch, in_sweep):
    """A KDA step that appends token j writes row j of (I + B)⁻¹ (B_ji = β_j k̂_j·(e^{Γ_j − Γ_i} ⊙
    k̂_i), i < j), from K-sums in the sweep or in a loop before it; from_tensors computes the same
    rows from the ring (fp64, then fp32), so a cache built mid-ring over another's tensors folds
    as that one does. Rows past the cursor stay zero. GDN caches keep none."""
    from qstate.kernels.gated_delta import replay
    monkeypatch.setattr(replay, "INVERSE_IN_SWEEP", in_sweep)
    L, HK, HV, K, V, n, channel = 8, 1, 2, 32, 16, 5, True
    gdn = allocate(2, channel=False, ring_len=L, read=None, HK=HK, HV=HV, K=K, V=V)
    assert gdn.ring_inverse is None and not gdn.keeps_inverse
    with pytest.raises(ValueError, match='^ring_inverse: expected None with gate "scalar"'):
        qstate.GatedDeltaReplayCache.from_tensors(
            checkpoint=gdn.checkpoint, ring_k=gdn.ring_k, ring_v=gdn.ring_v, ring_g=gdn.ring_g,
            ring_beta=gdn.ring_beta, cursor=gdn.cursor, ring_inverse=torch.zeros(2, HV, L, L))
    cache = allocate(2, channel=channel, ring_len=L, read=None, HK=HK, HV=HV, K=K, V=V)
    cache.reset([0, 1], torch.randn(2, HV, V, K, generator=torch.Generator().manual_seed(4)))
    for t in range(n):
        qstate.gated_delta_replay(cache, **token(2, HK, HV, K, V, channel=channel, seed=50 + t))
    kept = cache.ring_inverse.clone()
    assert torch.equal(kept[:, :, n:], torch.zeros_like(kept[:, :, n:]))
    # Lower triangular with a unit diagonal, and not the identity (the keys do interact).
    rows = kept[:, :, :n, :n]
    assert torch.equal(rows.diagonal(dim1=-2, dim2=-1), torch.ones(2, HV, n))
    assert torch.equal(rows.triu(1), torch.zeros_like(rows)) and (rows.tril(-1).abs() > 1e-3).any()
    clones = {name: getattr(cache, name).clone() for name in ("checkpoint", "ring_k", "ring_v", "ring_g", "ring_beta",
                                                             "cursor")}
    again = qstate.GatedDeltaReplayCache.from_tensors(**clones)
    assert rel_rms(again.ring_inverse, kept) < 2.0**-20
    assert torch.equal(again.ring_inverse[:, :, n:], torch.zeros_like(kept[:, :, n:]))
    for t in range(n, L):
        inp = token(2, HK, HV, K, V, channel=channel, seed=50 + t)
        out, out_again = qstate.gated_delta_replay(cache, **inp), qstate.gated_delta_replay(again, **inp)
    assert cache.cursor.tolist() == again.cursor.tolist() == [0, 0]
    assert rel_rms(out_again, out) < bound(K, L) and rel_rms(again.checkpoint, cache.checkpoint) < bound(K, L)
    with pytest.raises(TypeError, match="^use_qk_l2norm:"):
        qstate.GatedDeltaReplayCache.from_tensors(**clones, use_qk_l2norm=1)


def test_sizes_and_from_tensors():
    cache = allocate(2, channel=True, ring_len=4, read="int8:row")
    assert cache.gate == "channel" and cache.ring_len == 4 and cache.input_dtype == torch.float32
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in cache.tensors().values() if t is not None)
    # The Qwen3.5-122B-A10B layer: the traffic of a conventional fp32 step (read and write the
    # state) over the replay cycle's (docs/design.md#gdn-shapes: about 4.6x).
    big = qstate.GatedDeltaReplayCache.allocate(1, 16, 64, 128, 128, device="meta")
    assert 4.4 < 2 * 64 * 128 * 128 * 4 / big.bytes_per_step() < 4.8
    again = qstate.GatedDeltaReplayCache.from_tensors(
        checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
        ring_beta=cache.ring_beta, cursor=cache.cursor, read_format="int8:row", read=cache.read,
        read_scale=cache.read_scale)
    assert again.gate == "channel" and again.checkpoint is cache.checkpoint
    with pytest.raises(ValueError, match="^cursor:"):
        qstate.GatedDeltaReplayCache.from_tensors(
            checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
            ring_beta=cache.ring_beta, cursor=torch.tensor([0, 4], dtype=torch.int32), read_format="int8:row",
            read=cache.read, read_scale=cache.read_scale)
    with pytest.raises(ValueError, match="^drafts:"):
        qstate.GatedDeltaReplayCache.from_tensors(
            checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
            ring_beta=cache.ring_beta, cursor=cache.cursor, read_format="int8:row", read=cache.read,
            read_scale=cache.read_scale, drafts=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="^read:"):
        qstate.GatedDeltaReplayCache.from_tensors(
            checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
            ring_beta=cache.ring_beta, cursor=cache.cursor, read_format="int8:row", read_scale=cache.read_scale)
    with pytest.raises(ValueError, match="^ring_inverse:"):
        qstate.GatedDeltaReplayCache.from_tensors(
            checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
            ring_beta=cache.ring_beta, cursor=cache.cursor, read_format="int8:row", read=cache.read,
            read_scale=cache.read_scale, ring_inverse=torch.zeros(2, 2, 4, 3))
    assert cache.ring_inverse.shape == (2, 2, 4, 4)
    assert qstate.GatedDeltaReplayCache.allocate(1, 1, 2, 32, 16, max_draft=2).ring_inverse is None
    with pytest.raises(ValueError, match="^checkpoint:"):
        allocate(1, channel=False, ring_len=4, read=None, checkpoint="int8:row")
    with pytest.raises(ValueError, match="^read:"):
        allocate(1, channel=False, ring_len=4, read="int8:head")
    with pytest.raises(ValueError, match="^gate:"):
        qstate.GatedDeltaReplayCache.allocate(1, 1, 2, 32, 16, gate="vector")


@pytest.mark.parametrize("slots, exc, message", [
    (1.5, TypeError, "slots: expected an int, a sequence"),
    ([0, 1.0], TypeError, "slots: expected a flat sequence of ints"),
    (torch.tensor([0.0]), TypeError, "slots: expected a 1-D integer tensor"),
    ([0, 3], ValueError, r"slots: expected slot indices in \[0, 3\), got min 0, max 3"),
    ([1, 1], ValueError, "slots: expected distinct slot indices"),
])
def test_reset_names_bad_slots_and_changes_nothing(slots, exc, message):
    cache = allocate(3, channel=False, ring_len=4, read="fp8_e4m3:row")
    cache.cursor.fill_(2)
    before = {name: t.clone() for name, t in cache.tensors().items() if t is not None}
    with pytest.raises(exc, match=f"^{message}"):
        cache.reset(slots, torch.ones(2, *cache.checkpoint.shape[1:]))
    for name, t in before.items():
        assert torch.equal(getattr(cache, name), t), name


BAD = [
    (dict(g=torch.zeros(2, 2, 32)), ValueError, "g"),
    (dict(k=torch.zeros(2, 1, 24), q=torch.zeros(2, 1, 24)), ValueError, "k"),
    (dict(k=torch.zeros(2, 2, 32), q=torch.zeros(2, 2, 32)), ValueError, "k"),
    (dict(v=torch.zeros(2, 2, 8)), ValueError, "v"),
    (dict(v=torch.zeros(2, 2, 16, dtype=torch.bfloat16)), TypeError, "v"),
    (dict(g=torch.full((2, 2), 0.5)), ValueError, "g"),
    (dict(beta=torch.full((2, 2), -0.5)), ValueError, "beta"),
    (dict(slot_indices=torch.tensor([0, 3])), ValueError, "slot_indices"),
    (dict(slot_indices=torch.tensor([1, 1])), ValueError, "slot_indices"),
    (dict(slot_indices=torch.tensor([0, 2], dtype=torch.int16)), TypeError, "slot_indices"),
    (dict(slot_indices=None), ValueError, "v"),  # 2 rows, 3 slots: rows must match slots without indices
    (dict(out=torch.zeros(2, 2, 8)), ValueError, "out"),
    (dict(scale=0.0), ValueError, "scale"),
]


@pytest.mark.parametrize("overrides,exc,name", BAD)
def test_bad_input_names_the_argument_and_changes_nothing(overrides, exc, name):
    cache = allocate(3, channel=False, ring_len=4, read="fp8_e4m3:row")
    before = {n: t.clone() for n, t in cache.tensors().items() if t is not None}
    args = dict(token(2, 1, 2, 32, 16), slot_indices=torch.tensor([0, 2]))
    args.update(overrides)
    with pytest.raises(exc, match=f"^{name}:"):
        qstate.gated_delta_replay(cache, **args)
    for n, t in before.items():
        assert torch.equal(bits_of(getattr(cache, n)), bits_of(t)), n


def test_a_cache_of_another_family_is_refused():
    mamba = qstate.ReplayCache.allocate(2, 2, 16, 32, read=None)
    with pytest.raises(TypeError, match="^cache:"):
        qstate.gated_delta_replay(mamba, **token(2, 1, 2, 32, 16))


def test_torch_compile_through_the_custom_ops():
    """Both ops trace whole (fullgraph) through their custom ops and equal the eager calls."""
    inp = token(2, 1, 2, 32, 16)
    eager, traced = (allocate(2, channel=False, ring_len=2, read="int8:row") for _ in range(2))
    state = torch.randn(2, 2, 16, 32)
    eager_state = state.clone()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(state, q, k, v, g, beta):
        return qstate.gated_delta_replay(traced, q, k, v, g, beta), qstate.gated_delta_update(state, q, k, v, g, beta)

    for _ in range(2):
        expected = qstate.gated_delta_replay(eager, **inp), qstate.gated_delta_update(eager_state, **inp)
        got = step(state, **inp)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert torch.equal(state, eager_state)
        for name in ("checkpoint", "read", "read_scale", "ring_k", "cursor"):
            assert torch.equal(getattr(traced, name), getattr(eager, name)), name


def test_fake_tensors_go_through_the_fake_impls_without_reading_values():
    """Under ``FakeTensorMode`` (CPU fake tensors hold no values) the value checks of slot
    indices, gates and betas stand aside and both ops return outputs of the right shape."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    real = allocate(3, channel=False, ring_len=4, read="fp8_e4m3:row")
    fake = lambda t: None if t is None else mode.from_tensor(t)  # noqa: E731
    cache = dataclasses.replace(real, **{name: fake(t) for name, t in real.tensors().items()})
    inputs = {name: fake(t) for name, t in token(2, 1, 2, 32, 16).items()}
    state, slots = fake(torch.zeros(3, 2, 16, 32)), fake(torch.tensor([2, 0]))
    with mode:
        out = qstate.gated_delta_replay(cache, **inputs, slot_indices=slots)
        conventional = qstate.gated_delta_update(state, **inputs, state_indices=slots)
    assert out.shape == conventional.shape == (2, 2, 16)


@pytest.mark.parametrize("channel,ring_len,checkpoint,read,prefetch", [(*CASES[1], True), (*CASES[2], False)])
def test_split_chunked_programs_as_on_a_gpu(monkeypatch, channel, ring_len, checkpoint, read, prefetch):
    """The GPU's launch shape under the interpreter: V split over programs, each sweeping the ring
    once and streaming several chunks of V (here 2 programs × 2 chunks of 4 rows of V = 16), with
    and without loading a chunk ahead."""
    from qstate.kernels.gated_delta import replay
    monkeypatch.setattr(replay, "INTERPRETER_SPLIT", (4, 2))
    monkeypatch.setattr(replay, "PREFETCH", prefetch)
    cache = allocate(2, channel=channel, ring_len=ring_len, read=read, checkpoint=checkpoint)
    cache.reset([0, 1], torch.randn(2, 2, 16, 32, generator=torch.Generator().manual_seed(6)))
    tracker = Tracker(cache)
    for t in range(ring_len + 1):
        inp = token(2, 1, 2, 32, 16, channel=channel, seed=10 + t)
        _, out, expected = tracker.step(inp, [1, 0])
        assert rel_rms(out, expected) < bound(32, ring_len), f"step {t}"
        check_read_copy(cache)


# ---------------------------------------------------------------------------- prepared eager launches


def _eager_call(seed, batch, num_slots):
    """One step's arguments with bf16 inputs and output and slot indices with a padding row."""
    args = token(batch, 1, 2, 32, 16, seed=seed, dtype=torch.bfloat16)
    slots = torch.arange(batch) % num_slots
    slots[1] = -1
    return dict(args, slot_indices=slots, out=torch.empty(batch, 2, 16, dtype=torch.bfloat16))


def _launched_as(entry):
    """How a logged launch was made: "bind", "compiled" (CompiledLaunch's table: the launcher's
    storage view of the fp8 read copy) or "prepared" (the cache's fp8 tensor itself)."""
    kind, _, args = entry[:3]
    return "prepared" if kind == "compiled" and args[8].dtype == torch.float8_e4m3fn else kind


def test_an_eager_repeat_launches_what_the_full_path_would(stand_in_kernels):
    """Second call of a signature, other inputs and another cache of the same layout: the step
    and flush kernels' compiled launchers, no bind, with exactly the arguments the launcher
    computes for that call (tensors by address, the call's own row_cursor)."""
    from qstate.kernels.gated_delta import replay

    log = stand_in_kernels(replay)
    caches = [allocate(4, channel=False, ring_len=4, read="fp8_e4m3:row", input_dtype=torch.bfloat16)
              for _ in range(2)]
    qstate.gated_delta_replay(caches[0], **_eager_call(0, 3, 4))
    second = _eager_call(1, 3, 4)
    qstate.gated_delta_replay(caches[1], **second)
    names = ["_replay_step_kernel", "_replay_flush_kernel"]
    assert [(_launched_as(entry), entry[1]) for entry in log] == [("bind", n) for n in names] + [
        ("prepared", n) for n in names]
    row_cursor = log[2][2][17]
    assert log[3][2][17] is row_cursor and row_cursor is not log[0][2][17]
    s = second
    expected = replay._launches(caches[1], s["q"], s["k"], s["v"], s["g"], s["beta"], s["slot_indices"], s["out"],
                                row_cursor, qk_scale=32 ** -0.5, use_qk_l2norm=True)
    for bound, launched, (launch, _, args, constexprs) in zip(log[:2], log[2:], expected):
        assert bound[3] == constexprs
        assert_launched_as_computed(launched[2], args, constexprs, launch.kernel.signature.parameters)


def test_an_eager_repeat_takes_the_full_path_where_it_must(stand_in_kernels):
    """Another scale is another signature (its launches are bound again); a read copy at another
    16-byte alignment has the signature's layout but is another compiled kernel, so its calls
    launch from CompiledLaunch's table, and the aligned cache's calls still take the prepared
    launches."""
    import dataclasses

    from qstate.kernels.gated_delta import replay

    log = stand_in_kernels(replay)
    cache = allocate(4, channel=False, ring_len=4, read="fp8_e4m3:row", input_dtype=torch.bfloat16)

    def call(seed, cache=cache, **overrides):
        start = len(log)
        qstate.gated_delta_replay(cache, **{**_eager_call(seed, 3, 4), **overrides})
        return [_launched_as(entry) for entry in log[start:]]

    assert call(0) == ["bind", "bind"]
    assert call(1) == ["prepared", "prepared"]
    assert call(2, scale=0.25) == ["bind", "bind"]
    assert call(3, scale=0.25) == ["prepared", "prepared"]
    shifted = torch.empty(cache.read.numel() + 1, dtype=torch.uint8)[1:].view(torch.float8_e4m3fn).view(
        cache.read.shape)  # 1 byte off
    moved = dataclasses.replace(cache, read=shifted)
    assert call(4, cache=moved) == ["bind", "bind"]
    assert call(5, cache=moved) == ["compiled", "compiled"]
    assert call(6) == ["prepared", "prepared"]
