"""The real ``helm`` on charts/pdserve: ``template``, ``lint``, and a client-side dry-run
install for NOTES.txt, each with a values dict given on stdin (``-f -``).

Owns the command lines and the parsing of what helm prints. Every call pins the
Kubernetes version (``--kube-version``; ``install`` has no such flag), runs with throwaway ``HELM_*`` homes and a
kubeconfig that does not exist, so no user configuration leaks in and nothing ever
talks to a cluster. Renders are cached per (values, release, namespace): helm is
deterministic for this chart (no ``lookup``, no random values).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "pdserve"
KUBE_VERSION = "1.33.0"
RELEASE, NAMESPACE = "r", "pdserve-system"
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster on dashboards


class HelmError(Exception):
    """helm exited non-zero; ``output`` is what it printed (stdout and stderr)."""

    def __init__(self, args: list[str], output: str) -> None:
        super().__init__(f"helm {' '.join(args)} failed:\n{output}")
        self.output = output


@dataclass(frozen=True)
class Rendered:
    """The objects of one ``helm template``, in helm's order, and the chart file
    (``templates/operator.yaml``, ``crds/...``) each came from."""

    objects: list[dict]
    sources: list[str]

    @classmethod
    def parse(cls, out: str) -> Rendered:
        objects, sources = [], []
        for chunk in re.split(r"^---$", out, flags=re.MULTILINE):
            obj = yaml.load(chunk, Loader=SafeLoader)
            if obj:
                objects.append(obj)
                sources.append(re.search(r"^# Source: [^/]+/(\S+)$", chunk, re.MULTILINE)[1])
        return cls(objects, sources)

    def from_source(self, source: str) -> list[dict]:
        return [o for o, s in zip(self.objects, self.sources, strict=True) if s == source]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        [obj] = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        return obj

    @property
    def names(self) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in self.objects}


class Helm:
    """One per test session (fixture ``helm``); ``home`` is a private temp dir."""

    def __init__(self, binary: Path, home: Path, chart: Path = CHART) -> None:
        self.binary, self.chart = binary, chart
        self.env = {"HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": str(home / "no-kubeconfig"),
                    "PATH": "/usr/bin:/bin"}
        self._renders: dict[str, Rendered] = {}

    def run(self, *args: str, values: dict | None = None) -> str:
        """``helm ARGS -f -`` with ``values`` as YAML on stdin; raises HelmError."""
        argv = [*args, "-f", "-"]
        done = subprocess.run([str(self.binary), *argv], input=yaml.safe_dump(values or {}),
                              capture_output=True, text=True, env=self.env, timeout=60)
        if done.returncode != 0:
            raise HelmError(argv, done.stdout + done.stderr)
        return done.stdout

    def template(self, values: dict | None = None, *, release: str = RELEASE,
                 namespace: str = NAMESPACE) -> Rendered:
        """Every object the chart installs, CRDs included."""
        key = json.dumps([values, release, namespace], sort_keys=True)
        if key not in self._renders:
            out = self.run("template", release, str(self.chart), "--namespace", namespace,
                           "--include-crds", "--kube-version", KUBE_VERSION, values=values)
            self._renders[key] = Rendered.parse(out)
        return self._renders[key]

    def lint(self, values: dict | None = None) -> str:
        return self.run("lint", "--strict", str(self.chart), "--kube-version", KUBE_VERSION,
                        values=values)

    def notes(self, values: dict | None = None, *, release: str = RELEASE,
              namespace: str = NAMESPACE) -> str:
        """NOTES.txt as ``helm install`` prints it (``helm template`` does not render it)."""
        out = self.run("install", release, str(self.chart), "--namespace", namespace,
                       "--dry-run=client", "-o", "json", values=values)
        return json.loads(out)["info"]["notes"]
