"""A key's record as JSON-able data and back, for the backends that store it as text."""

from __future__ import annotations

from typing import Any

from workerpool.slots.store import Booking, Holding, Share, Table, Waiter


def encode(table: Table) -> dict[str, Any]:
    """The record as JSON-able data (lists, not maps keyed by holder: Firestore would read
    such keys as field paths)."""
    return {
        "holders": [
            {
                "holder": h,
                "until": float(lease.until),
                "token": lease.token,
                "since": lease.since,
                "job_id": lease.job_id,
            }
            for h, lease in table.holders.items()
        ],
        "waiters": [
            {"holder": h, "since": float(w.since), "until": float(w.until), "job_id": w.job_id}
            for h, w in table.waiters.items()
        ],
        "booked": [
            {"job_id": j, "since": float(b.since), "at": float(b.at)}
            for j, b in table.booked.items()
        ],
        "next_token": table.next_token,
        "hold": float(table.hold),
        "shares": [
            {
                "replica": r,
                "granted": share.granted,
                "want": share.want,
                "until": share.until,
                "token": share.token,
            }
            for r, share in table.shares.items()
        ],
        "part": table.part,
        "part_token": table.part_token,
        "part_until": table.part_until,
        "rebalanced": table.rebalanced,
    }


def decode(data: dict[str, Any]) -> Table:
    return Table(
        holders={
            e["holder"]: Holding(
                float(e["until"]), int(e["token"]), float(e["since"]), e.get("job_id", "")
            )
            for e in data.get("holders", [])
        },
        next_token=int(data.get("next_token", 1)),
        waiters={
            e["holder"]: Waiter(float(e["since"]), float(e["until"]), e.get("job_id", ""))
            for e in data.get("waiters", [])
        },
        booked={
            e["job_id"]: Booking(float(e["since"]), float(e["at"])) for e in data.get("booked", [])
        },
        hold=float(data.get("hold", 0.0)),
        shares={
            e["replica"]: Share(
                int(e["granted"]), int(e["want"]), float(e["until"]), int(e["token"])
            )
            for e in data.get("shares", [])
        },
        part=int(data.get("part", 0)),
        part_token=int(data.get("part_token", 0)),
        part_until=float(data.get("part_until", 0.0)),
        rebalanced=float(data.get("rebalanced", 0.0)),
    )
