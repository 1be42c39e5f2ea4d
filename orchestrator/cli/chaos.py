"""``orchestrator chaos``: the fault-injection soak of a local deployment."""

from __future__ import annotations

import sys

import click


@click.command()
@click.option(
    "--runs", default=100, show_default=True, help="At least this many DAG runs (more while faults are owed)."
)
@click.option("--seed", default=1, show_default=True, help="Random seed of the DAGs and of the fault sequence.")
@click.option("--workers", default=2, show_default=True, help="Prefork worker processes (-c 2 each).")
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
def chaos(
    runs: int,
    seed: int,
    workers: int,
    min_faults: int,
    database_url: str | None,
    timeout: float,
    claim_delay: float,
    mix: int,
) -> None:
    """Soak a local deployment (private Postgres and Redis, real workers, reconciler) under
    eleven kinds of random fault, and report them per kind.

    Exits 1 if any invariant broke: a task lost, stuck or committed twice, an illegal
    transition, a child started before its parent. The database is wiped first.
    """
    from ..testing.chaos import run_chaos

    sys.exit(run_chaos(runs=runs, seed=seed, database_url=database_url, workers=workers,
                       min_faults=min_faults, timeout=timeout, claim_delay=claim_delay, mix=mix))  # fmt: skip
