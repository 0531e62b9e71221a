"""Drift analysis of state storage schemes (installed as ``qstate.analysis``).

Modules: ``schemes`` (what is stored, bytes per step), ``drift`` (simulate all schemes against
the exact recurrence), ``theory`` (predicted error), ``choose`` (the precision chooser),
``report`` (markdown and figures), ``model_drift`` (logit drift of a real transformers model).
"""

from .model_drift import model_drift

__all__ = ["model_drift"]
