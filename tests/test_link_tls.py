"""Engine links over mutual TLS (``engine_link_tls``), over real loopback connections.

Each side holds a certificate signed by the application's CA: requests stream as over a plain
link, and a peer without such a certificate (plaintext, or another CA's) is refused.
"""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import pytest

from deployments.engine_client import LocalEngineClient
from deployments.errors import Unavailable
from deployments.link import LinkTls, new_token
from deployments.link_client import LinkEngineClient
from deployments.replica import EngineReplica
from tests.fake_engine import FakeAsyncEngine
from tests.serving_helpers import run
from tests.test_link import _request, _shutdown, _tokens


def link_certificates(directory: Path, name: str) -> LinkTls:
    """A CA and one certificate it signed (EC keys: generated in milliseconds)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject: str, issuer: str, key, signer, ca: bool):
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .sign(signer, hashes.SHA256()))

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build(f"{name} CA", f"{name} CA", ca_key, ca_key, ca=True)
    cert = build(f"{name} node", f"{name} CA", key, ca_key, ca=False)
    paths = {kind: directory / f"{name}-{kind}.pem" for kind in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return LinkTls(certfile=str(paths["cert"]), keyfile=str(paths["key"]), cafile=str(paths["ca"]))


def _replica(token: str, tls: LinkTls | None) -> EngineReplica:
    options = {"vocab_size": 256, "eos_token_id": 10**6, "max_num_seqs": 8, "max_waiting": 8,
               "step_delay_s": 0.002}
    return EngineReplica("fake-model", options, FakeAsyncEngine, drain_timeout_s=1, link_token=token, link_tls=tls)


def _client(rep: EngineReplica, token: str, tls: LinkTls | None) -> LinkEngineClient:
    chooser = lambda request, avoid: (rep.replica_id, rep.record_routing_stats()["link"])  # noqa: E731
    return LinkEngineClient(LocalEngineClient([rep]), token, chooser, tls=tls)


def test_requests_stream_over_a_mutual_tls_link(tmp_path):
    tls = link_certificates(tmp_path, "app")

    async def main():
        token = new_token()
        rep = _replica(token, tls)
        await asyncio.sleep(0)
        client = _client(rep, token, tls)
        results = await asyncio.gather(*(_tokens(client.generate(_request(i))) for i in range(4)))
        assert all(len(tokens) == 12 and messages[-1].finish_reason == "length" for tokens, messages in results)
        (link,) = client._links.values()
        assert link.writer.get_extra_info("ssl_object") is not None  # the frames went encrypted
        await _shutdown([rep])
    run(main())


@pytest.mark.parametrize("peer", ["plaintext", "another CA"])
def test_a_peer_without_a_certificate_of_the_app_ca_is_refused(peer, tmp_path):
    tls = link_certificates(tmp_path, "app")
    other = None if peer == "plaintext" else link_certificates(tmp_path, "other")

    async def main():
        token = new_token()  # the right token: the certificate alone keeps the peer out
        rep = _replica(token, tls)
        await asyncio.sleep(0)
        with pytest.raises(Unavailable):
            await _tokens(_client(rep, token, other).generate(_request(0)))
        assert rep.engine.stats().num_finished == 0 and rep.engine.stats().running == 0
        tokens, _ = await _tokens(_client(rep, token, tls).generate(_request(1)))  # still serving
        assert len(tokens) == 12
        await _shutdown([rep])
    run(main())


def test_unreadable_tls_files_are_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="engine_link_tls"):
        LinkTls(certfile=str(tmp_path / "missing.pem"), keyfile=str(tmp_path / "missing.key"),
                cafile=str(tmp_path / "ca.pem")).context(server=True)


def _peer_name(client: LinkEngineClient) -> str:
    (link,) = client._links.values()
    subject = dict(field for rdn in link.writer.get_extra_info("peercert")["subject"] for field in rdn)
    return subject["commonName"]


def test_renewed_certificate_files_serve_new_links_without_a_restart(tmp_path):
    """cert-manager renews a Secret in place: both ends read the files again at their next connection,
    while links already open keep going."""
    import shutil

    live = tmp_path / "live"
    live.mkdir()
    first, second = link_certificates(tmp_path, "first"), link_certificates(tmp_path, "second")
    tls = LinkTls(certfile=str(live / "tls.crt"), keyfile=str(live / "tls.key"), cafile=str(live / "ca.crt"))

    def install(certs: LinkTls) -> None:
        for source, target in zip((certs.certfile, certs.keyfile, certs.cafile),
                                  (tls.certfile, tls.keyfile, tls.cafile)):
            shutil.copyfile(source, target + ".new")
            Path(target + ".new").rename(target)  # a whole file at once, as a Secret mount swaps

    install(first)

    async def main():
        token = new_token()
        rep = _replica(token, tls)
        await asyncio.sleep(0)
        before = _client(rep, token, tls)
        assert len((await _tokens(before.generate(_request(0))))[0]) == 12
        assert _peer_name(before) == "first node"
        install(second)
        after = _client(rep, token, tls)
        assert len((await _tokens(after.generate(_request(1))))[0]) == 12
        assert _peer_name(after) == "second node"  # the replica presented the renewed certificate
        assert len((await _tokens(before.generate(_request(2))))[0]) == 12  # the open link goes on
        await _shutdown([rep])
    run(main())
