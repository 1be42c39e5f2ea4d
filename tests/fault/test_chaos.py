"""``orchestrator chaos`` briefly: every kind of fault is injected at least once (on its private
Postgres and Redis, restarted, cut off, partitioned and with a worker's clock jumping), and the
report says nothing was lost, committed twice or left stuck."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.testing.chaos import KINDS, libfaketime, skewed_env
from orchestrator.testing.chaos.mix import ACTIONS
from tests.fault.harness import ROOT
from tests.integration.conftest import stop_process

#: CI installs faketime (.ci/run): there a missing libfaketime fails these tests; elsewhere they skip
NEEDS_FAKETIME = pytest.mark.skipif(
    libfaketime() is None and not os.environ.get("CI"),
    reason="libfaketime is not installed (apt-get install faketime)",
)

pytestmark = pytest.mark.fault


def soak(*args: str, timeout: float) -> str:
    """``orchestrator chaos ARGS`` in its own process group (on its private servers: no
    ``ORCHESTRATOR_*`` of this process reaches it); its output, after asserting it exited 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    cmd = [sys.executable, "-m", "orchestrator.cli", "chaos", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stop_process(proc, timeout=60)  # SIGTERM: the soak stops what it started, then exits
    assert proc.returncode == 0, out
    return out


def fault_counts(out: str) -> dict[str, int]:
    found = re.search(r"faults injected: (\d+) of (\d+) kinds \(([^)]*)\)", out)
    assert found, out
    counts = {k: int(v) for k, v in (pair.split("=") for pair in found.group(3).split(", "))}
    assert sum(counts.values()) == int(found.group(1)), out
    return counts


def test_a_short_soak_injects_every_kind_and_keeps_the_promise() -> None:
    out = soak("--runs", "4", "--min-faults", "24", "--seed", "3", "--workers", "2", "--timeout", "120", timeout=170)
    counts = fault_counts(out)
    assert set(counts) == set(KINDS), out  # every kind, the four new ones among them
    assert len(KINDS) >= 9 and {"pg_restart", "broker_cut", "clock_jump", "pg_partition"} <= set(KINDS)
    assert all(n >= 1 for n in counts.values()) and sum(counts.values()) >= 24, out
    for kind in KINDS:  # reported per kind
        assert re.search(rf"^  {kind} +\d+ ", out, re.MULTILINE), out
    assert "lost: 0  committed twice: 0  stuck: 0" in out, out
    assert "violation:" not in out, out


SKEWED_PROBE = """\
import sys, threading, time
stop = threading.Event()
walls = []
for _ in range(int(sys.argv[1])):
    stop.wait(0.1)                       # a timed wait of a thread (the registry's, the reconciler's)
    threading.Lock().acquire(timeout=0.1)
    time.sleep(0.1)
    walls.append(time.time())
print(min(walls), max(walls), flush=True)
"""


@NEEDS_FAKETIME
def test_the_skewed_worker_waits_and_sleeps_on_time_while_its_wall_clock_jumps(tmp_path: Path) -> None:
    """Crossing 7 of issue 36: under libfaketime with its monotonic clock faked (the soak's
    setting before), ``Event.wait(0.1)`` never returned (``sem_clockwait`` given a deadline of
    about 1.8e9 s): the skewed worker's registry and reconciler threads stopped at their first
    wait and a one-worker soak reported every run after it lost and stuck."""
    lib = libfaketime()
    assert lib is not None
    clock = tmp_path / "clock"
    clock.write_text("+0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATOR_", "FAKETIME"))}
    env.update(skewed_env(lib, clock, tmp_path, str(ROOT)))
    rounds = 40  # 40 x (0.1 + 0.1 + 0.1) s: about 12 s, through two jumps of the wall clock
    proc = subprocess.Popen([sys.executable, "-c", SKEWED_PROBE, str(rounds)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        for offset in ("+7m", "-9m"):  # as Injector.clock_jump writes it
            time.sleep(3)
            (tmp_path / "clock.tmp").write_text(f"{offset}\n")
            (tmp_path / "clock.tmp").replace(clock)
        out, _ = proc.communicate(timeout=60)  # hung forever before
    finally:
        stop_process(proc)
    assert proc.returncode == 0, out
    low, high = (float(x) for x in out.split())
    assert high - low > 6 * 60, out  # the wall clock did jump (forward 7 minutes at least)


@NEEDS_FAKETIME
def test_a_soak_whose_only_worker_has_the_jumping_clock_loses_nothing() -> None:
    """Crossing 7 of issue 36: ``chaos --workers 1`` (the one worker is the skewed one) reported
    ``lost: 53 ... stuck: 53`` on this very command before: its worker's capacity row went stale
    (the registry thread's timed wait never woke), so nothing more was admitted."""
    out = soak("--runs", "4", "--min-faults", "12", "--seed", "3", "--workers", "1", "--timeout", "150", timeout=240)
    assert fault_counts(out).get("clock_jump", 0) >= 1, out
    assert "lost: 0  committed twice: 0  stuck: 0" in out, out
    assert "violation:" not in out, out


def test_the_interaction_soak_keeps_the_promise_through_operator_actions() -> None:
    """``--mix``: a few dozen operator actions of every kind (clear, mark, retry, skip, cancel,
    rerun, approvals, a foreign tenant's events, a breaker, schedule and trigger firings, db
    clean) on runs with maps wider than an insert window, branches, waits and events, beside a
    worker that lacks one task module, while faults of every kind go on: nothing lost, committed
    twice or stuck, no violation."""
    out = soak("--runs", "4", "--min-faults", "12", "--mix", "30", "--seed", "7", "--workers", "2",
               "--timeout", "150", timeout=230)  # fmt: skip
    assert sum(fault_counts(out).values()) >= 12, out
    found = re.search(r"operator actions: (\d+) of (\d+) kinds", out)
    assert found and int(found.group(1)) >= 30 and int(found.group(2)) == len(ACTIONS), out
    for kind in ACTIONS:  # reported per kind: count, applied, refused, errors, violations
        row = re.search(rf"^  {kind} +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)", out, re.MULTILINE)
        assert row, out
        assert row.group(5) == "0", out  # no violation in the runs it touched
    assert "lost: 0  committed twice: 0  stuck: 0" in out, out
    assert "violation:" not in out, out
