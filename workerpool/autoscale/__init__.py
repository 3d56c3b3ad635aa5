"""Sizing a worker fleet from its signals (the policy first; signals, actuators and
the CLI come on top of it)."""
