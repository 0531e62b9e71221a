"""Mamba-2 decode kernels. Launchers (tables, plans, launch functions): ``conventional`` (one step
over a state in any format), ``replay`` (checkpoint, ring of inputs, read copy) and
``speculative`` (verify drafts, commit by cursor; the per-draft-state baseline). Their kernels:
``conventional_kernel``, ``replay_kernels``, ``speculative_kernels``; ``ring`` holds the jit
pieces the replay and speculative kernels share."""
