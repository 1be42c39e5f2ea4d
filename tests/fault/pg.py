"""A private PostgreSQL server for outage tests: its own data directory on a free port, so a
test may stop and restart it without touching the shared server other suites use.

The chaos soak's server (:class:`orchestrator.testing.chaos.PrivatePostgres`: the Debian cluster
binaries, run as the ``postgres`` user as root), with a blocking restart. Missing binaries fail
the test: the outage tests are part of the suite, never skipped.
"""

from __future__ import annotations

import time

import pytest

from orchestrator.testing import chaos


class PrivatePostgres(chaos.PrivatePostgres):
    def __init__(self) -> None:
        try:
            super().__init__()
        except RuntimeError as exc:  # no server binaries
            pytest.fail(str(exc))

    def restart(self, down_for: float) -> None:
        """Stop (terminating every session), stay down ``down_for`` seconds, start again."""
        self.stop("fast")
        time.sleep(down_for)
        self.start()
