"""The ``pdserve`` command: one entry point, one subcommand per component.

Subcommand modules are imported only when chosen, so ``pdserve crds`` does not pay
for importing torch. Each module named in ``COMMANDS`` exposes
``add_arguments(parser)`` and ``run(args) -> int``.

``pip install pdserve`` is the control plane. A command of an extra that is not
installed (``NEEDS_EXTRA``: ``pdserve engine`` without torch), or one that imports a
module of a missing extra while it runs (``pdserve.runtime.extras``), exits 1 with
one line naming the ``pip install 'pdserve[...]'`` that brings it.

Global options come before the subcommand: ``--version``, and ``--debug``
(also accepted after it). A spec pdserve cannot use (``ManifestError``) is printed
as ``error: ...`` naming each bad field, exit status 2; Ctrl-C during start-up exits
quietly (130); ``--debug`` shows the traceback of either instead. Every
subcommand's ``--help`` shows the defaults.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve import __version__
from pdserve.runtime import extras

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("pdserve.engine.cli_serve", "serve an engine over gRPC"),
    "generate": ("pdserve.engine.cli_generate", "generate from a prompt (in-process or via a server)"),
    "coordinator": ("pdserve.coordinator.cli", "serve the OpenAI-compatible REST endpoint"),
    "crds": ("pdserve.api.crd_cli", "write the CRD YAML generated from pdserve.api"),
    "controller": ("pdserve.controller.cli", "run the Controller (registry, health, failover, view)"),
    "nodeagent": ("pdserve.nodeagent.cli", "supervise engines and heartbeat to the Controller"),
    "up": ("pdserve.local.up", "run a whole cluster locally as processes"),
    "doctor": ("pdserve.local.doctor", "check a cluster (or a spec) before sending traffic"),
    "operator": ("pdserve.operator.cli", "run the kopf operator"),
    "kv-pool": ("pdserve.runtime.kv_pool_master", "run the master of a cluster's shared KV pool"),
    "bench": ("pdserve.bench.cli", "measure goodput under SLO of a server, or compare two specs"),
}
# name -> the extra it cannot even show its help without
NEEDS_EXTRA: dict[str, str] = {"engine": "engine", "generate": "engine"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` after every option that takes a value and has a help
    text and a default worth reading (not None, not an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if action.nargs == 0 or default is None or default == [] or default == argparse.SUPPRESS \
                or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0],
                                     usage="pdserve [--debug] [--version] COMMAND ...")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    at = next((i for i, arg in enumerate(argv) if arg in COMMANDS), len(argv))
    if at == len(argv) or any(not arg.startswith("-") for arg in argv[:at]):
        parser.parse_args(argv)  # --version, --help, usage errors for unknown commands
        parser.print_help()
        return 2
    is_debug = parser.parse_args(argv[:at]).debug
    name = argv[at]
    is_simulated = "--simulate" in argv[at + 1:]  # a simulated engine runs without torch
    if name == "engine" and from_command_line and not is_simulated:
        from pdserve.runtime.huge_pages import reexec_with_huge_pages

        reexec_with_huge_pages()  # weights on 2 MiB pages; returns only if nothing to add
    if (extra := NEEDS_EXTRA.get(name)) and not is_simulated and extras.missing_modules(extra):
        print(f"error: {extras.explain(f'pdserve {name}', extra)}", file=sys.stderr)
        return 1
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as exc:
        if is_debug or (extra := extras.extra_of(exc.name)) is None:
            raise
        print(f"error: {extras.explain(f'pdserve {name}', extra, exc.name)}", file=sys.stderr)
        return 1
    sub_parser = argparse.ArgumentParser(prog=f"pdserve {name}", description=COMMANDS[name][1],
                                         formatter_class=HelpFormatter)
    module.add_arguments(sub_parser)
    sub_parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    args = sub_parser.parse_args(argv[at + 1:])
    return run_command(module, args, is_debug or args.debug, name)


def run_command(module, args: argparse.Namespace, is_debug: bool, name: str = "") -> int:
    """``module.run(args)``; a bad spec becomes one message, a module of an extra that is
    not installed one line naming the extra (exit 1), and Ctrl-C before a component
    took over its signals a quiet exit (130); ``--debug`` shows their tracebacks."""
    from pdserve.api.manifest import ManifestError

    try:
        return int(module.run(args) or 0)
    except ManifestError as exc:
        if is_debug:
            raise
        print(f"error: {exc.explain()}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if is_debug or (extra := extras.extra_of(exc.name)) is None:
            raise
        print(f"error: {extras.explain(f'pdserve {name}'.strip(), extra, exc.name)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if is_debug:
            raise
        return 130


if __name__ == "__main__":
    sys.exit(main())
