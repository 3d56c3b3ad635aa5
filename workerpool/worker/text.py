"""Text that came from a message, made safe for the places it goes: UTF-8 attributes, logs.

JSON may spell a lone surrogate (``"\\ud800"``), which Python decodes into a ``str`` that no
UTF-8 encoder accepts: a failure record or log line carrying it would raise instead of being
written. Such code points are replaced by their ``\\uXXXX`` escape, which keeps them readable.
"""

from __future__ import annotations

from workerpool import constants as c


def safe_text(text: str) -> str:
    """``text`` with every code point UTF-8 cannot encode written as a backslash escape."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def truncate_utf8(text: str, limit: int = c.MAX_ATTRIBUTE_VALUE_BYTES) -> str:
    """Safe ``text`` cut to at most ``limit`` UTF-8 bytes, marked with "..." if cut."""
    encoded = safe_text(text).encode("utf-8")
    if len(encoded) <= limit:
        return encoded.decode("utf-8")
    return encoded[: limit - 3].decode("utf-8", errors="ignore") + "..."
