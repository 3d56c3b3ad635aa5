"""Builds workers from their settings: the one package that knows every feature package and
wires them around the data path in ``worker/`` (which knows none of them)."""
