"""The served application the hostile-input battery runs against (tests/test_hostile_e2e.py).

One local Ray cluster: the real app (ingress + 2 engine replicas of the tiny random Llama),
gRPC on a free port, the HTTP proxy on HTTPS with a self-signed certificate made here, and
API keys read from a file that the tests rewrite. Small limits (prompt chars, body bytes,
gRPC message size) keep the oversized cases cheap.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import ssl
from pathlib import Path
from typing import Iterator

import grpc
import httpx2

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
from tests.ray_cluster import served_app
from tests.waits import fresh_replicas

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_waiting": 16, "block_size": 16,
          "num_kv_blocks": 128, "max_model_len": 512}
MAX_PROMPT_TOKENS = 300
MAX_PROMPT_CHARS = 4000
MAX_BODY_BYTES = 64 * 1024
ALLOWED_PRIORITY = (-5, 5)
GRPC_MAX_MESSAGE_BYTES = 1024 * 1024  # Ray's default is 2 GiB; the proxy reads it from its environment
KEYS = ("key-alpha-00000001", "key-bravo-00000002")


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 / localhost (EC key: generated in milliseconds)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class Service:
    """Clients of the running app; every call carries KEYS[0] unless told otherwise."""

    def __init__(self, http_port: int, grpc_port: int, cert_path: Path, keys_file: Path) -> None:
        self.http_port, self.grpc_port = http_port, grpc_port
        self.cert_path, self.keys_file = cert_path, keys_file
        self.base_url = f"https://127.0.0.1:{http_port}"
        self.ssl_context = ssl.create_default_context(cafile=str(cert_path))
        self.http = httpx2.Client(base_url=self.base_url, verify=self.ssl_context, trust_env=False, timeout=60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = slotserve_pb2_grpc.SlotServeStub(self.channel)

    @staticmethod
    def auth(key: str | None = KEYS[0]) -> list[tuple[str, str]]:
        return [] if key is None else [("authorization", f"Bearer {key}")]

    def raw_call(self, method: str, streaming: bool):
        """A call that sends bytes as they are (no client-side serialization)."""
        make = self.channel.unary_stream if streaming else self.channel.unary_unary
        return make(f"/slotserve.v1.SlotServe/{method}", request_serializer=None, response_deserializer=None)

    def generate(self, key: str | None = KEYS[0], timeout: float = 60, **fields) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(pb.GenerateRequest(**fields), timeout=timeout, metadata=self.auth(key)))

    def post(self, path: str, body=None, content: bytes | None = None, key: str | None = KEYS[0],
             headers: dict | None = None) -> httpx2.Response:
        headers = {"content-type": "application/json", **(headers or {})}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return self.http.post(path, json=body if content is None else None, content=content, headers=headers)

    def replicas(self) -> list[pb.ReplicaLoad]:
        return fresh_replicas(lambda: self.stub.GetLoad(pb.GetLoadRequest(), timeout=10, metadata=self.auth()).replicas)

    def openai(self, key: str = KEYS[0]):
        import openai

        client = httpx2.Client(verify=self.ssl_context, trust_env=False)
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=60,
                             http_client=client)

    def close(self) -> None:
        self.http.close()
        self.channel.close()


@contextlib.contextmanager
def hostile_service(model_dir: Path, workdir: Path) -> Iterator[Service]:
    """Ray + Serve + the app over HTTPS, with an API key file; the Service to reach it."""
    cert_path, key_path = self_signed_cert(workdir)
    keys_file = workdir / "api-keys"
    keys_file.write_text("# one key per line\n" + "\n".join(KEYS) + "\n")
    app = {"model": str(model_dir), "served_model_name": "tiny", "engine": ENGINE, "num_replicas": 2,
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25},
           "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_prompt_chars": MAX_PROMPT_CHARS,
           "default_max_tokens": 8, "max_body_bytes": MAX_BODY_BYTES, "allowed_priority": ALLOWED_PRIORITY,
           "api_keys_file": str(keys_file), "drain_timeout_s": 1}
    # The gRPC proxy reads its message size limit from the environment it inherits.
    with served_app(app, env={"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(GRPC_MAX_MESSAGE_BYTES)},
                    http_options={"ssl_certfile": str(cert_path), "ssl_keyfile": str(key_path)}) as ports:
        service = Service(ports.http, ports.grpc, cert_path, keys_file)
        try:
            yield service
        finally:
            service.close()
