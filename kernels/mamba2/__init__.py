"""Mamba-2 decode kernels: ``conventional`` (one step over a state in any format), ``replay``
(checkpoint, ring of inputs, read copy) and ``speculative`` (verify drafts, commit by cursor)."""
