"""The server functions: their live definitions are the files of ``store/sql/``.

Each file holds one concept's function, named ``orc_<concept>_v<N>`` in procrastinate's manner:
a change of signature or meaning is a new ``_v<N+1>`` function beside the old one (which stays,
as a shim in ``legacy.sql``, until no worker of the release that calls it is left), so that during a rolling upgrade old
workers keep calling the functions they know while new ones call the new. A migration installs
a frozen copy of these files (``0009_versioned_functions`` the first); ``tests/store/
test_sql_files.py`` holds the functions of a freshly migrated database equal to the files, so a
change to a file without its migration fails the suite.
"""

from __future__ import annotations

from importlib import resources

#: the files in the order they are installed (``legacy`` last: SQL-language shims over the
#: ``_v1`` functions are checked when created)
FILES = (
    "decide", "reject", "breaker", "limit_held", "admit_from", "pass_slot", "admit", "expand", "settle", "claim",
    "succeed", "skip", "clear", "wait", "legacy",
)  # fmt: skip


def source(name: str) -> str:
    """The text of ``store/sql/<name>.sql``."""
    return resources.files(__package__).joinpath("sql", f"{name}.sql").read_text()


def definitions() -> str:
    """Every live definition, in install order: what a new migration freezes."""
    return "\n".join(source(name) for name in FILES)
