"""What every command of the ``orchestrator`` command line shares: the seam that builds the
orchestrator (``_orc``, ``_ready_store``: commands call them through this module, ``base._orc()``,
so a test replaces them in one place), one-line errors (``_fail``, ``_Group``), output
formatting and option helpers."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ..core.errors import OrchestratorError

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator


def _orc() -> Orchestrator:
    """The orchestrator of the configured deployment (the seam a test replaces: ``base._orc``)."""
    from ..runtime.celery_app import default_orchestrator

    return default_orchestrator()


def _ready_store() -> Orchestrator:
    """:func:`_orc`, its database ready: the embedded default migrated, any other schema checked."""
    return _orc().ready()


def _by() -> str:
    """Who acts through the CLI, and from where, as the ledger records it: ``user@host (cli)``."""
    from ..engine.scope import local_by

    return local_by("cli")


def _dump(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def state_text(task: Any) -> str:
    """A task's state as the task tables print it: a SKIPPED task with its reason
    (``SKIPPED (branch_not_taken)``), a mapped node with its children counted (``MAPPED 7/10
    done: 6 ok, 1 failed, 0 skipped``), a map's child with its item (``SUCCEEDED (item 3 of
    resize)``)."""
    text = str(task.state.value)
    if task.skip_reason:
        text += f" ({task.skip_reason})"
    counts = task.map_counts
    if counts is not None:
        text += (
            f" {counts['done']:,}/{counts['total']:,} done: {counts['succeeded']:,} ok, {counts['failed']:,} failed,"
            f" {counts['skipped']:,} skipped"
        )
    if task.map_parent is not None:
        text += f" (item {task.map_index} of {task.map_parent})"
    return text


def format_task_table(tasks: list[Any]) -> str:
    """A plain-text table of tasks: key, state (with a skip reason, a map's counts, a child's
    item: :func:`state_text`), attempt, duration, error."""
    from ..core.states import TaskState

    header = ("KEY", "STATE", "ATTEMPT", "DURATION", "ERROR")
    rows = [
        (
            t.key,
            state_text(t),
            str(t.attempt),
            f"{t.duration:.2f}s" if t.duration is not None else "-",
            (t.error or "")[:60] if t.state is not TaskState.SUCCEEDED else "",
        )
        for t in tasks
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


class _Path(click.Path):
    """click's Path, refusing a path holding a NUL as a usage error (``os.stat`` raises
    ValueError for it, which click lets through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "\x00" in value:
            self.fail("a path cannot hold a NUL character", param, ctx)
        return super().convert(value, param, ctx)


def _fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: MESSAGE`` as one line on stderr and exit ``code``."""
    click.echo("error: " + " ".join(str(message).split()), err=True)
    sys.exit(code)


class _Group(click.Group):
    """Every error as one ``error: …`` line on stderr, never a traceback: exit 2 for orchestrator
    errors, database errors, files that cannot be read or written and usage errors (click's
    own, made one line); an unexpected exception (a bug) is one line too, exit 2."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # a group alone: its help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail(exc.format_message() + hint, exc.exit_code)
        except click.ClickException as exc:  # a command's refusal: exit 2 as every error
            _fail(exc.format_message())
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        import sqlalchemy as sa

        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except OrchestratorError as exc:
            _fail(str(exc))
        except sa.exc.DBAPIError as exc:
            # unreachable or misconfigured database: the driver's first line (never the URL's password)
            first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
            _fail(f"database: {first}")
        except sa.exc.ArgumentError as exc:
            _fail(f"database URL: {exc}")
        except OSError as exc:  # a file that cannot be read or written (a missing folder, a full disk)
            where = f": {exc.filename}" if exc.filename else ""
            _fail(f"{exc.strerror or exc}{where}")
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the last guard: a bug, still one line
            _fail(f"unexpected {type(exc).__name__} (a bug; please report it): {exc}")


def _json_text(text: str, option: str) -> Any:
    """An option's JSON value, or ValidationError: not JSON, NaN / Infinity, a duplicate key, or
    nested too deep to read (never a RecursionError; what is read is then held to the JSON depth
    limit of what it is for)."""
    from ..core.dag import parse_spec
    from ..core.errors import SpecError, ValidationError

    try:
        return parse_spec(text, fmt="json")
    except SpecError as exc:
        raise ValidationError(f"{option} is not JSON: {str(exc).removeprefix('cannot parse JSON: ')}") from None


def _json_object(text: str | None, option: str) -> dict[str, Any] | None:
    """An option's JSON object (``--payload``, ``--match``, ``--params``), or ValidationError."""
    from ..core.errors import ValidationError

    if text is None:
        return None
    value = _json_text(text, option)
    if not isinstance(value, dict):
        raise ValidationError(f"{option} must be a JSON object, not {type(value).__name__}")
    return value


def _batch_option(text: str | None) -> tuple[Any, str] | None:
    """``--batch 100,5s`` -> ``(100, "5s")`` (core/flow.py checks it)."""
    if text is None:
        return None
    most, _, window = text.partition(",")
    return (int(most) if most.strip().isdigit() else most.strip()), window.strip()
