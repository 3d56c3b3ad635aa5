"""A split key's parts are leases, so a key can be brought back to one record in place.

What a shard counts for in the key's own record (``#i``) carries an expiry, and the shard's
record knows it (``Table.part_until``): each rebalance moves the expiry ``part_lease``
seconds on, in the key's record first, then in the shard's. A share granted in a shard never
outlives its part (its expiry is cut to the part's), and a shard whose part lapsed grants
nothing until a rebalance gives it a part again. So when the part lapses in the key's
record, every share granted under it has lapsed too: the slots it counted for are free,
for another shard or for replicas that do not split the key (a fleet redeployed with the
key as one record, or the old half of a rolling deploy), with no one having to clean up.

An expiry only grows while the part keeps its token (a part grown anew takes a new token,
and a fresh expiry): a rebalance paused between writing the key's record and the shard's
then writes the shard an expiry the key's record has already passed, never one beyond it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from workerpool.slots.store import Share, Table

# Rebalance periods a part outlives the slot TTL by: while any replica splits the key, a
# rebalance comes every period, so the part's expiry stays more than a TTL ahead and no
# share's expiry is cut (nor written more often); one rebalance missed (a store error) too.
SPARE_PERIODS = 2


def part_lease(ttl: float, period: float) -> float:
    """Seconds a part lives from a rebalance: once no replica splits the key, its slots are
    free for replicas that do not within this long of the last rebalance."""
    return ttl + SPARE_PERIODS * period


def renewed(old: Share | None, token: int, now: float, lease: float) -> float:
    """The expiry of a part in the key's record that a rebalance writes with ``token``: a
    lease from now, and never earlier than the part's own while it keeps its token. (A part
    written before parts were leases never lapsed: it takes its first expiry.)"""
    fresh = now + lease
    if old is None or old.token != token or math.isinf(old.until):
        return fresh
    return max(old.until, fresh)


def live_part(table: Table, now: float) -> int:
    """A shard's part of the limit now: none once it lapsed."""
    return table.part if table.part_until > now else 0


def share_terms(table: Table | None, now: float, ttl: float) -> tuple[int, float]:
    """The limit and the TTL a share in a shard's record is granted by: the shard's part,
    and the TTL cut to the part's expiry. A shard whose part lapsed grants no slot (a share
    there only says what its runs want, for the next rebalance)."""
    if table is None or table.part_until <= now:
        return 0, ttl
    return table.part, min(ttl, table.part_until - now)


def taken(table: Table, part: int, token: int, until: float) -> Table | None:
    """A shard's record once a rebalance wrote it the part the key's record holds for it
    (``part`` of ``token``, until ``until``): a newer token's part, or a later expiry for
    its own token's; None where it holds a newer one (another rebalance wrote it since)."""
    if token < table.part_token or (token == table.part_token and until <= table.part_until):
        return None
    if token == table.part_token:
        return replace(table, part_until=until)
    next_token = max(table.next_token, token + 1)
    return replace(table, part=part, part_token=token, part_until=until, next_token=next_token)
