"""TLS: a self-signed certificate made in the test (openssl CLI or `cryptography`)."""

import shutil
import subprocess

import pytest

from satjax.queue.client import NO_RETRY, QueueClient, QueueUnavailableError
from satjax.queue.server import QueueServer


def self_signed(tmp_path):
    """(cert, key) PEM paths for CN=localhost, SAN localhost + 127.0.0.1."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1",
                        "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
        return cert, key
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID
    except ImportError:
        pytest.skip("TLS test needs the openssl CLI or the cryptography package; neither found")
    pk = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
         .public_key(pk.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=1))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName(
             [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
             critical=False)
         .sign(pk, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pk.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption()))
    return cert, key


def test_tls_round_trip_and_plaintext_refused(tmp_path, token, make_traj):
    cert, key = self_signed(tmp_path)
    server = QueueServer(tmp_path / "q", token, tls_cert=cert, tls_key=key)
    port = server.start(0)
    try:
        with QueueClient(f"127.0.0.1:{port}", token=token, tls_ca=cert) as c:
            c.wait_ready(10)
            assert c.put([make_traj("secure", "g")]).ok
            batch = c.get_batch(1, 0)
            assert [t.trajectory_id for t in batch.trajectories] == ["secure"]
        with QueueClient(f"127.0.0.1:{port}", token=token, retry=NO_RETRY) as plain:
            with pytest.raises(QueueUnavailableError):
                plain.stats()
    finally:
        server.stop(None)


def test_tls_needs_cert_and_key(tmp_path, token):
    with pytest.raises(ValueError, match="tls_cert/tls_key"):
        QueueServer(tmp_path, token, tls_cert=tmp_path / "c.pem")
