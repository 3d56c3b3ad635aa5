"""Operator tools behind the CLI: provisioning and reading subscriptions (``admin``), failure
records (``dlq``: list and replay what ``workerpool.worker.failures`` wrote), ``status``, and
the ``demo``."""
