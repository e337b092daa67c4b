"""A real S3-compatible server on loopback for the object-store tests: moto's ``ThreadedMotoServer`` behind TLS, which
answers the S3 API as AWS does (no client is mocked: s3fs, boto3, litdata's obstore and the ranks' processes speak
HTTPS to it).

TLS because litdata's obstore client speaks HTTPS only: the server's certificate is issued for 127.0.0.1 by a CA made
here, which the clients trust through ``AWS_CA_BUNDLE`` (botocore, s3fs) and ``SSL_CERT_FILE`` (obstore's rustls).
``s3`` (a module-scoped fixture) starts one server; ``bucket`` (per test) points this process's environment, and so
the ranks and commands it starts, at it, and gives a fresh bucket's URL.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from installed import require

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """(a CA's certificate, a server certificate it issued for 127.0.0.1, the server's key), as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def certificate(subject: str, key, issuer: x509.Name, signer, *, authority: bool) -> x509.Certificate:
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True))
        if not authority:
            builder = (builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(
                "127.0.0.1"))]), critical=False)
                       .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        return builder.sign(signer, hashes.SHA256())

    authority_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    authority = certificate("lightning-par test CA", authority_key, name("lightning-par test CA"), authority_key,
                            authority=True)
    server = certificate("127.0.0.1", server_key, authority.subject, authority_key, authority=False)
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(authority.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return paths


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment that points a client at an S3 server running in this process: its endpoint, the CA that
    issued its certificate, credentials."""
    moto_server = require("moto.server")  # the test extra's: missing, the test fails
    from werkzeug.serving import make_server

    authority, certificate, key = _certificates(tmp_path_factory.mktemp("s3-tls"))

    class TLSMotoServer(moto_server.ThreadedMotoServer):
        def _server_entry(self) -> None:  # ThreadedMotoServer's, with a TLS context
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certificate, key)
            application = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)
            self._server = make_server(self._ip_address, self._port, application, True,
                                       request_handler=moto_server.MotoRequestHandler, ssl_context=context)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = TLSMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {**CREDENTIALS, "AWS_ENDPOINT_URL": f"https://{host}:{port}", "AWS_CA_BUNDLE": str(authority),
           "SSL_CERT_FILE": str(authority)}
    server.stop()


@pytest.fixture
def bucket(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<a new bucket>``, with this process's environment (inherited by what it starts) pointing at the
    server."""
    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    return create_bucket(f"run-{uuid.uuid4().hex[:12]}")


def create_bucket(name: str) -> str:
    """Create the bucket ``name`` on the server the environment points at; its URL."""
    import boto3

    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


def objects(url: str) -> list[str]:
    """The keys under ``url`` (``s3://bucket/prefix``), relative to it, sorted."""
    import boto3

    name, _, prefix = url.removeprefix("s3://").partition("/")
    prefix = f"{prefix}/" if prefix else ""
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=prefix)
    return sorted(entry["Key"][len(prefix):] for page in pages for entry in page.get("Contents", []))
