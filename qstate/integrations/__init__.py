"""Drop qstate's decode ops into code people already run.

* :mod:`qstate.integrations.transformers`: ``patch(model, scheme)`` routes the one-token decode
  step of every Mamba-2 mixer of a transformers ``Mamba2ForCausalLM`` or ``NemotronHForCausalLM``
  through qstate (needs the ``hf`` extra: ``pip install "qstate[hf]"``).

Importing this package imports no third-party library.
"""
