"""Jit pieces over a gated delta rule replay ring, shared by replay decode (``replay_kernels``)
and speculative decoding (``speculative_kernels``): one ring token's key, gate and β, one
token applied to a state tile, and a ring folded into state rows."""

import triton
import triton.language as tl

from . import tile

# Tokens per step of fold_rows_streamed, their loads in flight together (M, a power of two ≥ 16,
# is a multiple).
FOLD_TOKENS_PER_STEP: tl.constexpr = tl.constexpr(4)
# Key columns per pass of stage_fold_operands: [M, 32] pieces keep the operands' registers below
# those of the state rows they are folded into (a power of two ≥ 16 for tl.dot, ≤ BLOCK_K).
FOLD_KEY_COLUMNS: tl.constexpr = tl.constexpr(32)


@triton.jit
def ring_token(ring_k, ring_g, ring_beta, j, cols, K, L2NORM: tl.constexpr, CHANNEL: tl.constexpr):
    """Token ``j`` of a head's ring without its value (the pointers are the head's first ring
    entries): ``(k, r, α, β)`` in fp32, the key as stored and ``r`` its norm's reciprocal, ``k̂ =
    r k`` (``tile.load_key_unnormalized``); ``α`` ``[BLOCK_K]`` per channel or a scalar."""
    k, r = tile.load_key_unnormalized(ring_k + j * K, cols, K, L2NORM)
    if CHANNEL:
        alpha = tile.decay(ring_g + j * K, cols, K, CHANNEL)
    else:
        alpha = tile.decay(ring_g + j, cols, K, CHANNEL)
    return k, r, alpha, tl.load(ring_beta + j)


@triton.jit
def apply_token(S, k, v, alpha, beta, CHANNEL: tl.constexpr):
    """``S diag(α) + d k̂ᵀ``, ``d = β (v − S diag(α) k̂)``: one token on a ``[BLOCK_V, BLOCK_K]``
    tile, in the references' order."""
    S = tile.apply_decay(S, alpha, CHANNEL)
    d = beta * (v - tl.sum(S * k[None, :], axis=1))
    return S + d[:, None] * k[None, :]


@triton.jit
def unit_lower_inverse(B, pos, M: tl.constexpr):
    """``(I + B)⁻¹ [M, M]`` of a strictly lower triangular ``B`` (``pos = arange(M)``): with ``B^M =
    0``, ``Σ_k (−B)^k = Π_s (I + (−B)^(2^s))``, log2(M) small fp32 products instead of M dependent
    substitution steps."""
    identity = tl.where(pos[:, None] == pos[None, :], 1.0, 0.0)
    power = -B
    inverse = identity + power
    for s in tl.static_range(1, 8):
        if (1 << s) < M:
            power = tl.dot(power, power, input_precision="ieee")
            inverse = tl.dot(inverse, identity + power, input_precision="ieee")
    return inverse


@triton.jit
def fold_operands(keys, g, beta, kept, count, cols, K, L2NORM: tl.constexpr, CHANNEL: tl.constexpr,
                  M: tl.constexpr, PRECISION: tl.constexpr):
    """What folding ``count`` tokens into a state takes, for every row of one head: the tokens
    (oldest first, ``M ≥ count`` positions, zero past ``count``) are raw keys ``[M, BLOCK_K]``,
    log-gates ``g`` (``[M]`` GDN, ``[M, BLOCK_K]`` KDA) and ``β [M]``. With ``Γ_j = Σ_{i≤j} g_i``
    (the decay from the state to token j), it returns ``(key_in, key_out, inverse, beta, decay)``:
    ``key_in = k̂_j e^{Γ_j}`` (what token j reads of the state), ``key_out = k̂_j e^{Γ_last − Γ_j}``
    (what its correction leaves in the result), ``inverse = (I + B)⁻¹`` with ``B_ji = β_j
    (k̂_j e^{Γ_j − Γ_i} k̂_iᵀ)`` for ``i < j`` (how earlier corrections reach later reads), β
    zero past ``count``, and ``e^{Γ_last}`` (scalar GDN, ``[BLOCK_K]`` KDA): see :func:`fold_rows`.
    GDN: ``B`` from the Gram product (``PRECISION``: its ``tl.dot`` input precision), then
    :func:`unit_lower_inverse`. KDA: ``kept [M, M]`` holds rows ``0 … count − 2`` of the inverse as
    the steps kept them (zero elsewhere), and only the last row is computed, by forward
    substitution ``e_last − Σ_i B_last,i inverse_i`` with ``B_last,i = β_last k̂_last·key_out_i``."""
    pos = tl.arange(0, M)
    live = pos < count
    last_token = pos == count - 1
    keys = keys.to(tl.float32)
    if L2NORM:
        norm = tl.sqrt_rn(tl.sum(keys * keys, axis=1) + tile.L2_EPS)  # [M]
        keys = tl.div_rn(keys, norm[:, None] + tl.zeros_like(keys))
    keys = tl.where(live[:, None], keys, 0.0)
    beta = tl.where(live, beta, 0.0)
    if CHANNEL:
        g = tl.where(live[:, None] & (cols[None, :] < K), g, 0.0)
        gamma = tl.cumsum(g, axis=0)  # [M, BLOCK_K]
        last = tl.sum(tl.where(last_token[:, None], gamma, 0.0), axis=0)  # [BLOCK_K]
        key_in = keys * tl.exp(gamma)
        key_out = keys * tl.exp(last[None, :] - gamma)
        key_last = tl.sum(tl.where(last_token[:, None], keys, 0.0), axis=0)  # [BLOCK_K]
        beta_last = tl.sum(tl.where(last_token, beta, 0.0), axis=0)
        b_last = tl.where(pos < count - 1, beta_last * tl.sum(key_out * key_last[None, :], axis=1), 0.0)  # [M]
        row_last = tl.where(last_token, 1.0, 0.0) - tl.sum(b_last[:, None] * kept, axis=0)  # [M]
        inverse = tl.where(last_token[:, None], row_last[None, :], kept)
    else:
        g = tl.where(live, g, 0.0)
        gamma = tl.cumsum(g, axis=0)  # [M]
        last = tl.sum(tl.where(last_token, gamma, 0.0), axis=0)
        key_in = keys * tl.exp(gamma)[:, None]
        key_out = keys * tl.exp(last - gamma)[:, None]
        before = pos[None, :] < pos[:, None]  # [M, M]: i < j
        gram = tl.dot(keys, tl.trans(keys), input_precision=PRECISION)  # [M, M]
        B = tl.where(before, gram * tl.exp(tl.where(before, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        inverse = unit_lower_inverse(beta[:, None] * B, pos, M)
    return key_in, key_out, inverse, beta, tl.exp(last)


@triton.jit
def fold_rows(S, values, key_in, key_out, inverse, beta, decay, CHANNEL: tl.constexpr, PRECISION: tl.constexpr):
    """The state rows ``S [BLOCK_V, BLOCK_K]`` after the tokens of :func:`fold_operands`
    (``values [BLOCK_V, M]``: each token's v over these rows), in matrix form (products at
    ``PRECISION``, accumulated in fp32): the
    reads ``W = S key_inᵀ``, the corrections ``D = β (values − W) (I + B)⁻ᵀ`` (each token's
    ``d = β (v − S_{j−1} diag(α_j) k̂_j)``, earlier corrections included), and ``S e^{Γ_last} +
    D key_out``. The token-by-token fold's result, its sums in another order."""
    reads = tl.dot(S, tl.trans(key_in), input_precision=PRECISION)  # [BLOCK_V, M]
    corrections = tl.dot(beta[None, :] * (values - reads), tl.trans(inverse), input_precision=PRECISION)
    return tile.apply_decay(S, decay, CHANNEL) + tl.dot(corrections, key_out, input_precision=PRECISION)


@triton.jit
def fold_update(key_out, inverse, beta, PRECISION: tl.constexpr):
    """``update = diag(β) (I + B)⁻ᵀ key_out [M, BLOCK_K]`` from :func:`fold_operands`: row j is how
    token j's ``v_j − S key_in_j`` reaches the folded state, so that :func:`fold_rows`'s result is
    ``S e^{Γ_last} + (values − W) update`` (:func:`fold_rows_streamed`)."""
    return beta[:, None] * tl.dot(tl.trans(inverse), key_out, input_precision=PRECISION)


@triton.jit
def _staged_keys(ring_k, pos, live, first, norm, K, L2NORM: tl.constexpr):
    """Columns ``first …`` (``FOLD_KEY_COLUMNS`` of them) of the ring's keys ``[M, 32]`` in fp32,
    divided by their ``norm [M]`` when ``L2NORM``; zero past ``count`` tokens and past K."""
    cols = first + tl.arange(0, FOLD_KEY_COLUMNS)
    keys = tl.load(ring_k + pos[:, None] * K + cols[None, :], mask=live[:, None] & (cols < K)[None, :],
                   other=0.0).to(tl.float32)
    if L2NORM:
        keys = tl.div_rn(keys, norm[:, None] + tl.zeros_like(keys))
    return keys


@triton.jit
def _staged_gamma(ring_g, pos, live, first, K):
    """KDA: columns ``first …`` of ``Γ_j = Σ_{i≤j} g_i`` ``[M, 32]`` (zero past ``count`` and K)."""
    cols = first + tl.arange(0, FOLD_KEY_COLUMNS)
    g = tl.load(ring_g + pos[:, None] * K + cols[None, :], mask=live[:, None] & (cols < K)[None, :], other=0.0)
    return tl.cumsum(g.to(tl.float32), axis=0)


@triton.jit
def stage_fold_operands(scratch, ring_k, ring_g, ring_beta, count, K, L2NORM: tl.constexpr, CHANNEL: tl.constexpr,
                        M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """:func:`fold_operands`' operands with the whole ``(I + B)⁻¹`` computed here (no step kept
    rows of it: ``B`` from the Gram product, KDA's a column at a time, then
    :func:`unit_lower_inverse`), then :func:`fold_update`,
    of one head's ring (pointers at its first entry: keys ``[·, K]``, log-gates, β),
    ``FOLD_KEY_COLUMNS`` key columns at a time, stored to
    ``scratch``: ``key_in [M, BLOCK_K]`` and ``update [M, BLOCK_K]`` (zero past K and ``count``)
    and, KDA, ``e^{Γ_last} [BLOCK_K]``. Returns ``e^{Γ_last}`` (GDN; KDA: 1, the row is
    in the scratch). Only ``[M, M]`` and ``[M, 32]`` pieces live at once, so a kernel that folds
    state rows after it keeps its rows' registers; the caller places a barrier before reading."""
    pos = tl.arange(0, M)
    live = pos < count
    kc = tl.arange(0, FOLD_KEY_COLUMNS)
    beta = tl.load(ring_beta + pos, mask=live, other=0.0).to(tl.float32)
    norm = tl.full([M], 1.0, tl.float32)
    if L2NORM:
        squares = tl.zeros([M], tl.float32)
        for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
            keys = _staged_keys(ring_k, pos, live, first, norm, K, False)
            squares += tl.sum(keys * keys, axis=1)
        norm = tl.sqrt_rn(squares + tile.L2_EPS)
    before = pos[None, :] < pos[:, None]  # [M, M]: i < j
    B = tl.zeros([M, M], tl.float32)
    if CHANNEL:
        # B's columns one token at a time (a loop, not unrolled: registers): the decays between
        # two tokens differ per channel.
        for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
            keys = _staged_keys(ring_k, pos, live, first, norm, K, L2NORM)  # [M, 32]
            gamma = _staged_gamma(ring_g, pos, live, first, K)
            for i in range(0, count):
                at_i = (pos == i)[:, None]
                key_i = tl.sum(tl.where(at_i, keys, 0.0), axis=0)  # [32]
                gamma_i = tl.sum(tl.where(at_i, gamma, 0.0), axis=0)
                decays = tl.exp(tl.minimum(gamma - gamma_i[None, :], 0.0))  # exponent ≤ 0 where it counts
                column = tl.sum(keys * decays * key_i[None, :], axis=1)  # [M]
                B += tl.where((pos == i)[None, :], column[:, None], 0.0)
        B = tl.where(before, B, 0.0)
        decay = 1.0
    else:
        g = tl.load(ring_g + pos, mask=live, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, axis=0)  # [M]
        last = tl.sum(tl.where(pos == count - 1, gamma, 0.0), axis=0)
        for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
            keys = _staged_keys(ring_k, pos, live, first, norm, K, L2NORM)
            B += tl.dot(keys, tl.trans(keys), input_precision=PRECISION)  # the Gram product, [M, M]
        B = tl.where(before, B * tl.exp(tl.where(before, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        decay = tl.exp(last)
    inverse = unit_lower_inverse(beta[:, None] * B, pos, M)
    for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
        keys = _staged_keys(ring_k, pos, live, first, norm, K, L2NORM)
        if CHANNEL:
            gamma = _staged_gamma(ring_g, pos, live, first, K)
            last = tl.sum(tl.where((pos == count - 1)[:, None], gamma, 0.0), axis=0)  # [32]
            key_in = keys * tl.exp(gamma)
            key_out = keys * tl.exp(last[None, :] - gamma)
            tl.store(scratch + 2 * M * BLOCK_K + first + kc, tl.exp(last))
        else:
            key_in = keys * tl.exp(gamma)[:, None]
            key_out = keys * tl.exp(last - gamma)[:, None]
        piece = pos[:, None] * BLOCK_K + first + kc[None, :]
        tl.store(scratch + piece, key_in)
        tl.store(scratch + M * BLOCK_K + piece, fold_update(key_out, inverse, beta, PRECISION))
    return decay


@triton.jit
def fold_rows_streamed(S, decay, operands, ring_v, V, rows, row_mask, cols, count, M: tl.constexpr,
                       BLOCK_K: tl.constexpr, CHANNEL: tl.constexpr):
    """:func:`fold_rows` token by token: ``S e^{Γ_last} + Σ_j (v_j − S key_in_j) update_j`` over
    ``count`` tokens (``update`` from :func:`fold_update`), the same sum in another order.
    ``operands`` holds ``key_in`` then ``update`` (``[2, M, BLOCK_K]`` fp32, written by the
    program before a barrier), ``ring_v`` the head's first ring value (token j's at ``j · V``).
    Every read is of the unfolded ``S``, so the terms are independent; fp32 FMAs hold a tile's
    registers where products on tensor cores spilled."""
    folded = tile.apply_decay(S, decay, CHANNEL)
    for first in range(0, count, FOLD_TOKENS_PER_STEP):
        # A step's loads issue together; past count the operands are zero and v is masked
        # (a rejected draft's v may be NaN).
        for u in tl.static_range(FOLD_TOKENS_PER_STEP):
            j = first + u
            key_in = tl.load(operands + j * BLOCK_K + cols)
            update = tl.load(operands + (M + j) * BLOCK_K + cols)
            value = tl.load(ring_v + j * V + rows, mask=row_mask & (tl.zeros_like(rows) + j < count),
                            other=0.0).to(tl.float32)
            folded += (value - tl.sum(S * key_in[None, :], axis=1))[:, None] * update[None, :]
    return folded
