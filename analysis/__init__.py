"""Drift analysis of state storage schemes (installed as ``qstate.analysis``)."""
