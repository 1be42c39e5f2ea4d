"""``orchestrator chaos`` briefly: every kind of fault is injected at least once (on its private
Postgres and Redis, restarted, cut off, partitioned and with a worker's clock jumping), and the
report says nothing was lost, committed twice or left stuck."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from orchestrator.chaos import KINDS
from tests.fault.harness import ROOT
from tests.integration.conftest import stop_process

pytestmark = pytest.mark.fault


def test_a_short_soak_injects_every_kind_and_keeps_the_promise() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    cmd = [sys.executable, "-m", "orchestrator.cli", "chaos", "--runs", "4", "--min-faults", "24", "--seed", "3",
           "--workers", "2", "--timeout", "120"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=170)
    finally:
        stop_process(proc, timeout=60)  # SIGTERM: the soak stops what it started, then exits
    assert proc.returncode == 0, out
    found = re.search(r"faults injected: (\d+) of (\d+) kinds \(([^)]*)\)", out)
    assert found, out
    counts = {k: int(v) for k, v in (pair.split("=") for pair in found.group(3).split(", "))}
    assert set(counts) == set(KINDS), out  # every kind, the four new ones among them
    assert len(KINDS) >= 9 and {"pg_restart", "broker_cut", "clock_jump", "pg_partition"} <= set(KINDS)
    assert all(n >= 1 for n in counts.values()) and sum(counts.values()) == int(found.group(1)) >= 24, out
    for kind in KINDS:  # reported per kind
        assert re.search(rf"^  {kind} +\d+ ", out, re.MULTILINE), out
    assert "lost: 0  committed twice: 0  stuck: 0" in out, out
    assert "violation:" not in out, out
