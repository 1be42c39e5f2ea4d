"""Property-based fuzzing of the command line: click's ``CliRunner`` over every command (those
that serve or loop forever aside) with random arguments, options and files (missing, empty,
a folder, not UTF-8, nested 50,000 deep, endless ``/dev/zero``, a folder that does not exist
for an output), over a real database.

Every invocation exits with a documented code: 0; 2 with exactly one ``error: …`` line on
stderr (``warning: …`` lines aside) for every refusal, usage errors included; 1 only where a
command documents it (``verify``, ``db check``); 3 only for ``embedded status``. Never a
traceback, never another exception, and a refusal (exit 2) writes no row (the ledger's
rejected rows of a refused operator action excepted).

The default suite runs a small budget; ``pytest -m fuzz tests/unit/test_cli_fuzz.py -s`` runs
5,000 invocations (``ORCHESTRATOR_FUZZ_CLI_EXAMPLES`` changes it) and prints the counts."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import Orchestrator, Settings
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from tests.conftest import clean_test_database
from tests.unit.test_api_fuzz import LEDGER, counts

TASKS = ["t.ok", "t.other"]
#: commands that serve, loop or change the schema: not fuzzed here
EXCLUDED = {
    "demo", "worker", "beat", "serve", "reconcile", "watch", "chaos", "embedded start", "embedded stop",
    "db upgrade", "db downgrade",
}  # fmt: skip
#: options that make a command follow a run (or point it elsewhere): never drawn
NEVER = {"--wait", "--database-url"}
#: commands whose refusal leaves its record in the ledger (a rejected operator action)
LEDGER_COMMANDS = {"retry", "skip", "fail", "cancel", "approve", "reject", "clear", "mark"}
#: exit 1 where the command documents it
EXIT_1 = {"verify", "db check"}


def _budget(marker_run: bool) -> int:
    default = 5000 if marker_run else 60
    return int(os.environ.get("ORCHESTRATOR_FUZZ_CLI_EXAMPLES", default))


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    found: dict[str, click.Command] = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found.update(_commands(cmd, (*path, name)))
        elif " ".join((*path, name)) not in EXCLUDED:
            found[" ".join((*path, name))] = cmd
    return found


COMMANDS = _commands(cli.main)


class Files:
    """The files the fuzzer hands to commands."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        good = {
            "name": "fuzzed",
            "nodes": [{"key": "a", "task": "t.ok"}, {"key": "b", "task": "t.ok", "upstream": ["a"]}],
        }
        import json

        (tmp / "good.json").write_text(json.dumps(good))
        (tmp / "good.yaml").write_text("name: fuzzed-y\nnodes:\n  - key: a\n    task: t.ok\n")
        (tmp / "deep.json").write_text('{"name": "x", "nodes": ' + "[" * 50_000 + "]" * 50_000 + "}")
        (tmp / "deep.yaml").write_text("name: x\nparams: " + "[" * 50_000 + "]" * 50_000 + "\n")
        (tmp / "latin1.yaml").write_bytes("name: café\nnodes: []\n".encode("latin-1"))
        (tmp / "latin1.json").write_bytes(b'{"triggers": [{"name": "caf\xe9"}]}')
        (tmp / "empty.yaml").write_text("")
        (tmp / "list.yaml").write_text("- 1\n- 2\n")
        (tmp / "schedules.yaml").write_text(
            "schedules:\n  - name: s1\n    every: 3600\n    spec: good.yaml\n  - name: s2\n    cron: nope\n"
        )
        (tmp / "triggers.yaml").write_text("triggers:\n  - name: t1\n    event: go\n    spec: good.yaml\n")
        (tmp / "nan.json").write_text('{"name": "x", "nodes": [{"key": "a", "task": "t.ok", "args": [NaN]}]}')
        (tmp / "folder").mkdir()
        self.paths = [
            *(str(tmp / n) for n in ("good.json", "good.yaml", "deep.json", "deep.yaml", "latin1.yaml", "latin1.json")),
            *(str(tmp / n) for n in ("empty.yaml", "list.yaml", "schedules.yaml", "triggers.yaml", "nan.json")),
            str(tmp / "folder"),
            str(tmp / "missing.yaml"),
            str(tmp / "no-such-folder" / "out.jsonl"),
            "/dev/zero",
            "/dev/null",
            "-",
        ]


_words = st.sampled_from(
    [
        "a", "b", "ev", "ok", "go", "t1", "s1", "fuzzed", "", " ", "-", "--", "-x", "x" * 300, "a\x00b", "\udcff",
        "é", "a[1]", "../x", "0", "-1", "1", "1.5", "1e309", "nan", "inf", "99999999999999999999", "999999d",
        "1h", "30d", "0s", "2026-01-01", "2026-13-45", "10/s", "5/h", "nope", "SUCCEEDED", "success", "UTC",
        "Mars/Olympus", "0 3 * * *", "* * *", "tasks.dags:nope", "os:system", "fuzzed@1", "fuzzed@x",
        '{"a": 1}', "{}", "[]", '{"n": NaN}', "[" * 5000 + "]" * 5000, '{"a": ' + "{" * 3000 + "}" * 3000 + "}",
        "{", "null", '"text"', "RUN",
    ]
)  # fmt: skip


@st.composite
def _argv(draw: Any, files: Files) -> tuple[str, list[str]]:
    name = draw(st.sampled_from(sorted(COMMANDS)))
    cmd = COMMANDS[name]
    values = st.one_of(_words, _words, st.sampled_from(files.paths), st.text(max_size=8))
    argv: list[str] = []
    if draw(st.integers(0, 9)) == 0:
        argv += ["--tenant", draw(st.sampled_from(["acme", "default", "bad tenant!", ""]))]
    argv += name.split()
    for param in cmd.params:
        if isinstance(param, click.Argument):
            n = param.nargs if param.nargs > 0 else draw(st.integers(0, 3))
            if not param.required and draw(st.integers(0, 3)) == 0:
                continue
            argv += [draw(values) for _ in range(n)]
        elif isinstance(param, click.Option):
            flag = param.opts[0]
            if flag in NEVER or flag == "--help" or draw(st.integers(0, 2)):
                continue
            if param.is_flag:
                argv.append(draw(st.sampled_from([*param.opts, *param.secondary_opts])))
            elif isinstance(param.type, click.Choice) and draw(st.integers(0, 3)):
                argv += [flag, str(draw(st.sampled_from(list(param.type.choices))))]
            else:
                argv += [flag, draw(values)]
    if draw(st.integers(0, 14)) == 0:
        argv.append(draw(st.sampled_from(["--nope", "extra", "--json", "-h"])))
    return name, argv


#: how the invocations of this session ended (printed by the long run)
OUTCOMES: Counter[str] = Counter()


class Bench:
    def __init__(self, orc: Orchestrator, files: Files, url: str) -> None:
        self.orc, self.files, self.url = orc, files, url
        self.runner = CliRunner()
        self.setup()

    def setup(self) -> None:
        orc = self.orc
        orc.register_worker("w", default_queues(), 10)
        spec = {
            "name": "target",
            "nodes": [
                {"key": "ev", "wait": {"event": "go"}},
                {"key": "ok", "wait": {"approval": True}},
                {"key": "a", "task": "t.ok"},
            ],
        }
        self.run_id = orc.submit(dag_from_spec(spec)).id

    def invoke(self, name: str, argv: list[str]) -> str | None:
        """One invocation; what was wrong with how it ended, or None."""
        argv = [self.run_id if a == "RUN" else a for a in argv]
        before = counts(self.orc)
        cwd = os.getcwd()
        os.chdir(self.files.tmp)  # a relative --archive or -o lands in the test's folder
        try:
            result = self.runner.invoke(
                cli.main,
                argv,
                env={"ORCHESTRATOR_DATABASE_URL": self.url, "ORCHESTRATOR_TENANT": None},
                catch_exceptions=True,
            )
        finally:
            os.chdir(cwd)
        code = result.exit_code
        shown = f"{' '.join(a[:40] for a in argv)[:200]!r}"
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            exc = result.exception
            return f"{name}: raw {type(exc).__name__}: {str(exc)[:150]} ({shown})"
        out = (result.stdout or "") + (result.stderr or "")
        if "Traceback" in out:
            return f"{name}: a traceback ({shown})"
        if code == 0 or (code == 1 and name in EXIT_1) or (code == 3 and name == "embedded status"):
            OUTCOMES[f"exit {code}"] += 1
            return None
        if code != 2:
            return f"{name}: exit {code}, undocumented ({shown}): {out[-200:]!r}"
        lines = [line for line in (result.stderr or "").splitlines() if not line.startswith("warning: ")]
        if len(lines) != 1 or not lines[0].startswith("error: "):
            return f"{name}: exit 2 without one error line ({shown}): {result.stderr[-300:]!r}"
        if "(a bug; please report it)" in lines[0]:  # the last guard caught a raw exception
            return f"{name}: {lines[0][:200]} ({shown})"
        after = counts(self.orc)
        changed = {t: after[t] - before[t] for t in after if after[t] != before[t]}
        if name in LEDGER_COMMANDS:
            changed = {t: d for t, d in changed.items() if t not in LEDGER}
        if changed:
            return f"{name}: a refusal wrote rows {changed} ({shown}): {lines[0][:150]}"
        OUTCOMES["exit 2"] += 1
        return None


def _run(bench: Bench, n: int) -> list[str]:
    found: list[str] = []
    kinds: Counter[str] = Counter()

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_argv(bench.files))
    def prop(case: tuple[str, list[str]]) -> None:
        problem = bench.invoke(*case)
        if problem is None:
            return
        OUTCOMES["wrong"] += 1
        kind = problem.split(" (")[0][:90]
        kinds[kind] += 1
        if kinds[kind] <= 2:
            found.append(problem)

    prop()
    return found


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    url = clean_test_database()
    settings_ = Settings.from_env({}, data_dir=str(tmp_path_factory.mktemp("cli-fuzz")), database_url=url)
    orc = Orchestrator(settings_, publisher=RecordingPublisher(), registry=StaticRegistry(TASKS))
    files = Files(tmp_path_factory.mktemp("cli-files"))
    mp = pytest.MonkeyPatch()
    mp.setattr(cli_base, "_orc", lambda: orc)
    yield Bench(orc, files, url)
    mp.undo()
    orc.store.dispose()


def test_cli_invocations_exit_with_a_documented_code_and_one_line(bench: Bench) -> None:
    OUTCOMES.clear()
    found = _run(bench, _budget(False))
    assert not found, "\n".join(found)


DEEP = "[" * 50_000 + "]" * 50_000
DEEP_OBJECT = '{"a": ' + "{" * 5000 + "}" * 5000 + "}"


@pytest.mark.parametrize(
    "argv",
    [
        ["emit", "go", "--payload", DEEP],
        ["emit", "go", "--payload", DEEP_OBJECT],
        ["signal", "RUN", "go", "--payload", DEEP],
        ["on", "add", "t1", "--event", "go", "--match", DEEP_OBJECT, "--spec", "good.yaml"],
        ["on", "add", "t1", "--event", "go", "--params", DEEP, "--spec", "good.yaml"],
        ["schedule", "add", "s1", "--every", "3600", "--spec", "good.yaml", "--params", DEEP_OBJECT],
        ["submit", "--dag", "fuzzed", "--param", "a=" + DEEP],
        ["submit", "deep.json"],
        ["submit", "deep.yaml"],
        ["submit", "latin1.yaml"],
        ["dag", "register", "a\x00b"],
        ["on", "apply", "latin1.json"],
        ["schedule", "apply", "latin1.json"],
        ["graph", "RUN", "-o", "no-such-folder/graph.svg"],
        ["pool", "remove", "no-such-pool"],
        ["runs", "--limit", "x"],
        ["nosuchcommand"],
        ["--tenant"],
    ],
    ids=lambda argv: " ".join(a[:12] for a in argv)[:60],
)
def test_known_bad_inputs_exit_2_with_one_error_line(bench: Bench, argv: list[str]) -> None:
    """The inputs the first fuzz runs found ending in a traceback (a RecursionError of nested
    JSON, a UnicodeDecodeError of a file that is not UTF-8, an OSError of a missing folder) or
    in several lines (click's usage errors), or in exit 1 (a refusal by ``click.ClickException``)."""
    name = " ".join(a for a in argv[:2] if not a.startswith("-"))
    problem = bench.invoke(name, argv)
    assert problem is None, problem
    assert OUTCOMES["exit 2"] >= 1


def test_a_group_alone_shows_its_help(bench: Bench) -> None:
    for argv in ([], ["db"], ["schedule"]):
        result = bench.runner.invoke(cli.main, argv)
        assert result.exit_code == 2 and "Usage:" in result.output and "Commands:" in result.output, argv


def test_an_endless_spec_file_is_refused_not_read_to_its_end(tmp_path: Path) -> None:
    """``submit /dev/zero`` (and a FIFO whose writer never stops) read at most the spec size
    limit, then exit 2 with one line; run in a process of its own, bounded in memory and time."""
    import resource
    import subprocess
    import sys

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))

    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    writer = subprocess.Popen(
        ["sh", "-c", f"yes 'a: 1' > {fifo}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        for path in ("/dev/zero", str(fifo)):
            done = subprocess.run(
                [sys.executable, "-m", "orchestrator.cli", "submit", path],
                capture_output=True, text=True, timeout=120, preexec_fn=bounded,
            )  # fmt: skip
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, (path, done.returncode, done.stderr[-500:])
            assert lines[0].startswith("error: ") and "over" in lines[0], lines
    finally:
        os.killpg(writer.pid, 9)
        writer.wait(10)


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
def test_fuzz_the_cli_long(bench: Bench) -> None:
    OUTCOMES.clear()
    n = _budget(True)
    found = _run(bench, n)
    print(f"\nCLI fuzz: {sum(OUTCOMES.values())} invocations ({n} asked): {dict(sorted(OUTCOMES.items()))}")
    assert not found, "\n".join(found)
