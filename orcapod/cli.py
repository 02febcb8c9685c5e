"""``orcapod``: one command line over the actor packages.

Each subcommand lives in the package that owns it and is imported only when
it runs, so ``orcapod simulate`` never loads torch and the actors stay
independent of each other. A subcommand is a ``main(argv) -> int`` function.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module:function", one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "model": ("gpu_worker.model_prepare:main", "prepare the embedded SmolLM2 model"),
    "generate": ("orcapod.generate:main", "run prompts through the engine in this process"),
    "simulate": ("scheduler_actor.simulate:main", "simulate the policies on the Orca trace"),
    "up": ("orcapod.up:main", "start the whole service (redis, scheduler, workers, gateways)"),
    "chat": ("orcapod.chat:main", "chat with a running orcapod in the terminal"),
    "bench": ("orcapod.bench:main", "benchmark a running orcapod (compare: all policies)"),
    "gateway": ("gateway.__main__:main", "run one gateway (websocket, OpenAI API) on REDIS_URL"),
    "tenants": ("gateway.tenants_cli:main", "API keys of tenants: hash-key, add-key, list, revoke"),
    "scheduler": ("scheduler_actor.__main__:main", "run the scheduler against REDIS_URL"),
    "worker": ("gpu_worker.__main__:main", "run one GPU worker against REDIS_URL"),
}


def _usage() -> str:
    lines = ["usage: orcapod <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines.append("")
    lines.append("Run 'orcapod <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``orcapod <command> ...`` to the owning package's ``main``."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"orcapod: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name = SUBCOMMANDS[command][0].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return int(function(rest) or 0)
