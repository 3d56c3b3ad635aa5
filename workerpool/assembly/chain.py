"""The worker's middleware chain, outermost first: the one place its order is decided.

``Steps`` runs each middleware's ``before`` and the first half of its ``around`` in this
order, and the second halves in the reverse one, so what comes first sees everything the ones
after it do. The defaults, and why each sits where it does:

1. Telemetry (the span, the metrics, the job's log line): outermost, so every run is seen and
   timed, whatever ends it, a duplicate or a run given back included.
2. Delays, then batches: before the claim, so a job that is not due yet is held back without
   taking a claim; batches record a child's outcome around everything inside.
3. The cancel gate: after batches (a child cancelled counts as cancelled in its batch), and
   before the claim, so a job cancelled before it starts takes no claim, slot or token (a
   claim its admission took for it is let go as its message leaves).
4. Idempotency: claims the job id; a duplicate, or a job another worker runs, ends here, so it
   never takes a slot or a token, nor reaches the handler.
5. Concurrency slots: after the claim (a duplicate never takes a slot), before the rate limit
   (a run waits for its token only once it may run).
6. Rate limit: one token per run, taken after every default that may turn a run away (a
   duplicate, a run without a slot), so none is spent on one.
7. Checkpoints and progress: inside every default that may turn a run away, so only a run
   that starts its handler reads its job's checkpoint or shows as running.
8. Time limit: counts the job's ``timeout`` from its handler's start.
9. The cancel watch: the innermost default, around the handler alone, so a run cancelled
   while it runs ends ``cancelled`` before any default sees its outcome (the idempotency
   middleware records its job id as done; its slot and claim are let go as any run's).

The user's middleware (the config's ``middleware``, then those given to ``Launcher``) come
after them, innermost, in the order named: they wrap the handler alone, so they see only runs
that will start it (claimed, in a slot, with a token), time what the handler takes, see
``ctx.cancelled`` set at the timeout like the handler does, and an outcome one returns ends the
run as the handler's would. Every middleware hears ``admitted`` and ``settled``, wherever it
sits.
"""

from __future__ import annotations

from collections.abc import Sequence

from workerpool.worker.middleware import Middleware


def chain(
    *,
    telemetry: Sequence[Middleware],
    coordination: Sequence[Middleware],
    idempotency: Middleware | None,
    concurrency: Middleware | None,
    rate_limit: Middleware,
    checkpoints: Middleware | None,
    time_limit: Middleware,
    cancels: tuple[Middleware, Middleware] | None = None,
    user: Sequence[Middleware] = (),
) -> list[Middleware]:
    """The chain in the order above; a part this worker does not have is None. ``cancels``
    is the cancel gate and the cancel watch."""
    gate, watch = ([], []) if cancels is None else ([cancels[0]], [cancels[1]])
    return [
        *telemetry,
        *coordination,
        *gate,
        *([idempotency] if idempotency is not None else []),
        *([concurrency] if concurrency is not None else []),
        rate_limit,
        *([checkpoints] if checkpoints is not None else []),
        time_limit,
        *watch,
        *user,
    ]
