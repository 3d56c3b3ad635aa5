"""``python -m bench.slot_shards``: a model of one bulk key shared by 100 replicas, its record
split into shards (built: ``workerpool.slots.sharding``; docs/guide/fleet-wide-limits.md,
"Many replicas"), for a fleet larger than the tests can run.

Each replica writes its shard's record once a period (``allocation.fair`` and ``grow_to``
within the shard, with the shard's part as its limit, as a replica's round does); every
``--rebalance`` periods, or a fifth of that once a shard's demand grew past its fair part,
the shards' parts are rebalanced by ``sharding.rebalance``, the built rule, a shard counting
for what its shares hold until they shrink to its part. The replicas' wants change at random
every ``--shift`` periods (a few hot replicas, the rest light). Measured: writes per record
per period (replicas' rounds, the busiest record), the rebalances' writes per period (all
records), the most slots granted at once in all (never above the limit), and the share of
the slots the replicas could use that they held (busy).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool.slots.allocation import fair, grow_to
from workerpool.slots.sharding import EARLY, behind, rebalance, spread

ABOUT = [
    "A model, no store: one bulk key shared by 100 replicas, its record whole or split into "
    'shards (built: the fleet-wide limits guide, "Many replicas"; this model is for a fleet '
    "larger than the tests run). Each replica writes its shard's record once a period by the "
    "allocator's own rules; every 10 periods, or 2 once a shard's demand grew past its fair "
    "part, the shards' parts are rebalanced by the built rule (`sharding.rebalance`); every 60 "
    "periods the replicas' wants change at random (a tenth hot, the rest light). Writes per "
    "record a period (the replicas' rounds, the busiest record), the rebalances' writes a "
    "period (all records), the most slots granted at once over all shards (never above the "
    "limit), and the share of the slots the replicas could use that they held (busy). The "
    "model judges a shard behind on its replicas' wants together, where a replica judges on "
    "its own.",
]


@dataclass
class Shard:
    limit: int  # its part, as its replicas' rounds use it
    counted: int  # what the key's record counts it for (its part, or what its shares hold)
    granted: dict[str, int] = field(default_factory=dict)
    target: dict[str, int] = field(default_factory=dict)
    want: dict[str, int] = field(default_factory=dict)

    def round(self, replica: str, want: int) -> None:
        """One replica's write of its share (one write of this shard's record)."""
        held = self.granted.get(replica, 0)
        keep = min(held, self.target.get(replica, held), want)  # its runs ended meanwhile
        self.want[replica] = want
        target = fair(self.limit, self.want)[replica]
        others = sum(g for r, g in self.granted.items() if r != replica)
        self.granted[replica] = grow_to(self.limit, others, keep, target)
        self.target[replica] = target

    @property
    def held(self) -> int:
        return sum(self.granted.values())

    @property
    def wanted(self) -> int:
        return sum(self.want.values())


@dataclass(frozen=True)
class Result:
    writes_per_record: float  # per period, the replicas' rounds, the busiest shard record
    rebalance_writes: float  # per period, over all records
    peak: int  # the most granted at once, over all shards
    busy: float


@dataclass
class _Rebalancer:
    limit: int
    every: int
    early: bool
    wants: dict[str, int] = field(default_factory=dict)  # as of the last rebalance
    last: int = -(10**9)
    writes: int = 0

    def due(self, model: list[Shard], period: int) -> bool:
        if period - self.last >= self.every:
            return True
        if not self.early or period - self.last < self.every / EARLY:
            return False
        counted = {str(i): s.counted for i, s in enumerate(model)}
        return any(behind(self.limit, counted, self.wants, str(i), s.wanted)
                   for i, s in enumerate(model))  # fmt: skip

    def run(self, model: list[Shard], period: int) -> None:
        """The shards' parts rebalanced: the key's record written twice (its claim and the
        counts), a shard's record once for each change of its part."""
        names = [str(i) for i in range(len(model))]
        self.wants = {n: s.wanted for n, s in zip(names, model, strict=True)}
        parts, counted = rebalance(
            self.limit,
            {n: s.limit for n, s in zip(names, model, strict=True)},
            {n: s.held for n, s in zip(names, model, strict=True)},
            self.wants,
        )
        self.writes += 2
        for n, shard in zip(names, model, strict=True):
            self.writes += parts[n] != shard.limit
            shard.limit, shard.counted = parts[n], counted[n]
        self.last = period


def simulate(
    *,
    replicas: int,
    shards: int,
    limit: int,
    periods: int,
    rebalance: int,
    shift: int,
    seed: int,
    early: bool = True,
) -> Result:
    rng = random.Random(seed)
    parts = spread(limit, {str(s): 0 for s in range(shards)})
    model = [Shard(parts[str(s)], parts[str(s)]) for s in range(shards)]
    rebalancer = _Rebalancer(limit, rebalance, early)
    wants = [0] * replicas
    writes = [0] * shards
    peak, used, usable = 0, 0, 0
    for period in range(periods):
        if period % shift == 0:
            hot = set(rng.sample(range(replicas), max(1, replicas // 10)))
            wants = [
                rng.randint(20, 40) if r in hot else rng.randint(0, 3) for r in range(replicas)
            ]
        for replica in rng.sample(range(replicas), replicas):
            shard = model[replica % shards]
            shard.round(str(replica), wants[replica])
            writes[replica % shards] += 1
            peak = max(peak, sum(s.held for s in model))
        if shards > 1 and rebalancer.due(model, period):
            rebalancer.run(model, period)
        used += sum(min(s.granted.get(str(r), 0), wants[r]) for r, s in _owners(model, replicas))
        usable += min(limit, sum(wants))
    return Result(max(writes) / periods, rebalancer.writes / periods, peak, used / max(1, usable))


def _owners(model: list[Shard], replicas: int) -> list[tuple[int, Shard]]:
    return [(r, model[r % len(model)]) for r in range(replicas)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--periods", type=int, default=600)
    parser.add_argument("--rebalance", type=int, default=10)
    parser.add_argument("--shift", type=int, default=60)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    stamp = Stamp()
    grid = Grid(
        "",
        "",
        [f"{args.replicas} replicas, limit {args.limit}", "writes per record a period",
         "rebalances' writes a period", "most granted", "busy"],
    )  # fmt: skip
    cases = [("1 shard", 1, True), ("25 shards", 25, True),
             (f"25 shards, every {args.rebalance} periods only", 25, False)]  # fmt: skip
    for label, shards, early in cases:
        result = simulate(replicas=args.replicas, shards=shards, limit=args.limit,
                          periods=args.periods, rebalance=args.rebalance, shift=args.shift,
                          seed=1, early=early)  # fmt: skip
        grid.rows.append([label, f"{result.writes_per_record:.1f}",
                          f"{result.rebalance_writes:.2f}", str(result.peak),
                          f"{result.busy:.3f}"])  # fmt: skip
    title = "Sharded slot records, in a model"
    command = command_line("python -m bench.slot_shards", argv)
    emit(Section("slot_shards", title, command, ABOUT, [grid]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
