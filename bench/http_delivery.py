"""``python -m bench.http_delivery``: should ``http.delivery`` have an async variant?

It would have one (httpx.AsyncClient, one client per process, the same SSRF guard) if that
measured faster. This runs both through a real ``Processor`` with N slot threads (the worker's
data path from a leased message to its ack, Pub/Sub left out so only the delivery differs)
against a local keep-alive HTTP server in a process of its own:

* ``sync``: the plugin as it is, ``requests`` with one keep-alive session per slot thread.
* ``async``: the candidate, an ``async def`` with the same guard and classification, one
  ``httpx.AsyncClient`` for the process, on the pool's event loop.

Each variant runs 3 times, the order rotating; medians of deliveries per second and of the
client process's CPU per 1,000 deliveries (the server's CPU is its own process's).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool import AsyncJobContext, PermanentError, RetryableError
from workerpool.errors import RateLimitedError
from workerpool.registry import Registry, registry
from workerpool.testing.fakes import FakeAcks, FakeDeadLetters, FakeLeaser, make_delivery
from workerpool.worker.aio import EventLoop
from workerpool.worker.processor import Processor, ProcessorSettings

ABOUT = [
    "Should `http.delivery` have an async variant? Both run through a real `Processor` with N "
    "slot threads (the worker's data path from a leased message to its ack, Pub/Sub left out "
    "so only the delivery differs) against a local keep-alive HTTP server in a process of its "
    "own. sync: the job as it is, `requests` with one keep-alive session per slot thread. "
    "async: the candidate, `httpx.AsyncClient`, one for the process, on the pool's event loop. "
    "Each variant runs several times, the order rotating; medians of deliveries per second and "
    "of the client process's CPU per 1,000 deliveries; the ratio row is of those medians.",
]

_client: httpx.AsyncClient | None = None


async def deliver_async(ctx: AsyncJobContext, request: Any) -> None:
    """The candidate: ``workerpool_jobs.http_delivery.deliver`` with httpx.AsyncClient."""
    plugin = importlib.import_module("workerpool_jobs.http_delivery")
    global _client
    host = plugin._check_destination(request.url, ctx.config)  # a numeric host: no DNS wait
    if any(h.lower() in plugin._FORBIDDEN_HEADERS for h in request.headers):
        raise PermanentError("header may not be set", error_type="http.refused")
    if _client is None:
        _client = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=None))
    timeout = ctx.config.timeout
    try:
        response = await _client.request(
            request.method, request.url, json=request.body, headers=request.headers,
            timeout=timeout, follow_redirects=False,
        )  # fmt: skip
    except httpx.HTTPError as exc:
        raise RetryableError(f"{type(exc).__name__} talking to {host}") from exc
    status = response.status_code
    if status in (429, 503):
        raise RateLimitedError(f"HTTP {status}", limiter=None)
    if status >= 300:
        raise RetryableError(f"HTTP {status}")


async def _serve(port: int) -> None:
    """An HTTP/1.1 keep-alive server that answers every request with 200."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("serving", flush=True)
    async with server:
        await server.serve_forever()


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(variant: str, port: int, n: int, count: int, loop: EventLoop) -> tuple[float, float]:
    """(deliveries per second, CPU seconds per 1,000) of ``count`` deliveries, N at a time."""
    importlib.import_module("workerpool_jobs.http_delivery")  # registers http.delivery
    spec = registry.get("http.delivery")
    assert spec is not None
    jobs = Registry()
    if variant == "sync":
        jobs.add(spec)
    else:
        jobs.job("http.delivery", payload=spec.payload, config=spec.config)(deliver_async)
    acks = FakeAcks()
    config = jobs.configs(
        {"http.delivery": {"allowed_hosts": ["127.0.0.1"], "allow_loopback": True}}
    )
    processor = Processor(
        jobs, acks, FakeLeaser(), FakeDeadLetters(), [],
        ProcessorSettings(job_config=config), loop=loop,
    )  # fmt: skip
    body = json.dumps({"url": f"http://127.0.0.1:{port}/hook", "body": {"n": 1}}).encode()
    per_slot = count // n
    batches = [
        [
            make_delivery(
                body, {"job": "http.delivery", "job_id": f"{s}-{i}"}, message_id=f"{s}-{i}"
            )
            for i in range(per_slot)
        ]
        for s in range(n)
    ]
    slots = [threading.Thread(target=_process_all, args=(processor, b)) for b in batches]
    began, cpu = time.perf_counter(), _cpu()
    for slot in slots:
        slot.start()
    for slot in slots:
        slot.join()
    took, used = time.perf_counter() - began, _cpu() - cpu
    done = processor.stats.get("done", 0)
    if done != per_slot * n:
        raise RuntimeError(f"{variant}: {done} of {per_slot * n} delivered: {processor.stats}")
    return done / took, used / done * 1000


def _process_all(processor: Processor, deliveries: list[Any]) -> None:
    for delivery in deliveries:
        processor.process(delivery)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_delivery", description=__doc__)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, nargs="+", default=[10, 64])
    parser.add_argument("--count", type=int, default=6_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=18_181)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    logging.basicConfig(level=logging.ERROR)
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.http_delivery", "--serve", str(args.port)],
        stdout=subprocess.PIPE,
    )
    # One loop for every run, as a worker process has: the async client is bound to it.
    loop = EventLoop()
    try:
        assert server.stdout is not None and server.stdout.readline() == b"serving\n"
        _report(args, lambda variant, n: _measure(variant, args.port, n, args.count, loop))
    finally:
        loop.close(2.0)
        server.terminate()
        server.wait(10)


def _report(args: argparse.Namespace, measure: Callable[[str, int], tuple[float, float]]) -> None:
    stamp, variants = Stamp(), ["sync", "async"]
    grid = Grid("", "", ["N", "variant", "deliveries/s", "CPU per 1,000, s"])
    for n in args.n:
        rates: dict[str, list[float]] = {v: [] for v in variants}
        cpus: dict[str, list[float]] = {v: [] for v in variants}
        for run in range(args.runs):
            for variant in variants[run % 2 :] + variants[: run % 2]:
                rate, cpu = measure(variant, n)
                rates[variant].append(rate)
                cpus[variant].append(cpu)
        rate_of = {v: statistics.median(rates[v]) for v in variants}
        cpu_of = {v: statistics.median(cpus[v]) for v in variants}
        for variant in variants:
            grid.rows.append(
                [str(n), variant, f"{rate_of[variant]:,.0f}", f"{cpu_of[variant]:.2f}"]
            )
        ratios = [
            f"{rate_of['async'] / rate_of['sync']:.2f}",
            f"{cpu_of['async'] / cpu_of['sync']:.2f}",
        ]
        grid.rows.append([str(n), "async / sync", *ratios])
    command = command_line("python -m bench.http_delivery", args.argv)
    title = "http.delivery: the sync job against an async candidate"
    emit(Section("http_delivery", title, command, ABOUT, [grid]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
