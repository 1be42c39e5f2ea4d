"""What tags, or a concurrency key, cost a submit (issue 34): ``Orchestrator.submit`` of the same
small DAG, plain and with tags (or with ``--with key``: ``concurrency_key="customer:<i>"``,
``max_concurrent=1``, a key of its own per pair, free, so the run is admitted as a plain one is),
timed in one sitting on one database.

    python bench/submit_cost.py [--n 300] [--rounds 10] [--nodes 3] [--tags 4] [--with tags|key]

On its own database (``orchestrator_bench_submit``, re-created and migrated), with a recording
publisher (no broker: what is measured is the submit's checks, its transaction and the admission
of its root, not a broker's round trip) and one registered worker of 100,000 slots (each run's
root is admitted, as on a deployment with room). Each round makes ``--n`` pairs of submits, one
plain and one with ``--tags`` tags (and ``customer``), back to back, the order inside a pair
alternating (ABBA), so the database's growth and the machine's load fall on both alike; a warm-up
round is not counted. Prints per variant the lowest and the median of the rounds' medians and
the median of all single submits; then the ratios tagged / plain of those, and the median of the
pairs' own ratios (each pair ran under the same load: the figure least moved by a busy machine).
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
    parser.add_argument("--n", type=int, default=300, help="pairs of submits per round (default 300)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--nodes", type=int, default=3, help="the DAG's nodes, a chain (default 3)")
    parser.add_argument("--tags", type=int, default=4, help="tags of a tagged submit besides customer (default 4)")
    parser.add_argument(
        "--with", dest="variant", choices=("tags", "key"), default="tags", help="what the second submit adds"
    )
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

    serial = iter(range(10**9))

    def one(with_tags: bool) -> float:
        began = time.perf_counter()
        if with_tags and args.variant == "key":
            orc.submit(dag, concurrency_key=f"customer:{next(serial)}", max_concurrent=1)
        elif with_tags:
            orc.submit(dag, tags=tags)
        else:
            orc.submit(dag)
        spent = time.perf_counter() - began
        publisher.take()
        return spent

    def pairs(r: int) -> list[tuple[float, float]]:
        """``--n`` pairs (plain, tagged), the order inside a pair alternating."""
        out = []
        for i in range(args.n):
            if (i + r) % 2 == 0:
                plain = one(False)
                tagged = one(True)
            else:
                tagged = one(True)
                plain = one(False)
            out.append((plain, tagged))
        return out

    pairs(0)  # warm-up: connections, caches, the plans
    medians: dict[bool, list[float]] = {False: [], True: []}  # each round's median, per variant
    singles: dict[bool, list[float]] = {False: [], True: []}
    ratios: list[float] = []
    for r in range(args.rounds):
        found = pairs(r)
        for with_tags in (False, True):
            spent = [p[1] if with_tags else p[0] for p in found]
            medians[with_tags].append(statistics.median(spent))
            singles[with_tags].extend(spent)
        ratios.extend(tagged / plain for plain, tagged in found)
        plain_ms, tagged_ms = medians[False][-1] * 1e3, medians[True][-1] * 1e3
        log(f"round {r + 1}/{args.rounds}: plain {plain_ms:.3f} ms, tagged {tagged_ms:.3f} ms (medians)")

    def ms(x: float) -> str:
        return f"{x * 1e3:.3f} ms"

    what = f"{len(tags)} tags" if args.variant == "tags" else "a free concurrency key (max_concurrent=1)"
    print(f"submit of a {args.nodes}-node chain, {args.n} pairs x {args.rounds} rounds (ABBA), {what}:")
    label = "tagged" if args.variant == "tags" else "keyed "
    for with_tags, name in ((False, "plain "), (True, label)):
        m = medians[with_tags]
        print(
            f"  {name}  lowest {ms(min(m))}  median {ms(statistics.median(m))} per submit (round medians);"
            f"  median of single submits {ms(statistics.median(singles[with_tags]))}"
        )
    print(
        f"  {label.strip()} / plain: lowest {min(medians[True]) / min(medians[False]):.3f}x,"
        f" median {statistics.median(medians[True]) / statistics.median(medians[False]):.3f}x,"
        f" single-submit median {statistics.median(singles[True]) / statistics.median(singles[False]):.3f}x,"
        f" median of the pairs' ratios {statistics.median(ratios):.3f}x"
    )
    orc.store.dispose()


if __name__ == "__main__":
    main()
