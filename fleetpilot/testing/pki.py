"""A throwaway certificate authority and every certificate the test control plane needs.

Made with the openssl CLI, which is on every machine image we use, so `cryptography` stays out
of the dependencies. One serving certificate covers every component (all listen on 127.0.0.1
only); client certificates carry the identities RBAC expects (system:masters for the admin,
system:kube-controller-manager, system:kube-scheduler); the aggregation layer gets its own CA,
as in kubeadm; and a key pair signs ServiceAccount tokens.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fleetpilot.testing.errors import ControlPlaneError

# The serving certificate's names are every name a client may use for the API server: loopback,
# and the in-cluster ones, 10.96.0.1 being the `kubernetes` Service's address in the control
# plane's service range.
_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
authorityKeyIdentifier = keyid
subjectAltName = IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1
"""


class Pki:
    """The CA, keys and certificates in `directory`: `create()` makes them all, `path()` names
    one. EC P-256 keys, because they are generated instantly."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.config = directory / "openssl.cnf"

    def path(self, name: str) -> Path:
        return self.dir / name

    def _openssl(self, *args: str) -> None:
        result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ControlPlaneError(f"openssl {args[0]} failed: {result.stderr.strip()}")

    def _key(self, name: str) -> Path:
        key = self.path(f"{name}.key")
        self._openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
        key.chmod(0o600)
        return key

    def create(self) -> None:
        """Make a fresh CA and every certificate and key, replacing any already there."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(_OPENSSL_CONFIG)
        self._ca("ca", "/CN=fleetpilot-test-ca")
        # One serving certificate for every component: all listen on 127.0.0.1 only.
        self._leaf("serving", "/CN=fleetpilot-test-serving", "server")
        self._leaf("admin", "/O=system:masters/CN=fleetpilot-admin", "client")
        self._leaf("controller-manager", "/CN=system:kube-controller-manager", "client")
        self._leaf("scheduler", "/CN=system:kube-scheduler", "client")
        # The aggregation layer's own CA, separate as in kubeadm: a certificate from it lets the
        # API server assert any identity to an aggregated API server (metrics, custom metrics).
        self._ca("front-proxy-ca", "/CN=fleetpilot-test-front-proxy-ca")
        self._leaf("front-proxy-client", "/CN=front-proxy-client", "client", ca="front-proxy-ca")
        sa_key = self._key("service-account")
        self._openssl("ec", "-in", str(sa_key), "-pubout", "-out", str(self.path("sa.pub")))

    def _ca(self, name: str, subject: str) -> None:
        key = self._key(name)
        self._openssl(
            "req", "-x509", "-new", "-key", str(key), "-sha256", "-days", "3650",
            "-subj", subject, "-config", str(self.config),
            "-extensions", "ca", "-out", str(self.path(f"{name}.crt")),
        )  # fmt: skip

    def _leaf(self, name: str, subject: str, kind: str, *, ca: str = "ca") -> None:
        key = self._key(name)
        csr = self.path(f"{name}.csr")
        self._openssl(
            "req", "-new", "-key", str(key), "-subj", subject, "-config", str(self.config),
            "-out", str(csr),
        )  # fmt: skip
        serial = str(int.from_bytes(os.urandom(8)))
        self._openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.path(f"{ca}.crt")),
            "-CAkey", str(self.path(f"{ca}.key")), "-set_serial", serial,
            "-days", "3650", "-sha256", "-extfile", str(self.config), "-extensions", kind,
            "-out", str(self.path(f"{name}.crt")),
        )  # fmt: skip
        csr.unlink()
