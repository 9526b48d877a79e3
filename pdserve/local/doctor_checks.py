"""The checks ``pdserve doctor`` runs on this host, without a running cluster: the
model source, the tokenizer and chat template, transports, TLS files, etcd.

Each check returns ``Check`` rows (pass / warn / fail, what was found, how to fix
it: ``pdserve.runtime.doctor_checks.Check``); none raises. Called by ``doctor.py``
only; the cluster-level checks, which need no local file, are in
``pdserve.runtime.doctor_checks``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib.util
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from pdserve.api import PDCluster
from pdserve.runtime.chat_template import HOW_TO_ADD, find_chat_template
from pdserve.runtime.doctor_checks import FAIL, PASS, WARN, Check
from pdserve.runtime.extras import install_command, missing_modules, needed_by
from pdserve.runtime.model_source import ModelSourceError, auto_dtype, is_random_preset, resolve
from pdserve.runtime.model_source import check as check_model_source
from pdserve.runtime.security import SecuritySettings
from pdserve.runtime.tokenizer import load_tokenizer

TLS_EXPIRY_WARN_DAYS = 14  # a certificate expiring sooner is a warning
RDMA_DIR = Path("/sys/class/infiniband")


def check_extras(cluster: PDCluster) -> list[Check]:
    """This host has the extras that running the spec's engines here (``pdserve up``)
    takes; a warning when not, as the spec may be meant for Kubernetes' engine image."""
    rows = []
    for extra in needed_by(cluster):
        missing = missing_modules(extra)
        rows.append(Check(f"{extra} extra", WARN if missing else PASS,
                          f"not installed (no module {', '.join(missing)}): pdserve up cannot "
                          f"run this spec's engines here" if missing else "installed",
                          install_command(extra) if missing else ""))
    return rows


def check_model(cluster: PDCluster) -> list[Check]:
    """The spec's model source loads from here (``model_source.check``: metadata only)."""
    model = cluster.spec.model
    if model.preset and is_random_preset(model.preset):
        return [Check("model source", PASS, f"built-in preset {model.preset!r} (random weights)")]
    if not model.path and not model.preset:
        source = "a PVC" if model.pvc else f"image {model.image}"
        return [Check("model source", WARN, f"the model comes from {source}; not checked from this host",
                      "run doctor where the checkpoint is mounted, or with --url/--controller")]
    location = model.preset or model.path
    try:
        resolved = check_model_source(location, install=False)
    except ModelSourceError as exc:
        return [Check("model source", FAIL, str(exc),
                      "point spec.model.path at a checkpoint directory holding config.json or at "
                      "a .gguf file, or name a preset")]
    what = f"preset {location!r} ({resolved})" if model.preset else f"checkpoint {location}"
    dtype = cluster.spec.engine.dtype
    if dtype == "auto":
        resolved_dtype, why = auto_dtype(location)
        dtype = f"{resolved_dtype} (auto: {why})"
    return [Check("model source", PASS, f"{what}, served in {dtype}")]


def check_tokenizer(cluster: PDCluster) -> list[Check]:
    """The tokenizer and chat template load here, as the Coordinator loads them
    (``runtime.chat_template``: the same sources in the same order)."""
    model = cluster.spec.model
    if model.preset and is_random_preset(model.preset):
        return [Check("tokenizer + chat template", PASS,
                      "random-weight preset: byte tokenizer and the built-in chat template")]
    try:
        path = Path(resolve(model.preset or model.path or "", install=False))
    except ModelSourceError as exc:
        return [Check("tokenizer + chat template", WARN, str(exc), "fix the model source first")]
    if not (model.path or model.preset) or not path.exists():
        return [Check("tokenizer + chat template", WARN, "no local checkpoint to load them from",
                      "fix the model source first")]
    try:
        tokenizer = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return [Check("tokenizer + chat template", FAIL, f"the tokenizer does not load: {exc}",
                      "replace the checkpoint's tokenizer.json")]
    if tokenizer is None:
        return [Check("tokenizer + chat template", WARN,
                      f"{path} has no tokenizer.json: only token-id prompts can be served",
                      "add the model's tokenizer.json to the checkpoint")]
    found = find_chat_template(path)
    if found.template is None:
        return [Check("tokenizer + chat template", WARN,
                      f"tokenizer loads; no chat template ({found.source}): chat requests are refused",
                      HOW_TO_ADD)]
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(found.template)
    except Exception as exc:  # noqa: BLE001
        return [Check("tokenizer + chat template", FAIL, f"the chat template does not compile: {exc}",
                      f"fix the chat template in {found.source}")]
    return [Check("tokenizer + chat template", PASS, f"tokenizer loads; chat template from {found.source}")]


def check_transport(cluster: PDCluster, require_rdma: bool) -> list[Check]:
    """The spec's KV transport can run on this host (where ``pdserve up`` runs engines)."""
    transport = cluster.spec.kv_transfer.transport
    if transport == "tcp":
        return [Check("kv transport", PASS, "tcp: built in")]
    if transport == "shm":
        ok = os.access("/dev/shm", os.W_OK)
        return [Check("kv transport", PASS if ok else FAIL,
                      "shm: /dev/shm is writable" if ok else "shm: /dev/shm is not writable",
                      "" if ok else "mount a writable /dev/shm, or use transport tcp")]
    if transport == "nixl":
        ok = importlib.util.find_spec("nixl_cu12") is not None
        return [Check("kv transport", PASS if ok else FAIL,
                      "nixl: importable" if ok else "nixl: the nixl-cu12 package is not importable here",
                      "" if ok else f"{install_command('nixl')}, or use transport tcp")]
    rows = []
    if importlib.util.find_spec("mooncake") is None:
        rows.append(Check("kv transport", FAIL, "mooncake: the mooncake package is not importable here",
                          f"{install_command('mooncake')}, or use transport tcp"))
    else:
        rows.append(Check("kv transport", PASS, "mooncake: importable"))
    devices = sorted(p.name for p in RDMA_DIR.iterdir()) if RDMA_DIR.is_dir() else []
    if devices:
        rows.append(Check("rdma devices", PASS, ", ".join(devices)))
    else:
        rows.append(Check("rdma devices", FAIL if require_rdma else WARN,
                          f"no RDMA devices in {RDMA_DIR}: Mooncake runs its TCP protocol",
                          "run on nodes with RDMA NICs (and their device plugin) for RDMA"))
    return rows


def check_tls(security: SecuritySettings, now: dt.datetime | None = None) -> list[Check]:
    """The configured TLS files parse, the certificate is valid and not near expiry."""
    if not security.uses_tls:
        return [Check("tls", PASS, "not configured (cluster token only)")]
    now = now or dt.datetime.now(dt.UTC)
    rows = []
    for label, path in (("tls certificate", security.tls_cert), ("tls ca", security.tls_ca)):
        ends, error = _cert_end(path)
        if error:
            rows.append(Check(label, FAIL, f"{path}: {error}", "install a valid PEM certificate"))
        elif ends < now:
            rows.append(Check(label, FAIL, f"{path} expired on {ends:%Y-%m-%d}", "renew the certificate"))
        elif ends - now < dt.timedelta(days=TLS_EXPIRY_WARN_DAYS):
            rows.append(Check(label, WARN, f"{path} expires on {ends:%Y-%m-%d}", "renew it soon"))
        else:
            rows.append(Check(label, PASS, f"{path} valid until {ends:%Y-%m-%d}"))
    if not Path(security.tls_key or "").is_file():
        rows.append(Check("tls key", FAIL, f"{security.tls_key} is not readable", "mount the key"))
    return rows


def _cert_end(path: str | None) -> tuple[dt.datetime, str]:
    """(notAfter, "") or (_, why it cannot be read), with the openssl CLI."""
    epoch = dt.datetime.fromtimestamp(0, dt.UTC)
    if shutil.which("openssl") is None:
        return epoch, "the openssl CLI is not installed; cannot check"
    out = subprocess.run(["openssl", "x509", "-noout", "-enddate", "-in", str(path)],
                         capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        return epoch, (out.stderr.strip().splitlines() or ["not a PEM certificate"])[0]
    stamp = out.stdout.strip().split("=", 1)[1]
    return dt.datetime.strptime(stamp, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=dt.UTC), ""


def check_etcd(endpoint: str | None, timeout_s: float = 5.0) -> list[Check]:
    """etcd at ``endpoint`` (host:port) answers and takes a write (a scratch key, deleted)."""
    if not endpoint:
        return []
    try:
        return [asyncio.run(asyncio.wait_for(_etcd_round_trip(endpoint), timeout_s))]
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, timed out: the finding
        reason = str(exc) or type(exc).__name__
        return [Check("etcd", FAIL, f"{endpoint}: {reason}",
                      "start etcd, or fix --etcd (and its TLS flags on the Controller)")]


async def _etcd_round_trip(endpoint: str) -> Check:
    import aetcd

    host, _, port = endpoint.removeprefix("etcd://").rpartition(":")
    key = f"/pdserve/doctor/{uuid.uuid4().hex}".encode()
    async with aetcd.Client(host=host or "127.0.0.1", port=int(port or 2379)) as client:
        await client.put(key, b"ok")
        got = await client.get(key)
        await client.delete(key)
    if got is None or got.value != b"ok":
        return Check("etcd", FAIL, f"{endpoint}: a written key did not read back", "check etcd's health")
    return Check("etcd", PASS, f"{endpoint}: reachable and writable")
