"""A Hugging Face Hub on 127.0.0.1, serving one model repo the way huggingface.co answers
huggingface_hub 2.x, so the download code runs the library's real HTTP path against it.

What the library asks and what it needs in the answers (huggingface_hub/hf_api.py
``model_info``, file_download.py ``get_hf_file_metadata``, ``http_get``):

- ``GET /api/models/{repo}/revision/{rev}[?blobs=True]``: ``id``, ``sha`` (the commit) and
  ``siblings`` (``rfilename``; with ``blobs``, ``blobId``, ``size`` and ``lfs`` {``sha256``,
  ``size``, ``pointerSize``} for LFS files). An unknown repo or revision is a 404 with
  ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound``; a private repo asked without its token
  answers 401 ``RepoNotFound``, as the Hub does.
- ``HEAD /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit`` always. A regular file answers 200
  with ``ETag`` (its git blob id) and ``Content-Length``. An LFS file answers 302 to a CDN on
  another origin (here: a second server, on another port) with ``X-Linked-Etag`` (its sha256)
  and ``X-Linked-Size``; the library then GETs the CDN URL itself, without the Authorization
  header. No ``X-Xet-*`` headers: the library takes its plain HTTP path, not hf_xet.
- ``GET`` of a file (on the Hub or the CDN) honours ``Range: bytes=N-`` with a 206.

Run as a program (``python -m tests.delivery.hub_server --repo ORG/NAME --dir FOLDER ...``),
it serves the files of FOLDER as the repo until SIGTERM, logging each request: the e2e tests
run it as a pod, a Hub mirror inside the cluster.

Test knobs: ``serve`` replaces the bytes served for a file (a wrong size), ``fail_get`` answers
500 to GETs of a file, ``drop_once`` cuts the first GET of a file mid-body and closes the
connection. Every request is recorded (method, origin, file, headers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import close_session

LFS_SUFFIXES = (".safetensors", ".pth", ".bin")
_RANGE = re.compile(r"^bytes=(\d+)-$")


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class Seen:
    """One request as the server saw it."""

    method: str
    origin: str  # "hub" or "cdn"
    file: str | None  # the repo file asked for, None for the API
    headers: dict[str, str]
    revision: str | None = None  # as the URL named it


@dataclass
class FakeHub:
    repo: str
    files: dict[str, bytes]
    revision: str = "main"
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None  # when set, the repo is private: requests need this token
    serve: dict[str, bytes] = field(default_factory=dict)
    fail_get: set[str] = field(default_factory=set)
    drop_once: set[str] = field(default_factory=set)
    advance_after_api: str | None = None  # a push to the branch right after the first listing
    seen: list[Seen] = field(default_factory=list)
    # Where it listens, and the address it gives out (in the CDN redirects) when that is not
    # the listening one: a pod listens on every interface and is reached at its pod IP.
    host: str = "127.0.0.1"
    advertise: str | None = None
    port: int = 0
    cdn_port: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped: set[str] = set()
        self._closed = False
        self.commits = {self.commit}
        self._hub = _Server((self.host, self.port), _handler(self, "hub"))
        self._cdn = _Server((self.host, self.cdn_port), _handler(self, "cdn"))
        self._threads = [
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            for s in (self._hub, self._cdn)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.advertise or self.host}:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://{self.advertise or self.host}:{self._cdn.server_address[1]}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # huggingface_hub keeps its connections alive in a shared session: drop them, or their
        # request threads here outlive the server (and a later test that joins every request
        # thread of the process waits on them).
        close_session()
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def served(self, path: str) -> bytes:
        return self.serve.get(path, self.files[path])

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def requests(self, method: str | None = None, file: str | None = None) -> list[Seen]:
        with self._lock:
            return [
                s
                for s in self.seen
                if (method is None or s.method == method) and (file is None or s.file == file)
            ]

    def gets(self, file: str) -> int:
        return len(self.requests("GET", file))

    def first_drop(self, path: str) -> bool:
        with self._lock:
            if path in self.drop_once and path not in self._dropped:
                self._dropped.add(path)
                return True
            return False

    def siblings(self, blobs: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path, content in sorted(self.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling["size"] = len(content)
                if self.is_lfs(path):
                    pointer = (
                        "version https://git-lfs.github.com/spec/v1\n"
                        f"oid sha256:{self.sha256(path)}\nsize {len(content)}\n"
                    )
                    sibling["blobId"] = git_blob_id(pointer.encode())
                    sibling["lfs"] = {
                        "sha256": self.sha256(path),
                        "size": len(content),
                        "pointerSize": len(pointer),
                    }
                else:
                    sibling["blobId"] = git_blob_id(content)
            out.append(sibling)
        return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (the drop test) is not an error worth a traceback."""


def _handler(hub: FakeHub, origin: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def _answer(self, *, head: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            if origin == "cdn":
                self._cdn(path, headers, head)
                return
            api = f"/api/models/{hub.repo}/revision/"
            resolve = f"/{hub.repo}/resolve/"
            if path.startswith(api):
                hub.record(Seen(self.command, origin, None, headers))
                if not self._authorized(headers):
                    return
                revision = path[len(api) :]
                if revision != hub.revision and revision not in hub.commits:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return
                blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() == "true"
                commit = revision if revision in hub.commits else hub.commit
                body = json.dumps(
                    {"id": hub.repo, "sha": commit, "siblings": hub.siblings(blobs)}
                ).encode()
                if hub.advance_after_api is not None:
                    hub.commit = hub.advance_after_api
                    hub.commits.add(hub.commit)
                    hub.advance_after_api = None
                self._send(200, {"Content-Type": "application/json"}, body, head)
                return
            if path.startswith(resolve):
                revision, _, file = path[len(resolve) :].partition("/")
                hub.record(Seen(self.command, origin, file, headers, revision))
                if not self._authorized(headers):
                    return
                known = revision == hub.revision or revision in hub.commits
                if not known or file not in hub.files:
                    self._error(404, "EntryNotFound", f"{file} not found")
                    return
                commit = revision if revision in hub.commits else hub.commit
                common = {"X-Repo-Commit": commit}
                if hub.is_lfs(file):
                    sha = hub.sha256(file)
                    common |= {
                        "Location": f"{hub.cdn}/blobs/{sha}",
                        "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(hub.served(file))),
                        "ETag": f'"{git_blob_id(sha.encode())}"',
                    }
                    self._send(302, common, b"", head)
                    return
                common["ETag"] = f'"{git_blob_id(hub.files[file])}"'
                self._content(file, headers, head, common)
                return
            hub.record(Seen(self.command, origin, None, headers))
            self._error(404, "RepoNotFound", "Repository not found")

        def _cdn(self, path: str, headers: dict[str, str], head: bool) -> None:
            by_sha = {hub.sha256(p): p for p in hub.files if hub.is_lfs(p)}
            file = by_sha.get(path.removeprefix("/blobs/"))
            hub.record(Seen(self.command, origin, file, headers))
            if file is None:
                self._send(404, {}, b"no such blob", head)
                return
            self._content(file, headers, head, {"ETag": f'"{hub.sha256(file)}"'})

        def _authorized(self, headers: dict[str, str]) -> bool:
            if hub.token is None or headers.get("authorization") == f"Bearer {hub.token}":
                return True
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return False

        def _content(
            self, file: str, headers: dict[str, str], head: bool, extra: dict[str, str]
        ) -> None:
            if not head and file in hub.fail_get:
                self._send(500, {}, b"internal error", head)
                return
            content = hub.served(file)
            start = 0
            match = _RANGE.match(headers.get("range", ""))
            if match:
                start = int(match.group(1))
            status = 206 if match else 200
            answer = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            answer |= extra
            if match:
                answer["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
            body = content[start:]
            if not head and hub.first_drop(file):
                # Announce the whole body, send half, hang up: a connection lost mid-file.
                self.send_response(status)
                for key, value in answer.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(status, answer, body, head)

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self._send(
                status,
                {
                    "X-Error-Code": code,
                    "X-Error-Message": message,
                    "Content-Type": "application/json",
                },
                body,
                head=self.command == "HEAD",
            )

        def _send(self, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a folder as one Hub model repo.")
    parser.add_argument("--repo", required=True, help="ORG/NAME")
    parser.add_argument("--dir", required=True, type=Path, help="the repo's files")
    parser.add_argument("--revision", default="main", help="the branch it is served at")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--advertise", help="the address clients reach (default: --host)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--cdn-port", type=int, default=8081)
    args = parser.parse_args(argv)
    files = {p.name: p.read_bytes() for p in sorted(args.dir.iterdir()) if p.is_file()}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    hub = _LoggingHub(
        args.repo,
        files,
        revision=args.revision,
        host=args.host,
        advertise=args.advertise,
        port=args.port,
        cdn_port=args.cdn_port,
    )
    print(f"serving {args.repo}@{args.revision} ({len(files)} files) at {hub.endpoint}", flush=True)
    try:
        stop.wait()
    finally:
        hub.close()
    return 0


class _LoggingHub(FakeHub):
    """The program's Hub: every request a line on stdout (a pod's log)."""

    def record(self, seen: Seen) -> None:
        super().record(seen)
        print(f"{seen.origin} {seen.method} {seen.file or 'api'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
