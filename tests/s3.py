"""A real S3 server for tests: moto's, threaded, on 127.0.0.1 with a free port (pip install "raydl[test]").

pyarrow's S3 client, which raydl and Ray Train use, speaks HTTP to it as to AWS; AWS_ENDPOINT_URL is what
points it (and boto3) there. Its request log goes nowhere: moto's werkzeug would print every request.
"""

from __future__ import annotations

import logging
import uuid

import pytest


class S3Server:
    def __init__(self):
        moto_server = pytest.importorskip("moto.server", reason="moto[server] is in raydl's [test] extra")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.env: dict[str, str] = {}

    def __enter__(self) -> "S3Server":
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def new_bucket(self) -> str:
        name = f"raydl-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"


class CheckingS3Server:
    """Moto's server in a process of its own that checks credentials like AWS (INITIAL_NO_AUTH_ACTION_COUNT=0:
    every request must be signed by a key its IAM knows, and it knows none), for the refusals of bad or missing
    credentials. Its own process: moto's auth switch is a process-wide setting."""

    def __init__(self, port: int):
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "CheckingS3Server":
        import os
        import socket
        import subprocess
        import sys
        import time

        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:   # poll until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"moto's server did not start on port {self.port}")
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
