"""pdserve's optional parts (pip extras) and how to say that one is missing.

``pip install pdserve`` is the control plane: the operator, Controller, NodeAgent,
Coordinator, bench and doctor, without torch. Each extra of ``pyproject.toml`` adds
one part: ``engine`` the embedded PyTorch engine (``pdserve engine``, ``pdserve
generate``, and so the engines that ``pdserve up`` and a NodeAgent launch),
``mooncake`` and ``nixl`` those KV transports (and ``mooncake`` the shared KV pool),
``plots`` the figures of ``pdserve bench --plot``.

Invariant: ``EXTRAS`` names, per extra of ``pyproject.toml`` (``all`` aside), the
top-level modules its packages bring; a unit test keeps the two in step. A command
that needs an extra checks it with ``missing_modules`` before it starts, or its
``ModuleNotFoundError`` is turned into ``explain`` by ``pdserve.cli``: either way the
user reads which extra to install, never a traceback.
"""

from __future__ import annotations

import importlib.util

EXTRAS: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "safetensors"),
    "mooncake": ("mooncake",),
    "nixl": ("nixl_cu12",),
    "plots": ("matplotlib",),
}


def install_command(extra: str) -> str:
    return f"pip install 'pdserve[{extra}]'"


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that this environment cannot import."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def extra_of(module: str | None) -> str | None:
    """The extra that brings ``module`` (a dotted name), or None for one of no extra."""
    root = (module or "").partition(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if root in modules), None)


def explain(what: str, extra: str, module: str | None = None) -> str:
    """One line for the user: ``what`` (a command, a flag) lacks ``extra`` (``module``,
    or the modules of it that are missing), and the command that installs it."""
    missing = module or ", ".join(missing_modules(extra)) or EXTRAS[extra][0]
    return (f"{what}: the {extra} extra is not installed (no module {missing}); "
            f"install it with {install_command(extra)}")


def needed_by(cluster) -> list[str]:
    """The extras a host needs to run ``cluster``'s engines (a ``PDCluster``: what
    ``pdserve up`` starts): the engine, the KV transport of its PD pools, and Mooncake
    for its shared KV pool; none for vLLM engines, and no engine for simulated ones."""
    spec = cluster.spec
    if spec.engine.backend == "vllm":  # vLLM's own environment brings its engine and connector
        return []
    needed = [] if spec.engine.simulate is not None else ["engine"]  # simulated: no torch
    if (spec.prefill.replicas or spec.decode.replicas) and spec.kv_transfer.transport in EXTRAS:
        needed.append(spec.kv_transfer.transport)
    if spec.kv_pool.enabled and "mooncake" not in needed:
        needed.append("mooncake")
    return needed
