"""The stand-in's network: what CNI, CoreDNS and kube-proxy do on a real cluster.

- Addresses: loopback only. Pods get 127.10.x.y, Services 127.11.x.y (ClusterIPs,
  handed out by the emulator at create), the node 127.10.x.1; Linux routes all of
  127.0.0.0/8 to ``lo``, so nothing is configured and nothing is reachable from
  outside the machine. Each cluster starts at a random offset (two test runs on one
  machine do not share addresses); no address is reused within a cluster.
- Pod network identity: ``netshim.c`` (preloaded into every container) turns binds
  to 0.0.0.0/::/127.0.0.1 into binds to the Pod IP and connects to 127.0.0.1 into
  connects to the Pod IP: wildcard listeners of different Pods do not collide and
  each Pod has a localhost of its own, as with one network namespace per Pod.
- Names (``hosts_file``): every container's /etc/hosts, bind-mounted by podinit and
  rewritten in place when Services or endpoints change, lists each Service as
  ``name.ns.svc.cluster.local``, ``name.ns.svc``, ``name.ns`` and, in its own
  namespace, ``name``: a ClusterIP Service resolves to its ClusterIP (stable, with
  or without endpoints, as with CoreDNS), a headless one to each endpoint address,
  plus ``hostname.subdomain.ns.svc.cluster.local`` for Pods that set both. No DNS
  server runs; /etc/resolv.conf points at a closed port, so other names fail fast.
- Traffic (``ServiceProxy``): one listener per ClusterIP and port that forwards each
  connection to a ready address of the Service's Endpoints (round robin), to the
  endpoint port of the same name: kube-proxy in user space. No ready address: the
  connection is closed at once.
- The API server (``ApiEndpoint``): TLS on the node IP, relayed to the emulator's
  plain HTTP port; the ``kubernetes`` Service points at it, so Pods reach the API as
  in-cluster clients do (https://kubernetes.default.svc, the service-account CA).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLUSTER_DOMAIN = "cluster.local"
SHIM_PATH_IN_POD = "/.standin/netshim.so"


def addresses(second_octet: int) -> Iterator[str]:
    """127.<second_octet>.x.y from a random start: the Pod or Service address range."""
    for n in itertools.count(random.randrange(0, 200) << 8):
        if n & 255 not in (0, 1, 255):  # .1 of the first block is the node's
            yield f"127.{second_octet}.{(n >> 8) & 255}.{n & 255}"


def build_netshim(dest_dir: Path) -> Path:
    """Compile ``netshim.c``; raises RuntimeError without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the cluster stand-in needs a C compiler (cc) for its socket shim")
    out = dest_dir / "netshim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(HERE / "netshim.c"), "-ldl"],
                   check=True, capture_output=True)
    return out


def service_names(name: str, namespace: str, pod_namespace: str) -> list[str]:
    names = [f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    return names + [name] if namespace == pod_namespace else names


def _ready_addresses(endpoints: dict | None) -> list[dict]:
    return [a for subset in (endpoints or {}).get("subsets") or [] for a in subset.get("addresses") or []]


def hosts_file(pod: dict, services: list[dict], endpoints: dict[tuple[str, str], dict]) -> str:
    """/etc/hosts of a container of ``pod``; ``endpoints`` by (namespace, name)."""
    meta, spec = pod["metadata"], pod.get("spec") or {}
    namespace, hostname = meta["namespace"], spec.get("hostname") or meta["name"][:63]
    own = [hostname]
    if spec.get("subdomain"):
        own.insert(0, f"{hostname}.{spec['subdomain']}.{namespace}.svc.{CLUSTER_DOMAIN}")
    lines = ["# Kubernetes-managed hosts file (the cluster stand-in's).",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{(pod.get('status') or {}).get('podIP')}\t{' '.join(own)}"]
    for svc in sorted(services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
        names = " ".join(service_names(name, ns, namespace))
        cluster_ip = (svc.get("spec") or {}).get("clusterIP")
        if cluster_ip and cluster_ip != "None":
            lines.append(f"{cluster_ip}\t{names}")
            continue
        for address in _ready_addresses(endpoints.get((ns, name))):
            lines.append(f"{address['ip']}\t{names}")
            if address.get("hostname"):
                lines.append(f"{address['ip']}\t{address['hostname']}.{name}.{ns}.svc.{CLUSTER_DOMAIN} "
                             f"{address['hostname']}.{name}.{ns}.svc")
    return "\n".join(lines) + "\n"


def resolv_conf(namespace: str) -> str:
    return (f"search {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            "nameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n")


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 other: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()
        other.close()


async def splice(client: tuple[asyncio.StreamReader, asyncio.StreamWriter], host: str, port: int) -> None:
    """Forward one accepted connection to host:port until both sides are done."""
    client_r, client_w = client
    try:
        upstream_r, upstream_w = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except (OSError, TimeoutError):
        client_w.close()
        return
    try:
        await asyncio.gather(_relay(client_r, upstream_w, client_w), _relay(upstream_r, client_w, upstream_w))
    finally:
        for w in (client_w, upstream_w):
            w.close()


class ServiceProxy:
    """kube-proxy for the stand-in. ``sync`` is called by the endpoints controller on
    the cluster loop after each pass; connections are served on that loop."""

    def __init__(self) -> None:
        self._servers: dict[tuple[str, int], asyncio.Server] = {}
        self._backends: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self._turn = itertools.count()
        self._connections: set[asyncio.Task] = set()  # strong references: asyncio keeps weak ones

    async def sync(self, services: list[dict], endpoints: dict[tuple[str, str], dict]) -> None:
        backends: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for svc in services:
            spec, ns, name = svc.get("spec") or {}, svc["metadata"]["namespace"], svc["metadata"]["name"]
            if spec.get("clusterIP") in (None, "", "None"):
                continue
            subsets = (endpoints.get((ns, name)) or {}).get("subsets") or []
            for port in spec.get("ports") or []:
                backends[(spec["clusterIP"], port["port"])] = [
                    (a["ip"], p["port"]) for subset in subsets for p in subset.get("ports") or []
                    if p.get("name") == port.get("name") for a in subset.get("addresses") or []]
        self._backends = backends
        for key in set(self._servers) - set(backends):
            self._servers.pop(key).close()
        for key in set(backends) - set(self._servers):
            self._servers[key] = await asyncio.start_server(
                lambda r, w, key=key: self._serve(key, r, w), key[0], key[1], reuse_address=True)

    async def _serve(self, key: tuple[str, int], reader, writer) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            backends = self._backends.get(key) or []
            if not backends:
                writer.close()
                return
            await splice((reader, writer), *backends[next(self._turn) % len(backends)])
        finally:
            self._connections.discard(task)

    async def close(self) -> None:
        for task in list(self._connections):
            task.cancel()
        for server in self._servers.values():
            server.close()
        for server in self._servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)
        self._servers.clear()


def make_certificates(dest: Path, ips: list[str], names: list[str]) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``ips`` and ``names`` (openssl); returns
    (ca.crt, server.crt, server.key)."""
    ca_key, ca_crt, key, csr, crt = (dest / n for n in ("ca.key", "ca.crt", "server.key", "server.csr",
                                                        "server.crt"))
    ext = dest / "server.ext"
    ext.write_text("subjectAltName=" + ",".join([f"IP:{i}" for i in ips] + [f"DNS:{n}" for n in names])
                   + "\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for argv in (["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca_crt, "-days", "2",
                  "-subj", "/CN=standin-ca", "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                 ["openssl", "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=kube-apiserver"],
                 ["openssl", "x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
                  "-out", crt, "-days", "2", "-extfile", ext]):
        subprocess.run([str(a) for a in argv], check=True, capture_output=True)
    return ca_crt, crt, key


class ApiEndpoint:
    """TLS in front of the emulator: what Pods reach behind the ``kubernetes`` Service."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int], cert: Path, key: Path) -> None:
        self.host, self.port, self.upstream = host, port, upstream
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert, key)
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            lambda r, w: splice((r, w), *self.upstream), self.host, self.port, ssl=self._context,
            reuse_address=True)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
