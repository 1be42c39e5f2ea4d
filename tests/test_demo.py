"""The README's quick start: `orchestrator demo` on the embedded default, no servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_on_the_embedded_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "sqlite:///" in out and "filesystem://" in out
    assert "extract_customers  SUCCEEDED  2" in out  # the flaky extract was retried
    assert out.strip().endswith("SUCCEEDED")
    assert (tmp_path / ".orchestrator" / "orchestrator.db").exists()
