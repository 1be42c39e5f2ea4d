"""``orchestrator chaos --pool threads --group-commit``: the options reach the workers' command
line and environment, the fault deck leaves out the kinds a threads pool cannot take (and says
so), and a bad option is refused with a typed error before anything is started. Nothing here
starts a process: the spawn is replaced by a recorder."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import orchestrator.testing.chaos as chaos_pkg
from orchestrator.cli.chaos import chaos
from orchestrator.testing.chaos import soak
from orchestrator.testing.chaos.deployment import POOLS, ChaosConfigError, Deployment
from orchestrator.testing.chaos.faults import DECK, Injector


def spawned(dep: Deployment, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment ``start_worker(name)`` would start the worker with."""
    seen: list[tuple[list[str], dict[str, str]]] = []

    def record(name: str, cmd: list[str], env: dict[str, str] | None = None) -> Any:
        seen.append((cmd, env or {}))
        return object()

    monkeypatch.setattr(dep, "_spawn", record)
    dep.start_worker(name)
    assert len(seen) == 1
    return seen[0]


def pool_of(cmd: list[str]) -> tuple[str, str]:
    return cmd[cmd.index("--pool") + 1], cmd[cmd.index("-c") + 1]


def test_the_default_is_prefork_c2_without_group_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHESTRATOR_GROUP_COMMIT", "1")  # the soak's workers never inherit it
    dep = Deployment("postgresql+psycopg://postgres@127.0.0.1:1/x", 2, tmp_path)
    cmd, env = spawned(dep, monkeypatch, "chaos1")
    assert pool_of(cmd) == ("prefork", "2")
    assert env["ORCHESTRATOR_GROUP_COMMIT"] == "0"  # off for the soak, whatever the default
    assert env["ORCHESTRATOR_CLAIM_DELAY"] == "0.0"


def test_threads_and_group_commit_reach_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dep = Deployment("postgresql+psycopg://postgres@127.0.0.1:1/x", 2, tmp_path, pool="threads", group_commit=True,
                     claim_delay=0.2)  # fmt: skip
    cmd, env = spawned(dep, monkeypatch, "chaos1")
    assert pool_of(cmd) == ("threads", str(POOLS["threads"])) == ("threads", "8")
    assert env["ORCHESTRATOR_GROUP_COMMIT"] == "1"
    assert env["ORCHESTRATOR_CLAIM_DELAY"] == "0.2"
    assert "ORCHESTRATOR_GROUP_COMMIT" not in dep.env()  # the workers', not the reconciler's or the soak's


def test_a_threads_deck_leaves_out_kill_child_and_says_why(tmp_path: Path) -> None:
    dep = Deployment("postgresql+psycopg://postgres@127.0.0.1:1/x", 2, tmp_path, pool="threads")
    injector = Injector(dep, None, random.Random(7), print)  # type: ignore[arg-type]
    assert "kill_child" not in injector.available
    assert "pool processes" in injector.skipped["kill_child"]
    dealt = [injector._draw() for _ in range(3 * len(DECK))]
    assert "kill_child" not in dealt and None not in dealt
    prefork = Injector(Deployment("postgresql+psycopg://x@127.0.0.1:1/x", 2, tmp_path), None, random.Random(7), print)  # type: ignore[arg-type]
    assert "kill_child" in prefork.available and "kill_child" not in prefork.skipped


def test_an_unknown_pool_is_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the soak started something")

    monkeypatch.setattr(soak.tempfile, "mkdtemp", must_not)
    monkeypatch.setattr(soak, "PrivatePostgres", must_not)
    monkeypatch.setattr(soak, "Deployment", must_not)
    with pytest.raises(ChaosConfigError, match="unknown pool 'gevent'"):
        soak.run_chaos(runs=1, seed=1, pool="gevent")
    with pytest.raises(ChaosConfigError):
        Deployment("postgresql+psycopg://x@127.0.0.1:1/x", 2, tmp_path, pool="solo")
    assert issubclass(ChaosConfigError, ValueError)


def test_the_cli_passes_the_options_on_and_refuses_a_bad_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def fake_run_chaos(**kwargs: Any) -> int:
        calls.append(kwargs)
        return 0

    monkeypatch.setattr(chaos_pkg, "run_chaos", fake_run_chaos)
    runner = CliRunner()
    bad = runner.invoke(chaos, ["--pool", "gevent"])
    assert bad.exit_code == 2 and "Invalid value for '--pool'" in bad.output
    assert calls == []
    done = runner.invoke(chaos, ["--pool", "threads", "--group-commit", "--claim-delay", "0.2", "--keep"])
    assert done.exit_code == 0, done.output
    assert calls[-1]["pool"] == "threads" and calls[-1]["group_commit"] is True
    assert calls[-1]["claim_delay"] == 0.2 and calls[-1]["keep"] is True
    runner.invoke(chaos, [])
    assert calls[-1]["pool"] == "prefork" and calls[-1]["group_commit"] is False and calls[-1]["keep"] is False


class _Fakes:
    """Just enough of an orchestrator, a deployment, an injector and a probe engine for
    :meth:`soak._Loop.step` to submit runs and deal faults without a process or a database."""

    def __init__(self) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.heals: list[Any] = []
        self.db_down = False
        self.last_fault = 0.0
        self.worker_procs: dict[str, Any] = {}
        self.reads = self
        self.events = self

    # the orchestrator
    def finished_runs(self, run_ids: list[str]) -> int:
        return len(run_ids)

    def submit(self, dag: Any, idempotency_key: str) -> Any:
        self.submitted.append(dag.to_spec())
        return SimpleNamespace(id=f"r{len(self.submitted)}")

    def emit(self, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(duplicate=False, woken=0)

    # the deployment and the injector
    def supervise(self) -> list[str]:
        return []

    def heal_due(self, everything: bool = False) -> None:
        pass

    def inject(self) -> None:
        self.counts["kill_worker"] += 1

    def observe(self, mark: int) -> None:
        pass

    # the probe engine
    def connect(self) -> Any:
        raise sa.exc.DBAPIError("SELECT", None, Exception("no database here"))


def drawn(min_faults: int, runs: int = 12, shared: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The first ``runs`` DAGs a soak at seed 7 submits, and the faults dealt meanwhile (one before
    every submit when ``min_faults`` is high); ``shared``: the gaps drawn from the DAGs' generator."""
    fakes = _Fakes()
    rng = random.Random(7)
    loop = soak._Loop(fakes, fakes, fakes, None, fakes, rng, random.Random(8), random.Random(9), lambda line: None,  # type: ignore[arg-type]
                      seed=7, mix=0, min_faults=min_faults, fault_interval=0.0, action_interval=1.0, settle=60.0,
                      pending=list(range(runs)), extra=runs, pace_rng=rng if shared else random.Random(10))  # fmt: skip
    while len(fakes.submitted) < runs:
        loop.step()
    return fakes.submitted[:runs], sum(fakes.counts.values())


def test_the_dags_at_a_seed_do_not_depend_on_the_faults_dealt_between_submits() -> None:
    quiet, none = drawn(min_faults=0)
    busy, dealt = drawn(min_faults=10_000)
    assert none == 0 and dealt >= 12  # a fault (and its random gap) before every submit
    assert busy == quiet
    assert drawn(min_faults=10_000, shared=True)[0] != quiet  # as they did when the gaps came from it


def test_reconciler_shards_reach_every_reconciler_and_deal_their_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--reconciler-shards K --reconcilers N``: K and the short lease in every process that
    runs a reconciler (workers and reconcile processes); the sharded kinds dealt only then; a
    bad count refused before anything starts (the CLI by click, the soak by ChaosConfigError)."""
    dep = Deployment("postgresql+psycopg://postgres@127.0.0.1:1/x", 2, tmp_path, shards=8, reconcilers=2)
    _, env = spawned(dep, monkeypatch, "chaos1")
    assert env["ORCHESTRATOR_RECONCILER_SHARDS"] == "8" and float(env["ORCHESTRATOR_RECONCILER_SHARD_LEASE"]) > 0
    assert dep.env()["ORCHESTRATOR_RECONCILER_SHARDS"] == "8"  # the reconcile processes' too
    sharded = Injector(dep, None, random.Random(7), print)  # type: ignore[arg-type]
    assert {"kill_reconciler", "pause_reconciler"} <= set(sharded.available)
    plain = Injector(Deployment("postgresql+psycopg://x@127.0.0.1:1/x", 2, tmp_path), None, random.Random(7), print)  # type: ignore[arg-type]
    assert not {"kill_reconciler", "pause_reconciler"} & set(plain.available)
    assert "ORCHESTRATOR_RECONCILER_SHARDS" not in Deployment("postgresql+psycopg://x@127.0.0.1:1/x", 2, tmp_path).env()
    with pytest.raises(ChaosConfigError, match="reconciler shards 5000"):
        Deployment("postgresql+psycopg://x@127.0.0.1:1/x", 2, tmp_path, shards=5000)
    with pytest.raises(ChaosConfigError, match="reconcilers -1"):
        Deployment("postgresql+psycopg://x@127.0.0.1:1/x", 2, tmp_path, reconcilers=-1)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(chaos_pkg, "run_chaos", lambda **kw: calls.append(kw) or 0)
    runner = CliRunner()
    assert runner.invoke(chaos, ["--reconciler-shards", "5000"]).exit_code == 2 and calls == []
    done = runner.invoke(chaos, ["--reconciler-shards", "8", "--reconcilers", "3"])
    assert done.exit_code == 0, done.output
    assert calls[-1]["shards"] == 8 and calls[-1]["reconcilers"] == 3
