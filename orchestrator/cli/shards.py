"""``orchestrator shards``: the reconciler's shards (issue 35): each shard's owner, epoch, lease
left and lag, and a summary per owner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from . import base


@click.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"shards": K, "owners": [...], "shard_rows": [...]}.')
@click.option("--owner", default=None, help="Only the shards of this reconciler instance (its name).")
@click.option("--shard", "only", type=int, default=None, help="Only this shard (0 to K-1).")
def shards(as_json: bool, owner: str | None, only: int | None) -> None:
    """Show the sharded reconciler's shards: owner, epoch, lease left, lag; then each owner.

    The sharded mode (ORCHESTRATOR_RECONCILER_SHARDS=K) splits the runs over K shards (hash of
    the run id mod K, fixed once stored) that the reconciler instances claim by compare-and-set;
    each write an instance makes for a run carries the shard's epoch it read and is refused (a
    rejected ledger row) once the epoch moved. LAG is the age of the oldest due retry past its
    time and of the oldest dispatch unclaimed past ORCHESTRATOR_DISPATCH_TIMEOUT in the shard;
    RENEWED how long ago its owner last renewed it (every pass does). docs/shards.md says more.
    """
    from ..core.errors import ValidationError
    from ..store.shards import Shards

    orc = base._ready_store()
    k, views, members = Shards(orc.store.db).status(orc.settings.dispatch_timeout)
    if k is None:
        if as_json:
            base._dump({"shards": None, "owners": [], "shard_rows": []})
            return
        click.echo("no shard yet: the reconciler runs with one instance on duty (ORCHESTRATOR_RECONCILER_SHARDS=0)")
        return
    if only is not None and not 0 <= only < k:
        raise ValidationError(f"--shard {only}: the deployment has shards 0 to {k - 1}")
    if only is not None:
        views = [v for v in views if v.shard == only]
    if owner is not None:
        views = [v for v in views if v.owner == owner]
    owners = _owners(views, members, k)
    if as_json:
        base._dump({"shards": k, "owners": owners, "shard_rows": [v.to_json() for v in views]})
        return
    click.echo(format_shards(views))
    click.echo("")
    click.echo(format_owners(owners))


def _owners(views: list[Any], members: list[Any], k: int) -> list[dict[str, Any]]:
    """Per owner (and the free shards as owner null): how many shards, the live instances'
    heartbeats, the oldest lag among its shards."""
    seen = {m.name: m for m in members}
    names = sorted({v.owner for v in views if v.owner is not None} | set(seen))
    live = sum(1 for m in members if m.live) or 1
    out = []
    for name in [*names, None]:
        mine = [v for v in views if v.owner == name]
        if name is None and not mine:
            continue
        m = seen.get(name) if name is not None else None
        out.append(
            {
                "owner": name,
                "shards": len(mine),
                "target": -(-k // live) if name is not None else None,
                "live": bool(m.live) if m is not None else None,
                "seen_ago": round(float(m.seen_ago), 3) if m is not None else None,
                "due_retries": sum(v.due_retries for v in mine),
                "stale_dispatches": sum(v.stale_dispatches for v in mine),
                "oldest_lag": max(
                    (x for v in mine for x in (v.oldest_due, v.oldest_stale) if x is not None), default=None
                ),
            }
        )
    return out


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def format_shards(views: list[Any]) -> str:
    """A plain-text table of shards (:class:`~orchestrator.store.shards.ShardView`)."""
    header = ("SHARD", "OWNER", "EPOCH", "LEASE LEFT", "RENEWED", "DUE", "LAG DUE", "STALE", "LAG STALE")
    rows = [
        (
            str(v.shard), v.owner or "-", str(v.epoch), _secs(v.lease_left), _secs(v.renewed_ago),
            str(v.due_retries), _secs(v.oldest_due), str(v.stale_dispatches), _secs(v.oldest_stale),
        )
        for v in views
    ]  # fmt: skip
    return _table(header, rows)


def format_owners(owners: list[dict[str, Any]]) -> str:
    """A plain-text table of the owners' summary (free shards: owner ``(free)``)."""
    header = ("OWNER", "SHARDS", "TARGET", "LIVE", "SEEN", "DUE", "STALE", "OLDEST LAG")
    rows = [
        (
            o["owner"] or "(free)", str(o["shards"]), "-" if o["target"] is None else str(o["target"]),
            "-" if o["live"] is None else ("yes" if o["live"] else "no"), _secs(o["seen_ago"]),
            str(o["due_retries"]), str(o["stale_dispatches"]), _secs(o["oldest_lag"]),
        )
        for o in owners
    ]  # fmt: skip
    return _table(header, rows)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])
