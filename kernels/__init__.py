"""Triton kernels of qstate (installed as ``qstate.kernels``): ``@triton.jit`` code and one
launcher per op. Validation lives in :mod:`qstate.ops`."""
