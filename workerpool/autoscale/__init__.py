"""Sizing a worker fleet from its signals (issue 17: the policy first; signals, actuators and
the CLI come on top of it)."""
