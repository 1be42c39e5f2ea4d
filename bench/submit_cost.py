"""What tags cost a submit (issue 34): ``Orchestrator.submit`` of the same small DAG, plain and
with tags, timed in one sitting on one database.

    python bench/submit_cost.py [--n 300] [--rounds 10] [--nodes 3] [--tags 4]

On its own database (``orchestrator_bench_submit``, re-created and migrated), with a recording
publisher (no broker: what is measured is the submit's validation, its transaction and the
admission of its root, not a broker's round trip) and one registered worker of 100,000 slots
(each run's root is admitted, as on a deployment with room). Each round submits ``--n`` runs
plain and ``--n`` runs with ``--tags`` tags, the order alternating between rounds (ABBA), so the
database's growth and the machine's drift fall on both alike; a warm-up round is not counted.
Prints per variant the minimum and the median time per submit (over the rounds' means) and the
median of single submits, and the ratios tagged / plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DB = "postgresql+psycopg://postgres@127.0.0.1:5432/orchestrator_bench_submit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="submits per variant and round (default 300)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--nodes", type=int, default=3, help="the DAG's nodes, a chain (default 3)")
    parser.add_argument("--tags", type=int, default=4, help="tags of a tagged submit (default 4)")
    parser.add_argument("--database-url", default=DB, help="the bench database (re-created; its name holds 'bench')")
    args = parser.parse_args()

    from bench.bench import log, reset_database
    from orchestrator import DAG, Orchestrator, Settings
    from orchestrator.core.publisher import RecordingPublisher
    from orchestrator.core.registry import StaticRegistry
    from orchestrator.core.routing import default_queues

    log(f"resetting {args.database_url}")
    reset_database(args.database_url)
    publisher = RecordingPublisher()
    orc = Orchestrator(Settings(database_url=args.database_url), publisher=publisher, registry=StaticRegistry(["t"]))
    orc.register_worker("bench@submit", default_queues(), 100_000)

    dag = DAG("submit-cost")
    previous = None
    for i in range(args.nodes):
        previous = dag.task(f"step{i}", "t", upstream=[previous] if previous else [])
    tags = {f"key{i}": f"value-{i}-{'x' * 8}" for i in range(args.tags)}
    tags["customer"] = "42"

    def timed(with_tags: bool) -> list[float]:
        spent = []
        for _ in range(args.n):
            began = time.perf_counter()
            orc.submit(dag, tags=tags if with_tags else None)
            spent.append(time.perf_counter() - began)
            publisher.take()
        return spent

    timed(False), timed(True)  # warm-up: connections, caches, the plans
    means: dict[bool, list[float]] = {False: [], True: []}
    singles: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for with_tags in (False, True) if r % 2 == 0 else (True, False):
            spent = timed(with_tags)
            means[with_tags].append(statistics.fmean(spent))
            singles[with_tags].extend(spent)
        log(
            f"round {r + 1}/{args.rounds}: plain {means[False][-1] * 1e3:.3f} ms, tagged {means[True][-1] * 1e3:.3f} ms"
        )

    def ms(x: float) -> str:
        return f"{x * 1e3:.3f} ms"

    print(f"submit of a {args.nodes}-node chain, {args.n} per variant x {args.rounds} rounds (ABBA), {len(tags)} tags:")
    for with_tags, name in ((False, "plain "), (True, "tagged")):
        m, single = means[with_tags], singles[with_tags]
        print(
            f"  {name}  min {ms(min(m))}  median {ms(statistics.median(m))} per submit (round means);"
            f"  median of single submits {ms(statistics.median(single))}"
        )
    print(
        f"  tagged / plain: min {min(means[True]) / min(means[False]):.3f}x,"
        f" median {statistics.median(means[True]) / statistics.median(means[False]):.3f}x,"
        f" single-submit median {statistics.median(singles[True]) / statistics.median(singles[False]):.3f}x"
    )
    orc.store.dispose()


if __name__ == "__main__":
    main()
