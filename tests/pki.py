"""A throwaway PKI for tests, made with the ``openssl`` CLI: a CA, and certificates it
signs for 127.0.0.1/localhost, each usable by a server and a client."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve.runtime.security import SecuritySettings

EXTENSIONS = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"


def openssl(cwd: Path, *args: str) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make test certificates")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(cwd: Path, name: str) -> None:
    """A CA certificate as strict verifiers want it (Python 3.13's default
    ``VERIFY_X509_STRICT`` refuses a CA without key usage)."""
    openssl(cwd, "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def issue(cwd: Path, name: str, ca: str) -> SecuritySettings:
    """A key and a certificate for ``name`` signed by ``ca`` (server and client use)."""
    openssl(cwd, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (cwd / "ext.cnf").write_text(EXTENSIONS)
    openssl(cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", "ext.cnf")
    return SecuritySettings(tls_cert=str(cwd / f"{name}.crt"), tls_key=str(cwd / f"{name}.key"),
                            tls_ca=str(cwd / f"{ca}.crt"))


def make_pki(cwd: Path, certificates: dict[str, str]) -> dict[str, SecuritySettings]:
    """A CA for each value of ``certificates`` (name -> its CA) and each name's
    certificate signed by it."""
    for ca in sorted(set(certificates.values())):
        make_ca(cwd, ca)
    return {name: issue(cwd, name, ca) for name, ca in certificates.items()}
