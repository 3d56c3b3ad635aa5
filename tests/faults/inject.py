"""Faults for a real ``workerpool run`` process: ``--jobs tests.faults.inject`` with
``WORKERPOOL_TEST_FAULTS`` set to a JSON object.

- ``"store"``: a list of ``{"method": ..., "error": NAME, "probability": p}`` or
  ``{"method": ..., "stall": seconds}``: the process's idempotency store is wrapped in a
  ``FaultyStore`` with those faults (see ``ERRORS`` for the names).
- ``"while_file"``: the store faults apply only while this file exists (a test heals the
  store by removing it).
- ``"record_delay"``: seconds each failure record waits before it is published.
- ``"kill_before_handover"``: a file: the process SIGKILLs itself once a child's outcome has
  finalized a batch, before the completion is in the schedule, having written the time and
  that child's job id to the file.

Importing this module does it: the worker imports ``--jobs`` modules before it starts.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

from google.api_core import exceptions as gexc

import workerpool.assembly.build
from tests.faults.store import FaultyStore
from workerpool.batches.store import BatchStore, Completion
from workerpool.idempotency import StoreError, StoreOpener, StoreUnavailable
from workerpool.worker.delivery import Delivery
from workerpool.worker.failures import DeadLetterPublisher, Failure

ENV = "WORKERPOOL_TEST_FAULTS"

# Every class of error a store call fails with in production, by name.
ERRORS: dict[str, BaseException] = {
    "StoreUnavailable": StoreUnavailable("injected: unavailable"),
    "StoreError": StoreError("injected: failed"),
    "Aborted": gexc.Aborted("injected: aborted"),
    "Cancelled": gexc.Cancelled("injected: cancelled"),
    "Unauthenticated": gexc.Unauthenticated("injected: token expired"),
    "PermissionDenied": gexc.PermissionDenied("injected: permission denied"),
    "ClosedChannel": ValueError("Cannot invoke RPC on closed channel!"),
    "DatabaseError": sqlite3.DatabaseError("injected: database disk image is malformed"),
    "RuntimeError": RuntimeError("injected: a bug in a backend"),
}


def _faulty(opener: StoreOpener, faults: list[dict[str, Any]], when: str) -> StoreOpener:
    def open_faulty() -> FaultyStore:
        store = FaultyStore(opener(), active=(lambda: os.path.exists(when)) if when else None)
        for fault in faults:
            if "stall" in fault:
                store.stall(fault["method"], float(fault["stall"]))
            else:
                store.fail(
                    fault["method"], ERRORS[fault["error"]], probability=fault.get("probability", 1)
                )
        return store

    return open_faulty


def _install(spec: dict[str, Any]) -> None:
    if spec.get("store"):
        real = workerpool.assembly.build.store_opener

        def store_opener(url: str, **kwargs: Any) -> StoreOpener | None:
            opener = real(url, **kwargs)
            return (
                None
                if opener is None
                else _faulty(opener, spec["store"], spec.get("while_file", ""))
            )

        workerpool.assembly.build.store_opener = store_opener  # type: ignore[assignment]
    if spec.get("record_delay"):
        delay = float(spec["record_delay"])
        publish = DeadLetterPublisher.publish

        def slow_publish(self: DeadLetterPublisher, delivery: Delivery, failure: Failure) -> str:
            time.sleep(delay)
            return publish(self, delivery, failure)

        DeadLetterPublisher.publish = slow_publish  # type: ignore[method-assign]
    if spec.get("kill_before_handover"):
        _kill_before_handover(Path(spec["kill_before_handover"]))


def _kill_before_handover(marker: Path) -> None:
    record = BatchStore.record

    def killed(
        self: BatchStore, batch_id: str, job_id: str, succeeded: bool, *, cancelled: bool = False
    ) -> Completion | None:
        completion = record(self, batch_id, job_id, succeeded, cancelled=cancelled)
        if completion is not None:  # finalized in the store, not yet in the schedule
            marker.write_text(json.dumps({"at": time.time(), "job_id": job_id}))
            os.kill(os.getpid(), signal.SIGKILL)
        return completion

    BatchStore.record = killed  # type: ignore[method-assign]


if os.environ.get(ENV):
    _install(json.loads(os.environ[ENV]))
