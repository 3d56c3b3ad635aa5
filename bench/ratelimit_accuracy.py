"""How closely a declared rate is honoured at 10, 100 and 1,000 per second.

Sixteen threads take tokens as fast as the limiter lets them for a few seconds per rate; we
report the achieved rate as a ratio of the declared one, the busiest 100 ms window against
its share, and how late the grants were against their ideal spacing.

    python -m bench.ratelimit_accuracy [--seconds 5] [--threads 16]

``python -m bench`` runs it as part of scenario 5.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from workerpool.ratelimit import LocalLimiters, RateSpec


def measure(rate: float, seconds: float, threads: int) -> dict[str, float]:
    limiters = LocalLimiters({"x": RateSpec(rate, 1)})
    never, stop = threading.Event(), threading.Event()
    grants: list[float] = []
    lock = threading.Lock()

    def take() -> None:
        while not stop.is_set():
            limiters.acquire("x", 1, never)
            now = time.monotonic()
            with lock:
                grants.append(now)

    workers = [threading.Thread(target=take) for _ in range(threads)]
    start = time.monotonic()
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    window = sorted(t - start for t in grants if t - start < seconds)
    share = rate * 0.1
    lateness = [t - i / rate for i, t in enumerate(window)]
    return {
        # Spacing, not count: the first grant is the bucket's initial token, not a rate.
        "achieved_ratio": (len(window) - 1) / (window[-1] - window[0]) / rate,
        "busiest_100ms": busiest(window, 0.1),
        "share_100ms": share,
        "median_late_ms": statistics.median(lateness) * 1000,
        "p99_late_ms": sorted(lateness)[int(0.99 * (len(lateness) - 1))] * 1000,
    }


def busiest(times: list[float], window: float) -> int:
    """The most events in any window of that length (two pointers over sorted times)."""
    most, left = 0, 0
    for right, at in enumerate(times):
        while at - times[left] >= window:
            left += 1
        most = max(most, right - left + 1)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    print("| declared | achieved / declared | busiest 100 ms (share) | median late | p99 late |")
    print("|---|---|---|---|---|")
    for rate in (10.0, 100.0, 1000.0):
        r = measure(rate, args.seconds, args.threads)
        print(
            f"| {rate:g}/s | {r['achieved_ratio']:.4f} | {r['busiest_100ms']:.0f} "
            f"({r['share_100ms']:g}) | {r['median_late_ms']:.2f} ms | {r['p99_late_ms']:.2f} ms |"
        )


if __name__ == "__main__":
    main()
