"""``python -m orcapod.config_docs``: ``docs/configuration.md``, made from the
command-line parsers of the commands a user runs and the environment variables
the code reads. ``--write`` writes the file; without it the page goes to stdout.
``tests/test_configuration_docs.py`` fails when the file and the code disagree.

Each parser is built, never run: every command's module has a ``build_parser()``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "python -m orcapod.config_docs --write"
# No value: the flag's description says what then.
NO_DEFAULT = "—"


def _gateway() -> argparse.ArgumentParser:
    from gateway.__main__ import build_parser

    return build_parser()


def _scheduler() -> argparse.ArgumentParser:
    from scheduler_actor.__main__ import build_parser

    return build_parser()


def _worker() -> argparse.ArgumentParser:
    from gpu_worker.__main__ import build_parser

    return build_parser()


def _up() -> argparse.ArgumentParser:
    from orcapod.up import build_parser

    return build_parser()


def _chat() -> argparse.ArgumentParser:
    from orcapod.chat import build_parser

    return build_parser()


def _tenants() -> argparse.ArgumentParser:
    from gateway.tenants_cli import build_parser

    return build_parser()


def _model() -> argparse.ArgumentParser:
    from gpu_worker.model_prepare import build_parser

    return build_parser()


@dataclass(frozen=True)
class Command:
    """A command a user runs, and how to build its parser without running it."""

    name: str  # as typed
    also: str | None  # the same through the `orcapod` command
    about: str
    build_parser: Callable[[], argparse.ArgumentParser]


COMMANDS = (
    Command(
        "python -m gateway",
        "orcapod gateway",
        "One gateway: the websocket protocol, the OpenAI API, `/healthz`, `/metrics` and "
        "the pages, on one port. Any number may run on one Redis.",
        _gateway,
    ),
    Command(
        "python -m scheduler_actor",
        "orcapod scheduler",
        "The scheduler, which decides every step of every worker: one per Redis and prefix.",
        _scheduler,
    ),
    Command(
        "python -m gpu_worker",
        "orcapod worker",
        "One worker: loads the model, sizes its K/V pool, runs the scheduler's plans "
        "(on CUDA when present, else on the CPU).",
        _worker,
    ),
    Command(
        "orcapod up",
        None,
        "The whole service on one machine: a redis-server of its own (unless `REDIS_URL` "
        "is set), the scheduler, the workers and the gateways, each a process of its own, "
        "restarted when it exits. Every actor inherits its environment, so a variable set "
        "for `orcapod up` reaches each actor that reads it; flags reach them through "
        "`--worker-arg`, `--scheduler-arg` and `--gateway-arg`.",
        _up,
    ),
    Command("orcapod chat", None, "A terminal chat client of a running service.", _chat),
    Command(
        "orcapod tenants",
        None,
        "API keys of tenants: kept as sha256 hashes in the Redis hash `<prefix>:tenants`, "
        "or printed as a tenants-file section.",
        _tenants,
    ),
    Command(
        "orcapod model",
        None,
        "The embedded model: `prepare` converts the packaged SmolLM2 once (`orcapod up` "
        "does it at its first start), `path` prints the directory that will be served.",
        _model,
    ),
)


@dataclass(frozen=True)
class Variable:
    """An environment variable that no flag stands for (in some command at least)."""

    name: str
    read_by: str
    meaning: str


ENVIRONMENT_ONLY = (
    Variable(
        "REDIS_URL",
        "`orcapod up`",
        "the Redis the service uses (`redis://[user:password@]host:port/db`, `rediss://` for "
        "TLS: [security.md](security.md)); unset, `orcapod up` starts a redis-server of its "
        "own (a random password, loopback only, its data removed at the end) and gives its "
        "URL to every actor. The actors and `orcapod tenants` also take `--redis-url`",
    ),
    Variable(
        "ORCAPOD_CACHE_DIR",
        "the gateway, `orcapod up`, the worker's Q4_1 kernel",
        "the cache folder (default `~/.cache/orcapod`): prepared models in `models/`, the "
        "worker's compiled graphs in `inductor/<isa>/`, the Q4_1 kernel in "
        "`extensions/torch-<version>/`. The worker and `orcapod model` also take "
        "`--cache-dir`, which moves the models and the graphs but not the kernel",
    ),
    Variable(
        "TORCHINDUCTOR_CACHE_DIR",
        "the worker (torch's inductor)",
        "where compiled decode graphs are kept; unset, the worker sets it to "
        "`<cache dir>/inductor/<isa>` (`avx2`, `avx512`, …: graphs of one vector ISA "
        "are not loaded under another)",
    ),
    Variable(
        "OMP_WAIT_POLICY, GOMP_SPINCOUNT",
        "the worker's engine process (libgomp)",
        "how the engine's OpenMP threads wait at a barrier; with neither set, the engine "
        "process runs with `GOMP_SPINCOUNT=30000` (a short spin, then sleep)",
    ),
    Variable(
        "ORCAPOD_LIFELINE_FD",
        "every actor",
        "set by `orcapod up` for each actor it starts: the read end of a pipe it holds, "
        "whose closing (the launcher gone, however it went) stops the actor. Not for users "
        "to set",
    ),
)


@dataclass(frozen=True)
class Flag:
    """One row of a command's table."""

    names: tuple[str, ...]  # a positional argument: its name
    default: str  # as the page shows it
    variable: str | None  # the environment variable that stands for it
    description: str


@dataclass(frozen=True)
class Section:
    """A command, or one of its subcommands, and its flags."""

    command: Command
    subcommand: str | None
    about: str
    flags: tuple[Flag, ...]
    has_subcommands: bool = False

    @property
    def name(self) -> str:
        """As typed: ``orcapod tenants add-key``."""
        return f"{self.command.name} {self.subcommand}" if self.subcommand else self.command.name

    @property
    def heading(self) -> str:
        if self.subcommand:
            return f"### `{self.name}`"
        also = f" (`{self.command.also}`)" if self.command.also else ""
        return f"## `{self.name}`{also}"


def standing_variable(action: argparse.Action) -> str | None:
    """The environment variable that stands for a flag: ``ORCAPOD_<DEST>``
    (``REDIS_URL`` for ``--redis-url``), when its help names it (``$NAME``)."""
    name = "REDIS_URL" if action.dest == "redis_url" else f"ORCAPOD_{action.dest.upper()}"
    return name if re.search(rf"\${name}\b", action.help or "") else None


def _default(action: argparse.Action) -> str:
    if action.required or not action.option_strings:
        return "required"
    if action.nargs == 0:  # a switch: store_true, or --x / --no-x
        return "on" if action.default else "off"
    if action.default is None or action.default == []:
        return NO_DEFAULT
    return f"`{action.default}`"


def _description(action: argparse.Action, command: str, prog: str) -> str:
    text = action.help
    if text is not None and "%" in text:
        text = text % {**vars(action), "prog": prog}
    if text is None:
        text = ""  # a test refuses a flag without help
    if action.choices:
        listed = ", ".join(f"`{choice}`" for choice in action.choices)
        text = f"{text} (one of {listed})" if text else f"one of {listed}"
    return text


def _flags(parser: argparse.ArgumentParser, command: str) -> tuple[Flag, ...]:
    # argparse has no public view of its actions.
    return tuple(
        Flag(
            names=tuple(action.option_strings) or (action.dest,),
            default=_default(action),
            variable=standing_variable(action),
            description=_description(action, command, parser.prog),
        )
        for action in parser._actions
        if action.default != argparse.SUPPRESS
        and not isinstance(action, argparse._SubParsersAction)
    )


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the parser's order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(name, helps[name], sub) for name, sub in action.choices.items()]
    return []


@contextmanager
def _unconfigured() -> Iterator[None]:
    """The environment without orcapod's variables while the parsers are built
    (their defaults read them), so the page shows the code's defaults."""
    removed = {
        name: os.environ.pop(name)
        for name in [n for n in os.environ if n.startswith("ORCAPOD_") or n == "REDIS_URL"]
    }
    try:
        yield
    finally:
        os.environ.update(removed)


def sections() -> list[Section]:
    """Every command's table, and each subcommand's, in the page's order."""
    found: list[Section] = []
    with _unconfigured():
        for command in COMMANDS:
            parser = command.build_parser()
            subcommands = _subcommands(parser)
            flags = _flags(parser, command.name)
            found.append(Section(command, None, command.about, flags, bool(subcommands)))
            for name, about, sub in subcommands:
                about = f"{about[:1].upper()}{about[1:]}." if about else ""
                found.append(Section(command, name, about, _flags(sub, command.name)))
    return found


def _cell(text: str) -> str:
    """``text`` inside a table cell: pipes escaped, and outside `code` what
    Markdown would take for an HTML tag or emphasis."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside backticks
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def _table(flags: Sequence[Flag]) -> list[str]:
    lines = ["| flag | default | environment | what it does |", "|---|---|---|---|"]
    for flag in flags:
        names = ", ".join(f"`{name}`" for name in flag.names)
        variable = f"`{flag.variable}`" if flag.variable else ""
        lines.append(f"| {names} | {flag.default} | {variable} | {_cell(flag.description)} |")
    return lines


INTRODUCTION = f"""\
# Configuration

Every flag of the commands that run the service and talk to it, the
environment variable that stands for it where one does, and the variables
that no flag stands for. Generated from the parsers themselves by
`{REGENERATE}`; `tests/test_configuration_docs.py`
fails when this page and the code disagree, so edit the code (a flag's
`help`, or `orcapod/config_docs.py`), not this page. The tools for
development and measurement (`orcapod generate`, `orcapod simulate`,
`orcapod bench`) list their flags with `--help`.

How to size the workers, what the first start does, what to alert on and what
to do when something fails: [operations.md](operations.md). What each limit
protects: [reliability.md](reliability.md). Keys, origins and host names:
[security.md](security.md). Metrics: [metrics.md](metrics.md).

## Precedence

A flag given on the command line wins; else its environment variable, when
set; else the default in the code, which the tables show (read with no
variable set). An empty variable counts as unset, and so do an empty
`--redis-url`, `--prefix`, `--model`, `--cache-dir`, `--tenants-file` or
`--api-key`, and `--log-retention-s 0`. A repeatable flag given at least once
replaces its variable's list (`--allowed-origin`, `--allowed-host`; the
variables are comma-separated). A variable for a switch is true when it is
`1`, `true`, `yes` or `on` (any case), false otherwise. Under `orcapod up`
every actor inherits its environment and gets flags of its own from
`--worker-arg`, `--scheduler-arg` and `--gateway-arg` (repeatable, e.g.
`--worker-arg=--kv-cache-fraction=0.05`).
"""


def _environment_only() -> list[str]:
    lines = [
        "## Environment variables that are no flag",
        "",
        "| variable | read by | what it does |",
        "|---|---|---|",
    ]
    for variable in ENVIRONMENT_ONLY:
        names = ", ".join(f"`{name.strip()}`" for name in variable.name.split(","))
        lines.append(f"| {names} | {variable.read_by} | {_cell(variable.meaning)} |")
    return lines


def _index(found: Sequence[Section]) -> list[str]:
    """Every variable on the page: the flag it stands for, in which commands."""
    flags: dict[str, dict[str, list[str]]] = {}
    for section in found:
        for flag in section.flags:
            if flag.variable is not None:
                commands = flags.setdefault(flag.variable, {}).setdefault(flag.names[0], [])
                commands.append(f"`{section.name}`")
    alone = {name.strip() for variable in ENVIRONMENT_ONLY for name in variable.name.split(",")}
    lines = ["## Every environment variable", "", "| variable | flag | in |", "|---|---|---|"]
    for name in sorted(flags.keys() | alone):
        for flag_name, commands in flags.get(name, {}).items():
            lines.append(f"| `{name}` | `{flag_name}` | {', '.join(commands)} |")
        if name in alone:
            lines.append(f"| `{name}` | {NO_DEFAULT} | *Environment variables that are no flag* |")
    return lines


def render() -> str:
    """The whole page."""
    found = sections()
    lines = [INTRODUCTION.rstrip("\n")]
    for section in found:
        lines += ["", section.heading, ""]
        lines.append(section.about)
        if section.flags:
            lines += ["", *_table(section.flags)]
        elif not section.has_subcommands:
            lines += ["", "No flags."]
    lines += ["", *_environment_only(), "", *_index(found)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the page, or with ``--write`` write ``docs/configuration.md``."""
    parser = argparse.ArgumentParser(prog="python -m orcapod.config_docs", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.name} in docs/")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
