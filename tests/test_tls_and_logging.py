"""TLS between the CLI and a real daemon process, and the daemon's structured (JSON) log lines."""

import datetime
import json
import signal
import subprocess

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from devtools.ports import free_port
from tests.helpers.cli import run_cli
from tests.helpers.daemon import stop_process
from tests.helpers.paths import BIN


def self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_and_json_logs(tmp_path, db_url):
    cert, key = self_signed(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "autobyted"),
            "start",
            "--listen",
            f"localhost:{port}",
            "--db",
            db_url,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--log-format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(100):
            secure = run_cli("status", "--daemon", f"localhost:{port}", "--tls-ca", str(cert))
            if secure.returncode == 0:
                break
        assert secure.returncode == 0 and "no jobs yet" in secure.stdout, secure.stderr
        plain = run_cli("status", "--daemon", f"localhost:{port}")
        assert plain.returncode == 3  # a plaintext client cannot talk to a TLS daemon
    finally:
        assert stop_process(proc, signal.SIGTERM) == 0
    lines = [json.loads(line) for line in proc.stdout.read().splitlines() if line.startswith("{")]
    listening = next(entry for entry in lines if entry["msg"] == "autobyted listening")
    assert listening["tls"] is True and listening["port"] == port and listening["level"] == "INFO"
    assert lines[-1]["msg"] == "autobyted stopped"


def test_text_log_lines_name_the_job_rank_and_configuration():
    import logging

    from autobyted.observability import TextFormatter

    record = logging.LogRecord(
        "autobyted.servicer", logging.INFO, __file__, 1, "decision", (), None
    )
    record.__dict__.update(job="quickstart", decision_id=3, config="partition=16MiB credit=64MiB")
    line = TextFormatter().format(record)
    assert line.endswith(
        "INFO autobyted.servicer: decision job=quickstart decision_id=3 "
        "config='partition=16MiB credit=64MiB'"
    ), line
    plain = logging.LogRecord("autobyted", logging.INFO, __file__, 1, "autobyted stopped", (), None)
    assert TextFormatter().format(plain).endswith("INFO autobyted: autobyted stopped")
