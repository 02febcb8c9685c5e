"""``orcapod bench``: benchmarks of the live service over its public protocol.

- ``orcapod bench [--url ...] [--trace ...] [--rates ...]``: an open-loop
  rate sweep against a running orcapod (``orcapod.bench.run``);
- ``orcapod bench compare``: start the service under each policy and draw
  Orca's Fig. 10 (``orcapod.bench.compare``);
- ``orcapod bench capacity``: sockets and token fan-out of one gateway
  (``orcapod.bench.capacity``).
"""

from __future__ import annotations

import importlib

_SUBCOMMANDS = {"compare": "orcapod.bench.compare", "capacity": "orcapod.bench.capacity"}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``orcapod bench [compare|capacity] ...``."""
    args = list(argv or [])
    module_name = "orcapod.bench.run"
    if args and args[0] in _SUBCOMMANDS:
        module_name = _SUBCOMMANDS[args.pop(0)]
    return int(importlib.import_module(module_name).main(args))
