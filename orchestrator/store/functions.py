"""The server functions: their live definitions are the files of ``store/sql/``.

Each file holds one concept's functions, named ``orc_<concept>_v<N>`` in procrastinate's manner.
A fresh database installs these files (``migrate.create``); an existing one gets them from the
migrations, each of which, from ``0019`` on, holds a frozen copy of only the functions it adds or
changes. A function is changed in place when its signature is unchanged and a worker of the
previous release calling it mid-upgrade still gets what it expects; otherwise it is a new
``_v<N+1>`` beside the old one (a shim in ``legacy.sql`` until no worker of the release that calls
it is left). The rule: ``docs/reference/migrations.md``; ``tests/store/test_sql_files.py`` and
``tests/store/test_fresh_schema.py`` hold it.
"""

from __future__ import annotations

from importlib import resources

#: the files in the order they are installed (``legacy`` last: SQL-language shims over the
#: ``_v1`` functions are checked when created)
FILES = (
    "decide", "reject", "breaker", "limit_held", "admit_from", "pass_slot", "admit", "expand", "settle", "claim",
    "succeed", "skip", "clear", "wait", "flow", "legacy",
)  # fmt: skip


def source(name: str) -> str:
    """The text of ``store/sql/<name>.sql``."""
    return resources.files(__package__).joinpath("sql", f"{name}.sql").read_text()


def definitions() -> str:
    """Every live definition, in install order: what a fresh database installs."""
    return "\n".join(source(name) for name in FILES)
