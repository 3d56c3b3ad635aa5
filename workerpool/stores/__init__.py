"""What the stores built on SQLite and Firestore (idempotency claims, concurrency slots) share:
their errors, opening a connection, translating a backend's errors, one atomic document write.
"""

from __future__ import annotations


class StoreError(Exception):
    """The store could not do what was asked, and trying again soon will not help
    (permission denied, a corrupt file, a bug). The caller neither runs nor acks. Every
    failure of a store call is a ``StoreError``: nothing else escapes one."""


class StoreUnavailable(StoreError):
    """The backend could not be reached, was busy or timed out: try again later."""
