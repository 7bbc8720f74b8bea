"""The endpoint picker's TLS identity: a key and a self-signed certificate made at start, as
the extension's own picker makes one (``--secure-serving``, its default). Gateways connect to
an InferencePool's picker over TLS without verifying the certificate (the InferencePool names
no CA), so what TLS buys here is encryption of the prompts on the wire, not the picker's
identity; a mesh's mTLS gives both."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# The certificate's subject and DNS name; nothing checks it (module docstring).
COMMON_NAME = "fleetpilot-endpoint-picker"
# Longer than any router pod lives; a new one is made at every start.
VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Identity:
    key_pem: bytes
    certificate_pem: bytes


def self_signed(now: datetime.datetime | None = None) -> Identity:
    """A fresh P-256 key and a certificate for it, signed by itself, valid from a minute ago
    (a gateway's clock a little behind) for ``VALIDITY``."""
    now = now or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME)])
    names = x509.SubjectAlternativeName(
        [
            x509.DNSName(COMMON_NAME),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
    )
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + VALIDITY)
        .add_extension(names, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Identity(
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
    )
