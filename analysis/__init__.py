"""Drift analysis of state storage schemes (installed as ``qstate.analysis``)."""

from .model_drift import model_drift
