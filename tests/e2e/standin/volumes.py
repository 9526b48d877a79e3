"""Pod volumes as host directories, for podinit to bind at their mount paths.

- ``configMap`` / ``secret``: projected as the kubelet does (files in a timestamped
  directory, a ``..data`` symlink swapped atomically, one symlink per top-level
  name), all keys or ``items`` (key, path, mode), ``defaultMode``, ``optional``;
  re-projected on every kubelet pass, so a changed ConfigMap reaches running Pods
  (not through ``subPath``, as on a real node). Always mounted read-only.
- ``emptyDir``: a directory of the Pod (``medium: Memory`` too), gone with the test.
- ``persistentVolumeClaim``: the claim's directory of the cluster
  (``<cluster>/volumes/<namespace>/<claim>``, ``Cluster.pvc_dir``), made on first use;
  the claim must exist, else the Pod waits (as for an unbound claim).
- ``hostPath``: the host path itself (never created: ``type`` is not applied).
- the service-account volume (added unless ``automountServiceAccountToken`` is
  false): ``token``, ``ca.crt`` (the stand-in API endpoint's CA) and ``namespace`` at
  /var/run/secrets/kubernetes.io/serviceaccount, as the admission plugin and the
  kubelet do together.

Any other kind (image, projected, downwardAPI, csi, ...) raises ``VolumeError``:
the Pod waits in ContainerCreating with that message. Called from the kubelet's
Pod worker on the cluster loop; file writes are small and synchronous.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path

from tests.e2e.standin.api import CONFIGMAPS, PVCS, SECRETS, Api

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_ACCOUNT_VOLUME = "kube-api-access"
SERVICE_ACCOUNT_TOKEN = "standin-token"
READ_ONLY_KINDS = ("configMap", "secret", SERVICE_ACCOUNT_VOLUME)


class VolumeError(Exception):
    """A volume cannot be set up (yet): the Pod waits and says why."""


def project(target: Path, files: dict[str, tuple[bytes, int]]) -> bool:
    """Write ``files`` (relative path -> (content, mode)) into ``target`` the way the
    kubelet's atomic writer does. Returns whether anything changed."""
    target.mkdir(parents=True, exist_ok=True)
    current = target / "..data"
    if current.exists() and _has_files(current, files):
        return False
    stamp = target / f"..{time.time_ns()}"
    stamp.mkdir()
    for rel, (data, mode) in files.items():
        path = stamp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
    link = target / "..data_tmp"
    link.symlink_to(stamp.name)
    os.replace(link, current)
    tops = {rel.split("/", 1)[0] for rel in files}
    for entry in target.iterdir():
        if entry.name.startswith(".."):
            if entry.is_dir() and not entry.is_symlink() and entry != stamp:
                shutil.rmtree(entry)
        elif entry.name not in tops:
            entry.unlink()
    for top in tops - {e.name for e in target.iterdir()}:
        (target / top).symlink_to(f"..data/{top}")
    return True


def _has_files(current: Path, files: dict[str, tuple[bytes, int]]) -> bool:
    found = {str(p.relative_to(current)) for p in current.rglob("*") if p.is_file()}
    return found == set(files) and all((current / rel).read_bytes() == data for rel, (data, _) in files.items())


def _keyed_files(source: dict, data: dict[str, bytes]) -> dict[str, tuple[bytes, int]]:
    default_mode = source.get("defaultMode", 0o644)
    if not source.get("items"):
        return {key: (value, default_mode) for key, value in data.items()}
    out = {}
    for item in source["items"]:
        if item["key"] not in data:
            raise VolumeError(f"key {item['key']!r} not found")
        out[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    return out


def config_map_data(obj: dict) -> dict[str, bytes]:
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    return data | {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}


def secret_data(obj: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


class Volumes:
    """The volumes of one Pod, under ``pod_dir/volumes``."""

    def __init__(self, api: Api, pod: dict, pod_dir: Path, pvc_root: Path, ca_path: Path) -> None:
        self.api, self.pod, self.ca_path = api, pod, ca_path
        self.dir, self.pvc_root = pod_dir / "volumes", pvc_root
        self.paths: dict[str, Path] = {}
        self.kinds: dict[str, str] = {}

    def specs(self) -> list[dict]:
        volumes = list((self.pod.get("spec") or {}).get("volumes") or [])
        if (self.pod.get("spec") or {}).get("automountServiceAccountToken", True):
            volumes.append({"name": SERVICE_ACCOUNT_VOLUME, SERVICE_ACCOUNT_VOLUME: {}})
        return volumes

    def prepare(self) -> None:
        """Set up (or refresh) every volume; raises VolumeError for one that cannot be."""
        namespace = self.pod["metadata"]["namespace"]
        for volume in self.specs():
            name = volume["name"]
            kind = next((k for k in volume if k != "name"), "")
            source = volume.get(kind) or {}
            path = self.dir / name
            if kind == "configMap":
                self._project(path, source, CONFIGMAPS, source.get("name"), config_map_data)
            elif kind == "secret":
                self._project(path, source, SECRETS, source.get("secretName"), secret_data)
            elif kind == "emptyDir":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "persistentVolumeClaim":
                claim = source.get("claimName")
                if self.api.get(PVCS, namespace, claim) is None:
                    raise VolumeError(f"persistentvolumeclaim {claim!r} not found")
                path = self.pvc_root / namespace / claim
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "hostPath":
                path = Path(source["path"])
            elif kind == SERVICE_ACCOUNT_VOLUME:
                project(path, {"token": (SERVICE_ACCOUNT_TOKEN.encode(), 0o644),
                               "ca.crt": (self.ca_path.read_bytes(), 0o644),
                               "namespace": (namespace.encode(), 0o644)})
            else:
                raise VolumeError(f"volume {name!r}: the stand-in does not support {kind!r} volumes")
            self.paths[name], self.kinds[name] = path, kind

    def _project(self, path: Path, source: dict, resource, obj_name: str, decode) -> None:
        obj = self.api.get(resource, self.pod["metadata"]["namespace"], obj_name)
        if obj is None:
            if source.get("optional"):
                project(path, {})
                return
            raise VolumeError(f"{resource.plural[:-1]} {obj_name!r} not found")
        project(path, _keyed_files(source, decode(obj)))

    def mounts(self, container: dict) -> list[dict]:
        """podinit mounts for ``container``'s volumeMounts (after ``prepare``)."""
        out = []
        mounts = list(container.get("volumeMounts") or [])
        if SERVICE_ACCOUNT_VOLUME in self.paths and not any(m["mountPath"] == SERVICE_ACCOUNT_DIR for m in mounts):
            mounts.append({"name": SERVICE_ACCOUNT_VOLUME, "mountPath": SERVICE_ACCOUNT_DIR})
        for mount in mounts:
            if mount["name"] not in self.paths:
                raise VolumeError(f"volumeMount {mount['name']!r}: no such volume")
            source = self.paths[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)
            out.append({"source": str(source), "target": mount["mountPath"],
                        "readonly": bool(mount.get("readOnly")) or self.kinds[mount["name"]] in READ_ONLY_KINDS})
        return out
