"""The record's side of keys leased in bulk: how many slots each replica's share holds.

``fair`` is max-min fair: replicas that want little get all they want, the others split what
is left equally (within one slot). ``grow_to`` decides one replica's share from its target:
a share grows only into slots nobody else holds, and shrinks only to what its replica keeps
(the replica gives slots back as its runs end), so the sum of the shares and the per-run
holders never exceeds the limit, even while a rebalance is under way. ``lease_shares`` writes
every key of one replica's round in one store call.

A round writes a key's record only when it changes something another replica's round would
see: the share's size, a want that moves someone's fair target, or an expiry less than half
the TTL away. A replica asks every period; a key whose shares hold steady is read, not
written, so its record sees a write when slots move, not one per replica per period.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from workerpool.slots.store import Share, SlotStore, Table, TableMutation


def fair(
    limit: int, wants: Mapping[str, int], held: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Max-min fair targets for ``wants`` (by replica) out of ``limit`` slots: the smallest
    wants are met in full while an equal split allows; the rest split what is left, the
    remainder a slot each first to those that hold more than the split already (``held``,
    by replica), then by (want, name), a want above ``limit`` counted as ``limit``. They
    never sum above ``limit``.

    The remainder stays where it is held: busy replicas' wants cross as their runs come and
    go, and a remainder following them moved a slot from one replica to another and back, a
    write of the record each way, for no fairer a split; and each replica decides its own
    target from the others' wants as last written, so two replicas could each give the
    remainder to the other and leave the slot unheld. What each holds is in the record as
    of every change, so they agree on it."""
    targets: dict[str, int] = {}
    held = held or {}
    left = max(0, limit)
    order = sorted(wants, key=lambda r: (min(wants[r], limit), r))
    for i, replica in enumerate(order):
        share, extra = divmod(left, len(order) - i)
        if wants[replica] <= share:
            targets[replica] = max(0, wants[replica])
            left -= targets[replica]
            continue
        # Every replica from here wants more than an equal split: they all get it.
        rest = sorted(order[i:], key=lambda r: held.get(r, 0) <= share)  # (a stable sort)
        for j, other in enumerate(rest):
            targets[other] = share + (1 if j < extra else 0)
        break
    return targets


def grow_to(limit: int, others: int, keep: int, target: int) -> int:
    """A share's new size: toward ``target`` but only into slots free of ``others`` (other
    shares and per-run holders), and never below ``keep`` (slots its runs may be using)."""
    return max(keep, min(target, limit - others))


@dataclass(frozen=True)
class ShareAsk:
    """One key of a replica's round: it keeps ``keep`` slots (at most what the record granted
    it) and its runs want ``want`` (running and waiting)."""

    key: str
    replica: str
    limit: int
    keep: int
    want: int


@dataclass(frozen=True)
class ShareGrant:
    """The share the record now holds for the replica: ``granted`` slots, fenced by
    ``token``, for ``left`` more seconds; ``target``, its fair part, which it shrinks to as
    its runs end; ``room``, the part it would have at least were its runs to want more (while
    it holds less and they do, it asks again early); ``contended``: another replica's runs,
    or per-run holders, wait for slots (those this one does not use are worth giving back
    early); ``lapsed``: the record had no live share of the replica though it kept slots (it
    was paused or cut off past the TTL; what its runs held may be held by others now)."""

    granted: int
    target: int
    room: int
    token: int
    left: float
    contended: bool = False
    lapsed: bool = False


def share_mutation(ask: ShareAsk, ttl: float) -> TableMutation[ShareGrant]:
    def mutation(table: Table | None, now: float) -> tuple[ShareGrant, Table | None]:
        table = table or Table()
        shares = table.live_shares(now)
        mine = shares.pop(ask.replica, None)
        keep = 0 if mine is None else min(ask.keep, mine.granted)
        free = ask.limit - len(table.live(now))
        wants = {r: s.want for r, s in shares.items()}
        held = {r: s.granted for r, s in shares.items()}
        held[ask.replica] = keep
        # (Wanting more than anyone, it is the last to get a remainder it does not hold.)
        more = max([ask.limit, ask.want, *wants.values()]) + 1
        room = fair(free, {**wants, ask.replica: more}, held)[ask.replica]
        # Others wait: replicas' runs for more than their shares, or per-run holders.
        contended = bool(table.line(now)) or any(s.want > s.granted for s in shares.values())
        target = fair(free, {**wants, ask.replica: max(ask.want, keep)}, held)[ask.replica]
        others = ask.limit - free + sum(s.granted for s in shares.values())
        granted = grow_to(ask.limit, others, keep, target)
        lapsed = mine is None and ask.keep > 0
        if (
            mine is not None
            and granted == mine.granted
            and mine.until - now > ttl / 2
            and not _moves_others(free, wants, held, ask.replica, (mine.want, ask.want))
        ):  # nobody's round would decide otherwise: no write
            left = mine.until - now
            return ShareGrant(granted, target, room, mine.token, left, contended), None
        token = table.next_token
        if mine is not None and granted <= mine.granted:
            token = mine.token  # no slot came from elsewhere: the same grant, renewed
        grant = ShareGrant(granted, target, room, token, ttl, contended, lapsed)
        if granted == 0 and ask.want == 0:
            return grant, (replace(table, shares=shares) if mine is not None else None)
        shares[ask.replica] = Share(granted, ask.want, now + ttl, token)
        next_token = max(table.next_token, token + 1)
        return grant, replace(table, shares=shares, next_token=next_token)

    return mutation


def _moves_others(
    free: int,
    wants: Mapping[str, int],
    held: Mapping[str, int],
    replica: str,
    change: tuple[int, int],
) -> bool:
    """Whether ``replica``'s want going from one to the other of ``change`` moves another's
    fair target (its own is its ``room``, whatever it wants)."""
    was, now = change
    before = fair(free, {**wants, replica: was}, held)
    after = fair(free, {**wants, replica: now}, held)
    return any(before[r] != after[r] for r in wants)


def lease_shares(store: SlotStore, asks: Sequence[ShareAsk], ttl: float) -> list[ShareGrant]:
    """Renew, grow or give back one replica's shares of its keys, all in one store call.
    Raises ``StoreError``."""
    return store.mutate_records([(ask.key, share_mutation(ask, ttl)) for ask in asks])
