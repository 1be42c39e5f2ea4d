"""The reconciler's shards (issue 35): K logical shards, each owned by one reconciler instance
under a lease and an epoch, claimed by compare-and-set; and the epoch fence every write of the
sharded reconciler carries.

- A run's shard is ``hash(run id) mod K`` (:func:`shard_of`, and :func:`shard_sql` its SQL twin:
  the first 32 bits of the id's MD5): a pure function of the id, so that a task's shard is known
  from its ``run_id`` without reading the run, and a run submitted before K was stored (a null
  ``orc_runs.shard``) is in the same shard as if it had been stored.
- :meth:`Shards.claim` takes free or expired shards: ``UPDATE ... SET owner = me, epoch = epoch
  + 1 ... WHERE (owner IS NULL OR lease_expires_at < now())``, the rows picked ``FOR UPDATE SKIP
  LOCKED`` (a shard an owner is writing under is skipped, never waited for). :meth:`Shards.renew`
  extends the lease of the shards an instance still holds at the epoch it read;
  :meth:`Shards.rebalance` does one instance's whole turn: its heartbeat, the renewal, giving back
  what is over its share (ceil(K / live instances)) and claiming up to it.
- :class:`Fence` is what an instance read: its name and, per shard it holds, the epoch. A write
  checks it inside its own transaction (:func:`hold`, :func:`check`): the shard's
  row is read ``FOR SHARE`` where owner and epoch still match, so the claim that would depose the
  owner waits for the write's commit (or the write sees the new epoch and is refused); a refusal
  is a rejected ledger row naming the stale epoch (:func:`stale_text`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from . import schema as s
from .database import Database
from .dbtime import db_after, db_now

log = logging.getLogger(__name__)
t_shards, t_config, t_members = s.shards, s.shard_config, s.reconcilers
#: the transaction advisory lock under which the first sharded reconciler stores K and the rows
SHARDS_INIT_LOCK = 0x6F7263_35


def shard_of(run_id: str, shards: int) -> int:
    """The shard of run ``run_id`` among ``shards``: the first 32 bits of the id's MD5, mod K."""
    return int(hashlib.md5(run_id.encode()).hexdigest()[:8], 16) % shards


def shard_sql(run_id: Any, shards: Any) -> Any:
    """:func:`shard_of` in SQL, over a run id column (``orc_tasks.run_id``, ``orc_runs.id``)."""
    bits = sa.cast(sa.literal("x", sa.Text) + sa.func.substr(sa.func.md5(run_id), 1, 8), postgresql.BIT(32))
    return sa.cast(sa.cast(bits, sa.BigInteger) % shards, sa.Integer)


def stored_shard(run_id: str) -> Any:
    """The value of ``orc_runs.shard`` for a new run: its shard once K is stored, else null (a
    scalar subquery on ``orc_shard_config``: no round trip of its own at submit)."""
    return sa.select(shard_sql(sa.literal(run_id, sa.Text), t_config.c.shards)).scalar_subquery()


@dataclass(frozen=True)
class Fence:
    """What one reconciler instance read at the start of its pass: its name, the deployment's
    K, and the epoch of each shard it holds. Every write it makes for a run carries this."""

    owner: str
    shards: int
    epochs: Mapping[int, int] = field(default_factory=dict)
    #: the shards' lease (seconds): a fenced transaction left idle this long (its process paused
    #: while it holds its shards ``FOR SHARE``) is ended by the server, so a claim never waits on it
    lease: float = 0.0

    @property
    def leader(self) -> bool:
        """The holder of shard 0 also runs the passes that are not per run (events pruned,
        breakers, watchdog, triggers, children, flow, deadlines)."""
        return 0 in self.epochs

    @property
    def held(self) -> list[int]:
        return sorted(self.epochs)

    def has(self, run_id: str) -> bool:
        return shard_of(run_id, self.shards) in self.epochs

    def only(self, shards: list[int]) -> Fence:
        """This fence narrowed to ``shards`` (those :func:`hold` found still held)."""
        return Fence(self.owner, self.shards, {k: v for k, v in self.epochs.items() if k in shards}, self.lease)

    def where(self, run_id: Any) -> Any:
        """A filter on a run id column: the run is in one of the shards this instance holds."""
        return shard_sql(run_id, self.shards) == sa.func.any(sa.cast(self.held, postgresql.ARRAY(sa.Integer)))


def stale_text(fence: Fence, shard: int, epoch: int | None, owner: str | None) -> str:
    """The reason of a write refused because the shard moved since ``fence`` was read."""
    read = fence.epochs.get(shard)
    was = f"epoch {read}" if read is not None else "no epoch (not held)"
    return (
        f"stale shard epoch: shard {shard} {was} read by {fence.owner};"
        f" the shard is at epoch {epoch} held by {owner or 'nobody'}"
    )


class ShardView(NamedTuple):
    """One shard as ``orchestrator shards`` shows it."""

    shard: int
    owner: str | None
    epoch: int
    #: seconds of lease left (negative: expired), None when free
    lease_left: float | None
    #: seconds since the owner last renewed it, None when free
    renewed_ago: float | None
    previous_owner: str | None
    #: tasks RETRYING whose retry is due, and the age of the oldest (seconds past its not_before)
    due_retries: int
    oldest_due: float | None
    #: QUEUED tasks unclaimed past the dispatch timeout, and the oldest one's age past it
    stale_dispatches: int
    oldest_stale: float | None

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


class Shards:
    """The shard table's rows: configuration, claims, renewals, the fence (see the module
    docstring)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._count: int | None = None

    # ------------------------------------------------------------------ K

    def configure(self, wanted: int) -> int:
        """The deployment's K: stored (with its K shard rows) by the first caller as ``wanted``;
        afterwards the stored one, whatever ``wanted`` says (a run's shard depends on it)."""

        def tx(conn: Connection) -> int:
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(SHARDS_INIT_LOCK)))
            stored = conn.execute(sa.select(t_config.c.shards)).scalar()
            if stored is None:
                conn.execute(t_config.insert().values(id=1, shards=wanted))
                stored = wanted
            have = conn.execute(sa.select(sa.func.count()).select_from(t_shards)).scalar_one()
            if have < stored:
                conn.execute(
                    postgresql.insert(t_shards)
                    .from_select(["shard"], sa.select(sa.func.generate_series(0, stored - 1)))
                    .on_conflict_do_nothing()
                )
            return int(stored)

        k = self.db.transaction(tx)
        if k != wanted:
            log.warning("the deployment has %d reconciler shards (fixed when first stored); %d ignored", k, wanted)
        self._count = k
        return k

    def count(self) -> int | None:
        """K, or None while no sharded reconciler has stored it."""
        if self._count is None:
            with self.db.engine.connect() as conn:
                found = conn.execute(sa.select(t_config.c.shards)).scalar()
            self._count = None if found is None else int(found)
        return self._count

    # ------------------------------------------------------------------ ownership

    def heartbeat(self, owner: str, lease: float) -> int:
        """This instance is live for ``lease`` seconds more; instances expired are forgotten.
        Returns how many instances are live (this one included)."""

        def tx(conn: Connection) -> int:
            row = {"name": owner, "started_at": db_now(), "seen_at": db_now(), "expires_at": db_after(lease)}
            stmt = postgresql.insert(t_members).values(**row)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=[t_members.c.name],
                    set_={"seen_at": stmt.excluded.seen_at, "expires_at": stmt.excluded.expires_at},
                )
            )
            conn.execute(t_members.delete().where(t_members.c.expires_at < db_now()))
            return int(conn.execute(sa.select(sa.func.count()).select_from(t_members)).scalar_one())

        return self.db.transaction(tx)

    def renew(self, owner: str, epochs: Mapping[int, int], lease: float) -> dict[int, int]:
        """Extend the lease of the shards ``owner`` still holds at the epoch it read; returns
        them (a shard another instance claimed meanwhile is gone from the answer)."""
        if not epochs:
            return {}
        pairs = sa.tuple_(t_shards.c.shard, t_shards.c.epoch).in_(list(epochs.items()))
        stmt = (
            t_shards.update()
            .where(t_shards.c.owner == owner, pairs)
            .values(lease_expires_at=db_after(lease), renewed_at=db_now())
            .returning(t_shards.c.shard, t_shards.c.epoch)
        )
        return {r.shard: r.epoch for r in self.db.transaction(lambda conn: conn.execute(stmt).all())}

    def claim(self, owner: str, n: int, lease: float) -> dict[int, int]:
        """Compare-and-set up to ``n`` free or expired shards to ``owner``, each at its epoch + 1;
        returns the claimed ones with their new epochs."""
        if n <= 0:
            return {}
        free = sa.or_(t_shards.c.owner.is_(None), t_shards.c.lease_expires_at < db_now())
        pick = (
            sa.select(t_shards.c.shard)
            .where(free)
            .order_by(t_shards.c.shard)
            .limit(n)
            .with_for_update(skip_locked=True)
            .scalar_subquery()
        )
        stmt = (
            t_shards.update()
            .where(t_shards.c.shard.in_(pick), free)
            .values(
                owner=owner,
                epoch=t_shards.c.epoch + 1,
                lease_expires_at=db_after(lease),
                claimed_at=db_now(),
                renewed_at=db_now(),
                previous_owner=t_shards.c.owner,
            )
            .returning(t_shards.c.shard, t_shards.c.epoch, t_shards.c.previous_owner)
        )
        rows = self.db.transaction(lambda conn: conn.execute(stmt).all())
        for r in rows:
            if r.previous_owner not in (None, owner):
                log.warning(
                    "reconciler %s took shard %d (epoch %d) over from %s", owner, r.shard, r.epoch, r.previous_owner
                )
        return {r.shard: r.epoch for r in rows}

    def give_back(self, owner: str, shards: list[int]) -> int:
        """Free ``shards`` of ``owner`` at once (its epoch stays; the next claim moves it)."""
        if not shards:
            return 0
        stmt = (
            t_shards.update()
            .where(t_shards.c.owner == owner, t_shards.c.shard.in_(shards))
            .values(owner=None, lease_expires_at=None, previous_owner=owner)
        )
        return int(self.db.transaction(lambda conn: conn.execute(stmt).rowcount or 0))

    def leave(self, owner: str) -> None:
        """A stopping instance: its shards freed at once, its heartbeat row gone."""

        def tx(conn: Connection) -> None:
            conn.execute(
                t_shards.update()
                .where(t_shards.c.owner == owner)
                .values(owner=None, lease_expires_at=None, previous_owner=owner)
            )
            conn.execute(t_members.delete().where(t_members.c.name == owner))

        self.db.transaction(tx)

    def rebalance(self, owner: str, held: Mapping[int, int], lease: float) -> Fence:
        """One instance's turn before its pass: heartbeat, renew what it holds, give back what is
        over its share or claim up to it. Returns the fence its writes of this pass carry."""
        k = self.count()
        if k is None:
            raise RuntimeError("the shards are not configured: call Shards.configure first")
        live = self.heartbeat(owner, lease)
        epochs = self.renew(owner, held, lease)
        lost = set(held) - set(epochs)
        if lost:
            log.warning("reconciler %s lost shards %s (claimed by another instance)", owner, sorted(lost))
        target = math.ceil(k / max(live, 1))
        if len(epochs) > target:
            # the highest shards go back first: shard 0 (the leader's) stays where it is
            extra = sorted(epochs)[target:]
            self.give_back(owner, extra)
            for shard in extra:
                del epochs[shard]
        elif len(epochs) < target:
            epochs.update(self.claim(owner, target - len(epochs), lease))
        return Fence(owner, k, epochs, lease)

    # ------------------------------------------------------------------ what an operator sees

    def status(self, dispatch_timeout: float) -> tuple[int | None, list[ShardView], list[Any]]:
        """K, every shard with its owner, epoch, lease and lag, and the live instances."""
        k = self.count()
        if k is None:
            return None, [], []
        with self.db.engine.connect() as conn:
            lag = {r.shard: r for r in conn.execute(_LAG, {"k": k, "timeout": dispatch_timeout}).all()}
            rows = conn.execute(_SHARDS).all()
            members = list(conn.execute(_MEMBERS).all())
        views = []
        for r in rows:
            g = lag.get(r.shard)
            views.append(
                ShardView(
                    r.shard, r.owner, int(r.epoch), _f(r.lease_left), _f(r.renewed_ago), r.previous_owner,
                    int(g.due) if g else 0, _f(g.oldest_due) if g else None,
                    int(g.stale) if g else 0, _f(g.oldest_stale) if g else None,
                )
            )  # fmt: skip
        return k, views, members


def hold(conn: Connection, fence: Fence) -> tuple[list[int], dict[int, str]]:
    """In the caller's transaction: lock ``FOR SHARE`` the shards ``fence`` holds whose owner
    and epoch still match (a claim passes them over until this transaction ends). Returns those
    shards, and for every other shard of the fence the reason a write to it is refused."""
    if not fence.epochs:
        return [], {}
    _bound(conn, fence)
    pairs = sa.tuple_(t_shards.c.shard, t_shards.c.epoch).in_(list(fence.epochs.items()))
    valid = list(
        conn.execute(
            sa.select(t_shards.c.shard)
            .where(t_shards.c.owner == fence.owner, pairs)
            .order_by(t_shards.c.shard)
            .with_for_update(read=True)
        ).scalars()
    )
    moved = sorted(set(fence.epochs) - set(valid))
    refused: dict[int, str] = {}
    if moved:
        now = conn.execute(
            sa.select(t_shards.c.shard, t_shards.c.epoch, t_shards.c.owner).where(t_shards.c.shard.in_(moved))
        ).all()
        refused = {r.shard: stale_text(fence, r.shard, r.epoch, r.owner) for r in now}
    return valid, refused


def check(conn: Connection, fence: Fence, run_id: str) -> str | None:
    """In the caller's transaction, before a write for ``run_id``: lock its shard ``FOR
    SHARE`` when ``fence`` still holds it at its epoch (``None``), else the refusal's reason."""
    shard = shard_of(run_id, fence.shards)
    epoch = fence.epochs.get(shard)
    if epoch is not None:
        _bound(conn, fence)
        ok = conn.execute(
            sa.select(t_shards.c.shard)
            .where(t_shards.c.shard == shard, t_shards.c.owner == fence.owner, t_shards.c.epoch == epoch)
            .with_for_update(read=True)
        ).first()
        if ok is not None:
            return None
    now = conn.execute(sa.select(t_shards.c.epoch, t_shards.c.owner).where(t_shards.c.shard == shard)).first()
    return stale_text(fence, shard, now.epoch if now else None, now.owner if now else None)


def refuse_tasks(
    conn: Connection, fence: Fence, refused: Mapping[int, str], where: tuple[Any, ...], dst: str, limit: int = 100
) -> int:
    """In the caller's transaction: a rejected ledger row (actor ``reconciler``, the stale epoch
    its reason) for each task matching ``where`` in the ``refused`` shards, at most ``limit``
    per shard: the write to ``dst`` this instance would have made there. Returns how many."""
    n = 0
    t = s.tasks
    for shard, reason in sorted(refused.items()):
        rows = (
            sa.select(
                t.c.run_id, t.c.key, t.c.attempt, t.c.state, sa.literal(dst), sa.literal("reconciler"),
                sa.literal(reason), sa.false(), db_now(),
            )
            .where(*where, shard_sql(t.c.run_id, fence.shards) == shard)
            .limit(limit)
        )  # fmt: skip
        columns = ["run_id", "key", "attempt", "from_state", "to_state", "actor", "reason", "accepted", "at"]
        n += int(conn.execute(s.events.insert().from_select(columns, rows)).rowcount or 0)
    return n


def refuse_run(
    conn: Connection, run_id: str, state: str, dst: str, reason: str, key: str | None = None, attempt: int = 0
) -> None:
    """In the caller's transaction: the rejected ledger row of a write refused that names no
    compare-and-set of the ledger's (a run closed; with ``key``, a task's deadline judged)."""
    conn.execute(
        s.events.insert().values(
            run_id=run_id, key=key, attempt=attempt, from_state=state, to_state=dst, actor="reconciler",
            reason=reason, accepted=False, at=db_now(),
        )
    )  # fmt: skip


def _bound(conn: Connection, fence: Fence) -> None:
    """This transaction ended by the server when left idle for the shards' lease (a process paused
    in it would otherwise hold its shards' rows locked, and no other instance could claim them)."""
    if fence.lease > 0:
        ms = str(max(int(fence.lease * 1000), 1000))
        conn.execute(sa.select(sa.func.set_config("idle_in_transaction_session_timeout", ms, True)))


def _f(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


_SHARDS = sa.text(
    """
    SELECT shard, owner, epoch, previous_owner,
           CASE WHEN owner IS NOT NULL THEN extract(epoch FROM lease_expires_at - now()) END AS lease_left,
           CASE WHEN owner IS NOT NULL THEN extract(epoch FROM now() - renewed_at) END AS renewed_ago
    FROM orc_shards ORDER BY shard
    """
)
_MEMBERS = sa.text(
    """
    SELECT m.name, extract(epoch FROM now() - m.seen_at) AS seen_ago, m.expires_at > now() AS live,
           (SELECT count(*) FROM orc_shards h WHERE h.owner = m.name) AS shards
    FROM orc_reconcilers m ORDER BY m.name
    """
)
#: per shard: the due retries and the dispatches unclaimed past the timeout, with the oldest's age
_LAG = sa.text(
    """
    SELECT (('x' || substr(md5(t.run_id), 1, 8))::bit(32)::bigint % :k)::int AS shard,
           count(*) FILTER (WHERE t.state = 'RETRYING') AS due,
           extract(epoch FROM now() - min(t.not_before) FILTER (WHERE t.state = 'RETRYING')) AS oldest_due,
           count(*) FILTER (WHERE t.state = 'QUEUED') AS stale,
           extract(epoch FROM now() - min(t.dispatched_at) FILTER (WHERE t.state = 'QUEUED')) - :timeout
               AS oldest_stale
    FROM orc_tasks t
    WHERE (t.state = 'RETRYING' AND t.not_before <= now())
       OR (t.state = 'QUEUED' AND t.dispatched_at < now() - make_interval(secs => :timeout))
    GROUP BY 1
    """
)
