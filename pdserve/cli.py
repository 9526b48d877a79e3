"""The ``pdserve`` command: one entry point, one subcommand per component.

Subcommand modules are imported only when chosen, so ``pdserve crds`` does not pay
for importing torch. Each module named in ``COMMANDS`` exposes
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("pdserve.engine.cli_serve", "serve an engine over gRPC"),
    "generate": ("pdserve.engine.cli_generate", "generate from a prompt (in-process or via a server)"),
    "coordinator": ("pdserve.coordinator.cli", "serve the OpenAI-compatible REST endpoint"),
    "crds": ("pdserve.api.crd_cli", "write the CRD YAML generated from pdserve.api"),
    "controller": ("pdserve.controller.cli", "run the Controller (registry, health, failover, view)"),
    "nodeagent": ("pdserve.nodeagent.cli", "supervise engines and heartbeat to the Controller"),
    "up": ("pdserve.local.up", "run a whole cluster locally as processes"),
    "operator": ("pdserve.operator.cli", "run the kopf operator"),
    "bench": ("pdserve.bench.cli", "measure goodput under SLO of a server, or compare two specs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / error for unknown commands
        parser.print_help()
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"pdserve {name}", description=COMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
