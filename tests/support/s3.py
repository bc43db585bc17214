"""A real S3 server for tests: moto's threaded server on 127.0.0.1, a bucket, and the environment
that points packctl (pyarrow's S3 client) at it. Skips cleanly where moto is not installed.

    def test_x(s3):                       # the fixture: an S3Server
        s3.upload_dir("sample_data", "sample")  ->  s3://packctl-test/sample/shard-00000.parquet, ...
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "packctl-test"
SAMPLE = Path(__file__).resolve().parents[2] / "sample_data"
OPTIONS = dict(too_long="split", shard_rows=100)  # sample_data in 278 packs: 3 shards
ACCESS_KEY = "testing-key"
SECRET_KEY = "testing-secret-do-not-log"


@dataclass
class S3Server:
    endpoint: str
    client: object  # a boto3 S3 client of the server
    bucket: str = BUCKET

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}".rstrip("/")

    def upload_dir(self, directory: str, prefix: str) -> list[str]:
        """Every file of `directory` (not recursive) put under `prefix`; their URLs, sorted."""
        urls = []
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path, "rb") as fh:
                    self.client.put_object(Bucket=self.bucket, Key=f"{prefix}/{name}", Body=fh.read())
                urls.append(self.url(f"{prefix}/{name}"))
        return urls

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """One moto server for a test module (started in a thread; stopped after the module)."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
    boto3 = pytest.importorskip("boto3")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line a request otherwise
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    try:
        yield endpoint, client
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch) -> S3Server:
    """An empty bucket on the module's server, and AWS_* set so that packctl reaches it."""
    endpoint, client = s3_server
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    existing = client.list_objects_v2(Bucket=BUCKET) if BUCKET in {b["Name"] for b in client.list_buckets()["Buckets"]} else None
    if existing is None:
        client.create_bucket(Bucket=BUCKET)
    else:
        for item in existing.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    return S3Server(endpoint=endpoint, client=client)


class FlakyProxy:
    """An HTTP proxy in front of the S3 server that answers the next `failures` requests with
    `status` (a transient 500/503 of a real store) and forwards every other request as it is.

        with FlakyProxy(s3.endpoint, failures=2, status=503) as proxy:  # proxy.endpoint, proxy.failed
    """

    def __init__(self, target: str, *, failures: int, status: int = 503):
        self.target, self.left, self.status, self.failed = target, failures, status, 0

    def __enter__(self) -> "FlakyProxy":
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        proxy, target = self, urlsplit(self.target)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                return None

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    fail = proxy.left > 0
                    if fail:
                        proxy.left -= 1
                        proxy.failed += 1
                if fail:
                    self.send_response(proxy.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def authentication(s3: S3Server):
    """moto checks every request's signature and IAM permissions inside the block."""
    _post(f"{s3.endpoint}/moto-api/reset-auth", b"0")
    try:
        yield
    finally:
        _post(f"{s3.endpoint}/moto-api/reset-auth", b"inf")


def _post(url: str, body: bytes) -> None:
    import urllib.request

    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=10).read()


def use_scratch(tmp_path, monkeypatch):
    """Where a store run encodes its shards (TMPDIR), inside the test's folder: for runs in the
    test's process, forked from it, and started as commands. Returns the folder."""
    import tempfile

    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """What a pack of sample_data (`OPTIONS`) writes to a local directory: what a store's output
    and its readers are compared with."""
    from packctl import PackConfig, pack

    out = tmp_path_factory.mktemp("local") / "out"
    pack(PackConfig(inputs=[str(SAMPLE)], output=str(out), **OPTIONS))
    return out
