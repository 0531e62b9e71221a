"""Gated delta rule decode kernels (GDN: one gate per head; KDA: one per key channel).
Launchers: ``conventional`` (one step over a state in any format) and ``replay`` (checkpoint,
ring of inputs, read copy). Their kernels: ``conventional_kernel``, ``replay_kernels``;
``tile`` holds the jit pieces both share."""
