"""The pytest plugin of the test kit, registered through the ``pytest11`` entry point: installing
the package is enough.

Fixtures:

- ``orchestrator``: a :class:`~orchestrator.testing.Kit` for the test (``run_dag``, ``emit``,
  ``signal``, ``approve``, ``clock``, ``reconcile``); :func:`orchestrator.testing.run_dag` uses it
  (a test that calls ``run_dag`` without naming the fixture gets it on first use).
- ``orchestrator_db``: the kit's database (one per pytest run, each xdist worker its own),
  emptied and its clock back at real time for each test.
- ``orchestrator_worker`` (opt-in): a real Celery worker in a thread on the app's broker
  (:class:`~orchestrator.testing.live.LiveWorker`), for the few tests that want one.
- ``orchestrator_app``: the Celery app whose tasks the DAGs name; ``None`` (the default) is the
  project's app (``orchestrator.runtime.celery_app.get_app()``). Override it in a ``conftest.py``.

``--orchestrator-db URL`` (or ``ORCHESTRATOR_KIT_DATABASE_URL``) names the database to use; else
a database ``test_<name>`` beside ``ORCHESTRATOR_DATABASE_URL``'s; else an embedded PostgreSQL
started for the run and stopped at its end (see :mod:`orchestrator.testing.database`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .database import KitDatabase
    from .runner import Kit


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("orchestrator", "orchestrator test kit")
    group.addoption(
        "--orchestrator-db",
        default=None,
        metavar="URL",
        help="the PostgreSQL database the orchestrator test kit uses (wiped before every test); default: a"
        " database test_<name> beside ORCHESTRATOR_DATABASE_URL's, else an embedded PostgreSQL",
    )


@pytest.fixture(scope="session")
def _orchestrator_kit_database(request: pytest.FixtureRequest) -> Iterator[KitDatabase]:
    from .database import EmbeddedServer, KitDatabase, resolve_url

    url, _ = resolve_url(request.config.getoption("--orchestrator-db"))
    server = None
    if url is None:
        server = EmbeddedServer()
        url = server.start()
    try:
        db = KitDatabase.prepare(url)
        try:
            yield db
        finally:
            db.dispose()
    finally:
        if server is not None:
            server.stop()


@pytest.fixture
def orchestrator_db(_orchestrator_kit_database: KitDatabase) -> KitDatabase:
    """The kit's database, emptied for this test, its clock at real time."""
    _orchestrator_kit_database.clean()
    return _orchestrator_kit_database


@pytest.fixture
def orchestrator_app() -> Any:
    """The Celery app of the tasks the DAGs name (``None``: the project's ``get_app()``)."""
    return None


@pytest.fixture
def orchestrator(orchestrator_db: KitDatabase, orchestrator_app: Any) -> Iterator[Kit]:
    """The test's kit: ``orchestrator.run_dag(dag, ...)``, ``.emit``, ``.signal``, ``.approve``,
    ``.clock``."""
    from .runner import Kit, set_current

    kit = Kit(orchestrator_db, app=orchestrator_app)
    set_current(kit)
    try:
        yield kit
    finally:
        set_current(None)
        kit.close()


@pytest.fixture
def orchestrator_worker(orchestrator: Kit) -> Iterator[Any]:
    """Opt-in: a real Celery worker of the kit's app in a thread (its broker, the reconciler
    service), for the tests that want one; ``orchestrator_worker.run_dag(dag)`` waits in real
    time. See :mod:`orchestrator.testing.live`."""
    from .live import LiveWorker

    with LiveWorker(orchestrator) as live:
        yield live


@pytest.fixture(autouse=True)
def _orchestrator_kit_on_demand(request: pytest.FixtureRequest) -> Iterator[None]:
    """Lets ``orchestrator.testing.run_dag`` make the test's kit on first use."""
    from . import runner

    runner.set_lazy(lambda: request.getfixturevalue("orchestrator"))
    try:
        yield
    finally:
        runner.set_lazy(None)
