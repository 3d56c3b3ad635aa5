"""The three workloads the autoscaler is judged on, as job arrival times and durations (seeded).

Every job is the same kind: an I/O-bound job (render a document, call an API, write the
result) whose duration is lognormal with a mean of 2 s (median 1.8 s, 1 in 1,000 over 6 s).
Each trace starts and ends idle, so scaling to zero and back is part of every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MEAN_DURATION = 2.0
SPREAD = 0.5  # sigma of the duration's logarithm
HOUR = 3600.0


@dataclass(frozen=True)
class Trace:
    name: str
    about: str  # one line for the report
    arrivals: list[float]  # publish times, ascending
    durations: list[float]  # each job's run time, in the same order
    horizon: float  # the run is billed and measured from 0 to here
    zoom: float  # the plot shows 0 to here

    @property
    def work(self) -> float:
        """Slot-seconds of running the trace needs: its work content."""
        return sum(self.durations)


def _durations(rng: np.random.Generator, count: int) -> list[float]:
    mu = math.log(MEAN_DURATION) - SPREAD**2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    durations: list[float] = rng.lognormal(mu, SPREAD, count).tolist()
    return durations


def _poisson(rng: np.random.Generator, rates: np.ndarray, offset: float) -> list[float]:
    """Arrivals of a Poisson process whose rate is ``rates[i]`` during second ``i``."""
    counts = rng.poisson(rates)
    seconds = np.repeat(np.arange(len(rates), dtype=float), counts)
    arrivals: list[float] = np.sort(offset + seconds + rng.random(len(seconds))).tolist()
    return arrivals


def month_end(seed: int = 17) -> Trace:
    # Half a second past a decision, so the probe's delay is its average, not 0 or a full round.
    at = 120.5
    arrivals = [at] * 3000
    return Trace(
        "month-end",
        "3,000 jobs published at once after 2 idle minutes, then idle to the hour",
        arrivals,
        _durations(np.random.default_rng(seed), len(arrivals)),
        horizon=HOUR,
        zoom=900.0,
    )


def steady(seed: int = 17) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = _poisson(rng, np.full(1800, 20.0), offset=60.0)
    return Trace(
        "steady",
        "20 jobs/s (Poisson) for 30 minutes after 1 idle minute, then idle to the hour",
        arrivals,
        _durations(rng, len(arrivals)),
        horizon=HOUR,
        zoom=HOUR,
    )


def diurnal(seed: int = 17, peak: float = 10.0) -> Trace:
    """A working day: nothing at night, a sine from 07:00 to 19:00 peaking at noon."""
    rng = np.random.default_rng(seed)
    hours = (np.arange(24 * int(HOUR)) + 0.5) / HOUR
    rates = peak * np.clip(np.sin(math.pi * (hours - 7) / 12), 0, None)  # negative at night
    arrivals = _poisson(rng, rates, offset=0.0)
    return Trace(
        "diurnal",
        f"a day: idle at night, 07:00-19:00 a sine peaking at {peak:g} jobs/s (Poisson)",
        arrivals,
        _durations(rng, len(arrivals)),
        horizon=24 * HOUR,
        zoom=24 * HOUR,
    )


def traces() -> list[Trace]:
    return [month_end(), steady(), diurnal()]
