"""TLS on the gateway (`--ssl-certfile` / `--ssl-keyfile`, vLLM's flags),
through the real `openai` client over httpx.

The certificate is made here with `cryptography` (a CA and a leaf for
`127.0.0.1` and `localhost`); the gateway serves a solo worker. A client
trusting the CA gets the same greedy answer, whole and streamed, as the worker
gives directly; a client that does not trust it, and a plain-HTTP client,
get no answer; a missing or wrong key stops the gateway at start, naming the
file.
"""

import datetime
import ipaddress
import ssl
import subprocess

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import SERVED_MODEL, Proc, model_path, rngd_bin


def _pem_key(k):
    return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                           serialization.NoEncryption())


def make_pki(d):
    """A CA (`ca.pem`) and a leaf it signed (`tls.crt`, `tls.key`) in `d`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rngd-pd test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "tls.crt").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (d / "tls.key").write_bytes(_pem_key(key))
    (d / "other.key").write_bytes(_pem_key(ec.generate_private_key(ec.SECP256R1())))
    return d


def gateway_args(solo, *extra):
    return [rngd_bin(), "gateway", "--listen", "127.0.0.1:0", "--solo", solo, "--model", model_path(), *extra]


@pytest.fixture(scope="module")
def tls_gateway(solo, tmp_path_factory):
    d = make_pki(tmp_path_factory.mktemp("pki"))
    p = Proc("tls gateway", gateway_args(solo, "--ssl-certfile", str(d / "tls.crt"),
                                         "--ssl-keyfile", str(d / "tls.key")))
    try:
        url = p.wait_line("rngd-pd gateway listening on", 120)
        yield url, d
    finally:
        p.stop()


def client(url, verify):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         http_client=httpx.Client(verify=verify))


def test_a_trusting_client_gets_the_workers_answer_over_tls(tls_gateway, solo):
    url, d = tls_gateway
    assert url.startswith("https://127.0.0.1:"), url
    trusted = client(url, ssl.create_default_context(cafile=str(d / "ca.pem")))
    direct = openai.OpenAI(base_url=solo + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name three colours."}]
    kw = dict(model=SERVED_MODEL, messages=msgs, max_tokens=12, temperature=0)
    want = direct.chat.completions.create(**kw).choices[0].message.content
    assert trusted.chat.completions.create(**kw).choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in trusted.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == want
    # The health routes answer over TLS too.
    with httpx.Client(verify=ssl.create_default_context(cafile=str(d / "ca.pem"))) as h:
        assert h.get(url + "/health").status_code == 200


def test_untrusting_and_plain_clients_get_no_answer(tls_gateway):
    url, _ = tls_gateway
    with pytest.raises(openai.APIConnectionError):
        client(url, ssl.create_default_context()).models.list()
    plain = "http://" + url.removeprefix("https://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=15)


def test_bad_tls_files_stop_the_gateway_naming_the_file(solo, tmp_path):
    d = make_pki(tmp_path)
    for cert, key, named in [
        (d / "tls.crt", d / "missing.key", "missing.key"),
        (d / "tls.crt", d / "other.key", "tls.crt"),
        (d / "tls.key", d / "tls.key", "tls.key"),
    ]:
        r = subprocess.run(gateway_args(solo, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--check"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, r.stdout
        assert named in r.stderr, r.stderr
    # One without the other is a usage error.
    r = subprocess.run(gateway_args(solo, "--ssl-certfile", str(d / "tls.crt"), "--check"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--ssl-keyfile" in r.stderr, r.stderr
