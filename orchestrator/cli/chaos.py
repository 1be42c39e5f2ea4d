"""``orchestrator chaos``: the fault-injection soak of a local deployment."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option(
    "--runs", default=100, show_default=True, help="At least this many DAG runs (more while faults are owed)."
)
@click.option("--seed", default=1, show_default=True, help="Random seed of the DAGs and of the fault sequence.")
@click.option("--workers", default=2, show_default=True, help="Worker processes (-c 2 each, -c 8 with --pool threads).")
@click.option("--min-faults", default=200, show_default=True, help="Keep injecting until this many faults.")
@click.option("--database-url", envvar="ORCHESTRATOR_CHAOS_DATABASE_URL", default=None,
              help="Use this Postgres database (wiped first) instead of a private server of the soak's own;"
                   " the server is then never restarted.")  # fmt: skip
@click.option("--timeout", default=900.0, show_default=True, help="Give up after this many seconds.")
@click.option("--claim-delay", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="The workers' ORCHESTRATOR_CLAIM_DELAY (direct messages' bodies before their claim).")  # fmt: skip
@click.option("--mix", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also this many operator actions, maps, waits and events at random moments (the interaction"
                   " soak; see docs/operations.md).")  # fmt: skip
@click.option("--keep", is_flag=True, default=False,
              help="Leave the soak's data directory (logs) and its private server's data directory behind"
                   " (the server stopped) and print where: to read the ledger after a violation.")  # fmt: skip
@click.option("--pool", type=click.Choice(["prefork", "threads"]), default="prefork", show_default=True,
              help="The workers' pool: prefork (-c 2: two pool processes each) or threads (-c 8: eight threads of"
                   " one process; kill_child is then not dealt, there is no pool process).")  # fmt: skip
@click.option("--group-commit", is_flag=True, default=False,
              help="The workers' ORCHESTRATOR_GROUP_COMMIT=1: the hot-path calls a worker's threads make at"
                   " once go in one transaction (it acts on a threads pool; a prefork process is a lone"
                   " caller).")  # fmt: skip
@click.option("--reconciler-shards", default=0, show_default=True, type=click.IntRange(0, 4096),
              help="The sharded control plane: ORCHESTRATOR_RECONCILER_SHARDS=K (and a 3 s shard lease) for every"
                   " worker and reconciler; also deals kill_reconciler (kill -9 an `orchestrator reconcile` that"
                   " owns shards, start another) and pause_reconciler (paused past the shards' lease), and"
                   " reports the stale-epoch refusals. 0: one reconciler on duty (the duty lock).")  # fmt: skip
@click.option("--reconcilers", default=1, show_default=True, type=click.IntRange(min=0),
              help="How many `orchestrator reconcile` processes beside the workers' own reconcilers.")  # fmt: skip
def chaos(
    runs: int,
    seed: int,
    workers: int,
    min_faults: int,
    database_url: str | None,
    timeout: float,
    claim_delay: float,
    mix: int,
    keep: bool,
    pool: str,
    group_commit: bool,
    reconciler_shards: int,
    reconcilers: int,
) -> None:
    """Soak a local deployment (private Postgres and Redis, real workers, reconciler) under
    eleven kinds of random fault, and report them per kind.

    Exits 1 if any invariant broke: a task lost, stuck or committed twice, an illegal
    transition, a child started before its parent. The database is wiped first.
    """
    from ..testing.chaos import run_chaos

    sys.exit(run_chaos(runs=runs, seed=seed, database_url=database_url, workers=workers,
                       min_faults=min_faults, timeout=timeout, claim_delay=claim_delay, mix=mix, keep=keep,
                       pool=pool, group_commit=group_commit, shards=reconciler_shards,
                       reconcilers=reconcilers))  # fmt: skip
