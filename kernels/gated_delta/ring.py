"""Jit pieces over a gated delta rule replay ring, shared by replay decode (``replay_kernels``)
and speculative decoding (``speculative_kernels``): one ring token's key, gate and β, and one
token applied to a state tile."""

import triton
import triton.language as tl

from . import tile


@triton.jit
def ring_token(ring_k, ring_g, ring_beta, j, cols, K, L2NORM: tl.constexpr, CHANNEL: tl.constexpr):
    """Token ``j`` of a head's ring without its value: ``k̂ [BLOCK_K]``, ``α``, ``β`` in fp32 (the
    pointers are the head's first ring entries)."""
    k = tile.load_key(ring_k + j * K, cols, K, L2NORM)
    if CHANNEL:
        alpha = tile.decay(ring_g + j * K, cols, K, CHANNEL)
    else:
        alpha = tile.decay(ring_g + j, cols, K, CHANNEL)
    return k, alpha, tl.load(ring_beta + j)


@triton.jit
def apply_token(S, k, v, alpha, beta, CHANNEL: tl.constexpr):
    """``S diag(α) + d k̂ᵀ``, ``d = β (v − S diag(α) k̂)``: one token on a ``[BLOCK_V, BLOCK_K]``
    tile, in the references' order."""
    S = tile.apply_decay(S, alpha, CHANNEL)
    d = beta * (v - tl.sum(S * k[None, :], axis=1))
    return S + d[:, None] * k[None, :]
