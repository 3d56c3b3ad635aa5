"""The worker: from a pulled message to its ack, and the lifecycle around it.

The data path, in the order a message takes it:

- ``puller``: the pull loop asks Pub/Sub for exactly as many messages as the pool has room
  for (its own loop over unary pull; ``clients`` opens the channels);
- ``pool``: N slot threads, never more than N running and N + prefetch held;
- ``envelope``: message -> ``Job``, or a rejection naming why it can never run;
- ``processor``: builds the ``run.Run``, sends it down the ``middleware`` chain to the handler,
  asks ``outcome.decide`` what to do, and settles the ``delivery`` once;
- ``failures``: writes failure records to the dead-letter topic (``workerpool.ops.dlq`` reads
  them back);
- ``acks`` batches acks, nacks and lease extensions; ``lease`` keeps held messages leased;
  ``timers`` runs job timeouts and claim watches on one thread.

``launcher`` builds these parts in ``start`` and drains them in ``stop(deadline)``.
"""
