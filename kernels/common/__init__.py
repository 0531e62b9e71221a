"""Triton pieces every layer family shares: the codes kernels branch on (``constants``), the
in-kernel codec (``codec``), exact products on tensor cores (``exact_dot``), activations and
gates (``softplus``, ``gate``), and the host side of launching (``launch``, ``pdl``, ``gpu``,
``sizes``). ``codec_probe`` and ``exact_dot_probe`` run single pieces on whole tensors, for tests
and GPU checks. Nothing here imports a family folder."""
