"""The local broker's secured mode (tests, and trying a secured set-up on one machine): the client listener
takes SASL/SCRAM-SHA-512 logins, optionally over TLS with a certificate authority generated for it.

Production clusters are secured by their operators (Strimzi: ``ops/k8s/kafka-user.yaml``); every role reaches
one through ``kafka.security_protocol`` / ``sasl_*`` / ``ssl_cafile`` with the password read from the
environment variable ``kafka.sasl_password_env`` names, so no secret is in a config file, a resolved config in
a run directory, a log line or ``/metrics``. This mode is the same wiring against a broker on loopback. Its own
files are test material: the SCRAM users are created when the storage is formatted, and the broker's own login
(the first user) and the generated server key sit in the data dir.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True)
class BrokerSecurity:
    """SCRAM users (name -> password; the first is the broker's own inter-broker login) and, with ``tls_dir``,
    TLS on the same listener (``ca.pem``, ``server.pem`` generated there on first use)."""

    users: dict[str, str] = field(default_factory=dict)
    tls_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.users:
            raise ValueError("BrokerSecurity: at least one SCRAM user (the broker's own login)")
        for name, password in self.users.items():
            if not name.isidentifier() or any(c in password for c in '",=[] \\'):
                raise ValueError(f"BrokerSecurity: user {name!r}: use an identifier and a password without "
                                 "quotes, commas, '=', brackets, spaces or backslashes (they go into JAAS text)")

    @property
    def protocol(self) -> str:
        return "SASL_SSL" if self.tls_dir else "SASL_PLAINTEXT"

    @property
    def ca_file(self) -> Path | None:
        return self.tls_dir / "ca.pem" if self.tls_dir else None

    def server_props(self, port: int, controller_port: int) -> dict[str, str]:
        """The server.properties entries that replace the plaintext client listener."""
        name = self.protocol
        user, password = next(iter(self.users.items()))
        props = {
            "listeners": f"{name}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"{name}://127.0.0.1:{port}",
            "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{name}:{name}",
            "inter.broker.listener.name": name,
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            f"listener.name.{name.lower()}.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required "
                f'username="{user}" password="{password}";',
        }
        if self.tls_dir:
            self.ensure_tls()
            props |= {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(self.tls_dir / "server.pem"),
                      "ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.ca_file)}
        return props

    def format_args(self) -> list[str]:
        """``kafka-storage format`` arguments that create the SCRAM users (KRaft keeps them in its metadata)."""
        return [arg for name, pw in self.users.items() for arg in ("--add-scram", f"{MECHANISM}=[name={name},"
                                                                                  f"password={pw}]")]

    def client_settings(self, user: str | None = None) -> dict[str, Any]:
        """kafka-python settings of a client logging in as ``user`` (default: the broker's own)."""
        name = user or next(iter(self.users))
        settings: dict[str, Any] = {"security_protocol": self.protocol, "sasl_mechanism": MECHANISM,
                                    "sasl_plain_username": name, "sasl_plain_password": self.users[name]}
        if self.ca_file:
            settings["ssl_cafile"] = str(self.ca_file)
            settings["ssl_check_hostname"] = True
        return settings

    def ensure_tls(self) -> None:
        """A CA and a server certificate for 127.0.0.1 / localhost (10 years), unless already there."""
        assert self.tls_dir is not None
        if (self.tls_dir / "server.pem").exists() and (self.tls_dir / "ca.pem").exists():
            return
        self.tls_dir.mkdir(parents=True, exist_ok=True)
        ca_key, ca_cert, key, cert = _test_ca_and_server()
        (self.tls_dir / "ca.pem").write_bytes(ca_cert)
        (self.tls_dir / "ca.key").write_bytes(ca_key)
        server = self.tls_dir / "server.pem"
        server.write_bytes(key + cert)  # Kafka's PEM key store: the private key (PKCS#8) then the chain
        server.chmod(0o600)


def _test_ca_and_server() -> tuple[bytes, bytes, bytes, bytes]:
    """(CA key, CA cert, server key, server cert) in PEM; the server cert names 127.0.0.1 and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: x509.Name | None, signer: Any, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=3650))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("grpo-stream test CA", ca_key, None, ca_key, ca=True)
    server = cert("127.0.0.1", key, ca.subject, ca_key, ca=False)

    def pem_key(k: Any) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    pem = serialization.Encoding.PEM
    return pem_key(ca_key), ca.public_bytes(pem), pem_key(key), server.public_bytes(pem)
