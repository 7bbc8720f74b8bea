"""``fleetpilot model fetch s3`` against moto's S3 server on 127.0.0.1, with credentials
checked (an IAM user's keys; moto's auth switched on once the fixture has set up), a recorder
in front of it to see every request and its Range, and a knob to cut a GET mid-body."""

from __future__ import annotations

import json
import logging
import random
import socket
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

from fleetpilot.cli import main
from fleetpilot.delivery.plan import MARKER_NAME, DeliveryError, VerificationError
from fleetpilot.delivery.s3 import fetch_s3

BUCKET = "models"
PREFIX = "llama/3.1-8b"
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None


class RecordingMotoServer(ThreadedMotoServer):
    """moto's threaded S3 server with a recorder in front of its WSGI app."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.seen: list[Seen] = []
        self.cut_once: set[str] = set()  # paths whose next GET breaks mid-body
        # What the server failed on while handling a request (a client gone mid-answer, most
        # often, on a loaded machine): kept here, not printed into the stderr the tests read
        # for the CLI's own messages.
        self.handler_errors: list[BaseException | None] = []
        self._lock = threading.Lock()

    def _server_entry(self) -> None:  # as ThreadedMotoServer's, with the recorder around
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            self._ip_address,
            self._port,
            self._recorder(app),
            True,
            request_handler=MotoRequestHandler,
        )
        self._server.handle_error = self._handle_error  # type: ignore[method-assign]
        self._server_ready_event.set()
        self._server.serve_forever()

    def _handle_error(self, request: object, client_address: object) -> None:
        """socketserver's hook, called inside the failed request's ``except``."""
        with self._lock:
            self.handler_errors.append(sys.exc_info()[1])

    def _recorder(self, app: WSGIApp) -> WSGIApp:
        def record(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
            with self._lock:
                self.seen.append(Seen(method, path, environ.get("HTTP_RANGE")))
                cut = method == "GET" and path in self.cut_once
                self.cut_once.discard(path)
            body = app(environ, start_response)
            if not cut:
                return body
            return _cut(b"".join(body), environ["werkzeug.socket"])

        return record

    def gets(self, key: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.method == "GET" and s.path == f"/{BUCKET}/{key}"]

    @property
    def endpoint(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"


def _cut(body: bytes, connection: socket.socket) -> Iterator[bytes]:
    """Send half the body, then drop the connection (the headers announced all of it)."""
    yield body[: len(body) // 2]
    connection.shutdown(socket.SHUT_RDWR)
    raise ConnectionAbortedError("cut by the test")


def _moto_api(endpoint: str, path: str, data: bytes = b"") -> None:
    request = urllib.request.Request(
        f"{endpoint}/moto-api/{path}", data=data, headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()


@dataclass(frozen=True)
class S3:
    server: RecordingMotoServer
    key_id: str
    secret: str

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret,
        )

    def put(self, key: str, body: bytes) -> None:
        self.client().put_object(Bucket=BUCKET, Key=key, Body=body)


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[S3]:
    """One server for the module (starting and stopping one costs a second)."""
    server = RecordingMotoServer()
    server.start()
    try:
        setup = {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1", **setup)
        iam.create_user(UserName="model-puller")
        iam.put_user_policy(
            UserName="model-puller",
            PolicyName="read-models",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="model-puller")["AccessKey"]
        env = S3(server, key["AccessKeyId"], key["SecretAccessKey"])
        env.client().create_bucket(Bucket=BUCKET)
        _moto_api(server.endpoint, "reset-auth", b"0")  # from here on, keys are checked
        yield env
    finally:
        _moto_api(server.endpoint, "reset-auth", b"inf")
        _moto_api(server.endpoint, "reset")
        server.stop()


@pytest.fixture
def s3(moto_s3: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3:
    """The server with an empty bucket, and the environment a Job's pod has: the keys, no
    profile, no instance role."""
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret)
    monkeypatch.setattr(logging.getLogger("werkzeug"), "level", logging.ERROR)
    client = moto_s3.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    moto_s3.server.seen.clear()
    moto_s3.server.cut_once.clear()
    return moto_s3


@pytest.fixture(autouse=True)
def _restored_logging() -> Iterator[None]:
    """The command configures logging for its process; put it back for the next test."""
    names = ["", "botocore", "boto3", "urllib3"]
    saved = [(logging.getLogger(n), logging.getLogger(n).handlers[:]) for n in names]
    levels = [logger.level for logger, _ in saved]
    yield
    for (logger, handlers), level in zip(saved, levels, strict=True):
        logger.handlers[:] = handlers
        logger.setLevel(level)


def _blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _fetch(s3: S3, dest: Path, *extra: str, prefix: str = PREFIX) -> int:
    argv = ["model", "fetch", "s3", "--endpoint", s3.endpoint, "--bucket", BUCKET]
    return main([*argv, "--prefix", prefix, "--dest", str(dest), *extra])


def _files_under(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _multipart(s3: S3, key: str, parts: list[bytes]) -> None:
    client = s3.client()
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    done = []
    for number, part in enumerate(parts, start=1):
        etag = client.upload_part(
            Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=number, Body=part
        )["ETag"]
        done.append({"ETag": etag, "PartNumber": number})
    client.complete_multipart_upload(
        Bucket=BUCKET, Key=key, UploadId=upload, MultipartUpload={"Parts": done}
    )


def test_objects_under_the_prefix_land_at_their_relative_paths(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "model-00001-of-00002.safetensors": _blob(300_000, 1),
        "original/params.json": b'{"dim": 4096}',
    }
    for name, body in model.items():
        s3.put(f"{PREFIX}/{name}", body)
    s3.put(f"{PREFIX}/", b"")  # a folder placeholder, as some consoles write
    s3.put("llama/3.1-8b-instruct/config.json", b"a sibling prefix: not ours")
    s3.put("other/config.json", b"not ours")
    # Uploaded in parts: its ETag is no MD5, so its size alone is checked.
    parts = [_blob(5 * 1024 * 1024, 2), _blob(1000, 3)]
    _multipart(s3, f"{PREFIX}/model-00002-of-00002.safetensors", parts)
    model["model-00002-of-00002.safetensors"] = b"".join(parts)

    dest = tmp_path / "cache" / "llama"
    assert _fetch(s3, dest) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(dest)
    on_disk = _files_under(dest)
    marker = json.loads(on_disk.pop(MARKER_NAME))
    assert on_disk == model

    assert marker["source"] == {"kind": "s3", "bucket": BUCKET, "prefix": PREFIX + "/"}
    assert marker["endpoint"] == s3.endpoint
    assert marker["files"] == [{"path": p, "size": len(model[p])} for p in sorted(model)]
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert sorted(line["file"] for line in lines if line.get("event") == "file") == sorted(model)
    total = sum(len(body) for body in model.values())
    assert lines[-1]["event"] == "complete"
    assert (lines[-1]["files_done"], lines[-1]["bytes_done"]) == (4, total)
    assert (lines[-1]["files_total"], lines[-1]["bytes_total"]) == (4, total)


def test_a_part_file_left_by_a_killed_run_is_resumed_with_a_ranged_get(
    s3: S3, tmp_path: Path
) -> None:
    body = _blob(1_000_000, 4)
    s3.put(f"{PREFIX}/model.safetensors", body)
    s3.put(f"{PREFIX}/config.json", b"{}")
    dest = tmp_path / "llama"
    dest.mkdir()
    (dest / "model.safetensors.part").write_bytes(body[:300_000])

    result = fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=dest)

    assert (dest / "model.safetensors").read_bytes() == body
    assert not (dest / "model.safetensors.part").exists()
    assert [g.range for g in s3.server.gets(f"{PREFIX}/model.safetensors")] == ["bytes=300000-"]
    assert result.files_fetched == 2


def test_a_resumed_file_whose_md5_differs_from_the_etag_is_refused(s3: S3, tmp_path: Path) -> None:
    """A .part that is not a prefix of the object (another version, a disk error): the whole
    file fails its MD5, is not renamed into place, and the next run starts it over."""
    body = _blob(400_000, 5)
    s3.put(f"{PREFIX}/model.safetensors", body)
    dest = tmp_path / "llama"
    dest.mkdir()
    (dest / "model.safetensors.part").write_bytes(b"\0" * 100_000)

    with pytest.raises(
        VerificationError, match=r"model\.safetensors: MD5 .* differs from the ETag"
    ):
        fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=dest)
    assert not (dest / "model.safetensors").exists()
    assert not (dest / "model.safetensors.part").exists()
    assert not (dest / MARKER_NAME).exists()

    fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=dest)
    assert (dest / "model.safetensors").read_bytes() == body
    assert s3.server.gets(f"{PREFIX}/model.safetensors")[-1].range is None


def test_a_stream_broken_mid_object_is_resumed_where_it_broke(s3: S3, tmp_path: Path) -> None:
    body = _blob(3 * 1024 * 1024, 6)
    key = f"{PREFIX}/model.safetensors"
    s3.put(key, body)
    s3.server.cut_once.add(f"/{BUCKET}/{key}")
    dest = tmp_path / "llama"

    fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=dest)

    assert (dest / "model.safetensors").read_bytes() == body
    gets = s3.server.gets(key)
    assert len(gets) == 2
    assert gets[0].range is None
    assert gets[1].range is not None
    resumed_at = int(gets[1].range.removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= len(body) // 2


def test_files_already_complete_are_skipped_and_wrong_ones_fetched_again(
    s3: S3, tmp_path: Path
) -> None:
    model = {"config.json": b"{}", "a.safetensors": _blob(2000, 7), "b.safetensors": _blob(3000)}
    for name, body in model.items():
        s3.put(f"{PREFIX}/{name}", body)
    dest = tmp_path / "llama"
    fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=dest)
    (dest / MARKER_NAME).unlink()
    (dest / "b.safetensors").write_bytes(b"truncated")

    result = fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=dest)

    assert result.files_fetched == 1
    assert {n: len(s3.server.gets(f"{PREFIX}/{n}")) for n in model} == {
        "config.json": 1,
        "a.safetensors": 1,
        "b.safetensors": 2,
    }
    assert (dest / "b.safetensors").read_bytes() == model["b.safetensors"]


def test_a_second_run_with_the_marker_asks_nothing(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3.put(f"{PREFIX}/config.json", b"{}")
    dest = tmp_path / "llama"
    assert _fetch(s3, dest) == 0
    capsys.readouterr()
    asked = len(s3.server.seen)

    assert _fetch(s3, dest) == 0
    out, err = capsys.readouterr()
    assert len(s3.server.seen) == asked
    assert out.strip() == str(dest)
    assert "already complete" in err

    # Another prefix into the same folder is another request: the marker does not match it.
    s3.put("llama/other/config.json", b"{}")
    assert _fetch(s3, dest, prefix="llama/other") == 0
    assert len(s3.server.seen) > asked


@pytest.mark.parametrize(
    "key", ["../../../etc/cron.d/evil", "sub/../../escape.txt", "/abs", "a/./b"]
)
def test_a_key_that_would_leave_the_destination_is_refused(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    s3.put(f"{PREFIX}/config.json", b"{}")
    s3.put(f"{PREFIX}/{key}", b"payload")
    dest = tmp_path / "deep" / "er" / "llama"
    assert _fetch(s3, dest) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: object {f'{PREFIX}/{key}'!r} refused")
    # Nothing at all was written: not the safe files, not the payload anywhere.
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    assert s3.server.gets(f"{PREFIX}/config.json") == []


@pytest.mark.parametrize(
    ("key_id", "secret", "expected"),
    [
        (None, "wrong", "SignatureDoesNotMatch"),
        ("AKIAUNKNOWNKEY000000", "wrong", "InvalidAccessKeyId"),
    ],
)
def test_wrong_credentials_say_what_to_check(
    s3: S3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    key_id: str | None,
    secret: str,
    expected: str,
) -> None:
    s3.put(f"{PREFIX}/config.json", b"{}")
    if key_id is not None:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert _fetch(s3, tmp_path / "llama") == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("{")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: listing s3://{BUCKET}/{PREFIX}/: {expected}: ")
    assert "AWS_ACCESS_KEY_ID" in errors[0]


def test_missing_credentials_a_missing_bucket_and_an_empty_prefix_are_named(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DeliveryError, match="no such bucket"):
        fetch_s3(endpoint=s3.endpoint, bucket="nope", prefix=PREFIX, dest=tmp_path)
    with pytest.raises(DeliveryError, match=f"s3://{BUCKET}/{PREFIX}/: no objects"):
        fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=tmp_path)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(DeliveryError, match="no credentials: set AWS_ACCESS_KEY_ID"):
        fetch_s3(endpoint=s3.endpoint, bucket=BUCKET, prefix=PREFIX, dest=tmp_path)
