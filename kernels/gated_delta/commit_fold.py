"""The commit fold in split form (``speculative.FOLD_OPERANDS_KERNEL``): the replay flush's
matrix form (:func:`.ring.fold_operands`, :func:`.ring.fold_rows`) regrouped so that a kernel of
its own computes an ``[M, M]`` matrix per head and the state rows need only it and the raw ring
keys. With ``r_j`` the key norms' reciprocals, ``a_j = r_j e^{Γ_j}``, ``b_j = r_j e^{Γ_last −
Γ_j}`` (KDA ``a_j = b_j = r_j``, its per-channel factors applied to the keys in the row pass) and
``U = diag(β) (I + B)⁻ᵀ diag(b)``: ``R_j = v_j − a_j S k_j`` and ``S ← S e^{Γ_last} + Σ_j (R U)_j k_j``."""

import triton
import triton.language as tl

from . import tile
from .ring import FOLD_KEY_COLUMNS, FOLD_TOKENS_PER_STEP, add_channel_products, key_piece, unit_lower_inverse


@triton.jit
def fold_keys(ring_k, count, K, L2NORM: tl.constexpr, CHANNEL: tl.constexpr, M: tl.constexpr,
              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``(r [M], gram [M, M])`` of a key head's ring (``ring_k`` at its first entry): the keys'
    norms' reciprocals (``tile.load_key_unnormalized``'s; 1 without ``L2NORM``) and, GDN, the Gram
    product of the normalized keys at ``PRECISION`` (KDA: zeros). ``FOLD_KEY_COLUMNS`` columns a
    pass, so only ``[M, 32]`` pieces hold registers."""
    pos = tl.arange(0, M)
    live = pos < count
    r = tl.full([M], 1.0, tl.float32)
    if L2NORM:
        squares = tl.zeros([M], tl.float32)
        for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
            keys = key_piece(ring_k, pos, live, first, K)
            squares += tl.sum(keys * keys, axis=1)
        r = tl.div_rn(1.0, tl.sqrt_rn(squares + tile.L2_EPS))
    gram = tl.zeros([M, M], tl.float32)
    if not CHANNEL:
        for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
            keys = key_piece(ring_k, pos, live, first, K) * r[:, None]
            gram += tl.dot(keys, tl.trans(keys), input_precision=PRECISION)
    return r, gram


@triton.jit
def fold_coefficients(ring_k, r, gram, ring_g, ring_beta, count, K, CHANNEL: tl.constexpr, M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """:func:`.ring.fold_operands` in the form :func:`fold_rows_by_token` takes, for one value head,
    from :func:`fold_keys`'s ``r`` and ``gram`` and the head's ring log-gates and β (pointers at
    its first entry; ``ring_k`` at the key head's). Returns ``(U, a, decay)``: with ``b_j = r_j
    e^{Γ_last − Γ_j}`` (GDN; KDA ``r_j``), ``U = diag(β) (I + B)⁻ᵀ diag(b) [M, M]``, ``a_j = r_j
    e^{Γ_j}`` (GDN; KDA ``r_j``), and ``e^{Γ_last}`` (GDN; KDA 1, its per-channel factors are the
    row pass's). ``U`` is zero past ``count`` in its rows and columns."""
    pos = tl.arange(0, M)
    live = pos < count
    beta = tl.load(ring_beta + pos, mask=live, other=0.0).to(tl.float32)
    before = pos[None, :] < pos[:, None]  # [M, M]: i < j
    if CHANNEL:
        B = tl.zeros([M, M], tl.float32)
        for first in range(0, BLOCK_K, FOLD_KEY_COLUMNS):
            B = add_channel_products(B, key_piece(ring_k, pos, live, first, K) * r[:, None],
                                     tl.cumsum(key_piece(ring_g, pos, live, first, K), axis=0), pos, count)
        B = tl.where(before, B, 0.0)
        a = r
        b = r
        decay = 1.0
    else:
        gamma = tl.cumsum(tl.load(ring_g + pos, mask=live, other=0.0).to(tl.float32), axis=0)  # [M]
        last = tl.sum(tl.where(pos == count - 1, gamma, 0.0), axis=0)
        B = tl.where(before, gram * tl.exp(tl.where(before, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
        a = r * tl.exp(gamma)
        b = r * tl.exp(last - gamma)
        decay = tl.exp(last)
    inverse = unit_lower_inverse(beta[:, None] * B, pos, M)
    return beta[:, None] * tl.trans(inverse) * b[None, :], a, decay


@triton.jit
def _token_key(ring_k, ring_g, j, count, cols, K, gamma, CHANNEL: tl.constexpr):
    """Token ``j``'s raw key ``[BLOCK_K]`` (zero from ``count`` on) and, KDA, ``gamma`` plus its
    log-gate (the running ``Γ_j``; GDN: ``gamma`` as given)."""
    # Masks as vectors: the interpreter takes no scalar mask.
    live = (cols < K) & (tl.zeros_like(cols) + j < count)
    k = tl.load(ring_k + j * K + cols, mask=live, other=0.0).to(tl.float32)
    if CHANNEL:
        gamma += tl.load(ring_g + j * K + cols, mask=live, other=0.0).to(tl.float32)
    return k, gamma


@triton.jit
def fold_rows_by_token(S, coefficients, ring_k, ring_v, ring_g, V, K, rows, row_mask, cols, count,
                       M: tl.constexpr, CHANNEL: tl.constexpr):
    """:func:`.ring.fold_rows` token by token in two passes, products in fp32 FMAs: the reads ``R_j =
    v_j − a_j S k_j`` (``R [BLOCK_V, M]``, KDA's keys times ``e^{Γ_j}`` per channel), then
    ``S e^{Γ_last} + Σ_j (R U)_j k_j`` (KDA's keys times ``e^{Γ_last − Γ_j}``), the same sum in
    another order. ``coefficients`` holds ``U [M, M]``, then ``a [M]`` and ``e^{Γ_last}`` (GDN)
    from :func:`fold_coefficients`; ``ring_k``, ``ring_v``, ``ring_g``: the head's first ring
    entries (raw keys ``[·, K]``, values ``[·, V]``). Loads past ``count`` are masked (a rejected
    draft's inputs may be NaN)."""
    pos = tl.arange(0, M)
    reads = tl.zeros([S.shape[0], M], tl.float32)
    gamma = tl.zeros(cols.shape, tl.float32)
    for first in range(0, count, FOLD_TOKENS_PER_STEP):
        for u in tl.static_range(FOLD_TOKENS_PER_STEP):
            j = first + u
            k, gamma = _token_key(ring_k, ring_g, j, count, cols, K, gamma, CHANNEL)
            if CHANNEL:
                k = k * tl.exp(gamma)
            value = tl.load(ring_v + j * V + rows, mask=row_mask & (tl.zeros_like(rows) + j < count),
                            other=0.0).to(tl.float32)
            read = value - tl.load(coefficients + M * M + j) * tl.sum(S * k[None, :], axis=1)
            reads = tl.where(pos[None, :] == j, read[:, None], reads)
    if CHANNEL:
        last = gamma
        folded = S * tl.exp(last)[None, :]
        gamma = tl.zeros(cols.shape, tl.float32)
    else:
        folded = S * tl.load(coefficients + (M + 1) * M)
    for first in range(0, count, FOLD_TOKENS_PER_STEP):
        for u in tl.static_range(FOLD_TOKENS_PER_STEP):
            j = first + u
            k, gamma = _token_key(ring_k, ring_g, j, count, cols, K, gamma, CHANNEL)
            if CHANNEL:
                k = k * tl.exp(last - gamma)
            weight = tl.sum(reads * tl.load(coefficients + pos * M + j)[None, :], axis=1)  # (R U)_j
            folded += weight[:, None] * k[None, :]
    return folded
