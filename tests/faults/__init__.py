"""Fault injection for tests: a TCP proxy between a worker and the emulator."""

from tests.faults.proxy import FaultProxy, Mode, ProxyStats

__all__ = ["FaultProxy", "Mode", "ProxyStats"]
