"""``python -m bench.slot_shards``: a model of one bulk key shared by 100 replicas, its record
split into shards (designed, not built: docs/guide/fleet-wide-limits.md, "Many replicas").

Each replica writes its shard's record once a period (``allocation.fair`` and ``grow_to``
within the shard, as a replica's round does in one record now); every ``--rebalance``
periods the shards' limits are rebalanced by the same rules over the shards' wants, a shard
giving slots back only as its shares shrink. The replicas' wants change at random every
``--shift`` periods (a few hot replicas, the rest light). Measured: writes per record per
period, the most slots granted at once in all (never above the limit), and the share of the
slots the replicas could use that they held (busy).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.results import Grid, Section, Stamp, command_line, emit
from workerpool.slots.allocation import fair, grow_to

ABOUT = [
    "A model, no store: one bulk key shared by 100 replicas, its record whole or split into "
    'shards (designed, not built: the fleet-wide limits guide, "Many replicas"). Each replica '
    "writes its shard's record once a period by the allocator's own rules; every 10 periods "
    "the shards' limits are rebalanced by the same rules over their wants; every 60 the "
    "replicas' wants change at random (a tenth hot, the rest light). Writes per record a "
    "period (the busiest record), the most slots granted at once over all shards (never above "
    "the limit), and the share of the slots the replicas could use that they held (busy).",
]


@dataclass
class Shard:
    limit: int
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


@dataclass(frozen=True)
class Result:
    writes_per_record: float  # per period, the busiest shard record
    peak: int  # the most granted at once, over all shards
    busy: float


def simulate(
    *, replicas: int, shards: int, limit: int, periods: int, rebalance: int, shift: int, seed: int
) -> Result:
    rng = random.Random(seed)
    parts = fair(limit, {str(s): limit for s in range(shards)})
    model = [Shard(parts[str(s)]) for s in range(shards)]
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
        if period % rebalance == rebalance - 1:
            _rebalance(model, limit)
            peak = max(peak, sum(s.held for s in model))
        used += sum(min(s.granted.get(str(r), 0), wants[r]) for r, s in _owners(model, replicas))
        usable += min(limit, sum(wants))
    return Result(max(writes) / periods, peak, used / max(1, usable))


def _owners(model: list[Shard], replicas: int) -> list[tuple[int, Shard]]:
    return [(r, model[r % len(model)]) for r in range(replicas)]


def _rebalance(model: list[Shard], limit: int) -> None:
    """The shards' limits toward max-min fair over their wants: a shard keeps what its
    shares hold, and grows only into what the others do not keep."""
    wants = {str(i): sum(s.want.values()) for i, s in enumerate(model)}
    targets = fair(limit, wants)
    for i, shard in enumerate(model):  # first every shard gives back what it can
        shard.limit = max(shard.held, min(shard.limit, targets[str(i)]))
    for i, shard in enumerate(model):
        others = sum(s.limit for j, s in enumerate(model) if j != i)
        shard.limit = grow_to(limit, others, shard.limit, targets[str(i)])


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
         "most granted", "busy"],
    )  # fmt: skip
    for shards in (1, 25):
        result = simulate(replicas=args.replicas, shards=shards, limit=args.limit,
                          periods=args.periods, rebalance=args.rebalance, shift=args.shift,
                          seed=1)  # fmt: skip
        grid.rows.append([f"{shards} shard{'s' if shards > 1 else ''}",
                          f"{result.writes_per_record:.1f}", str(result.peak),
                          f"{result.busy:.3f}"])  # fmt: skip
    title = "Sharded slot records, in a model"
    command = command_line("python -m bench.slot_shards", argv)
    emit(Section("slot_shards", title, command, ABOUT, [grid]), stamp, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
