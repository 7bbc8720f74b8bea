"""Download every object under ``s3://bucket/prefix`` into a folder, resumably and verified.

For models kept in S3-compatible object storage (AWS S3, MinIO, Ceph RGW, R2...): the endpoint
URL and bucket name a spec gives, credentials from the environment (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, which the Job takes from a Secret; boto3's usual chain otherwise, so
a web identity or instance role works too). The prefix names a folder: each object lands at
its key relative to it, and a key that would leave the destination (``..``, an absolute path)
fails the listing before anything is written.

Each object is written to ``<name>.part`` and renamed over ``<name>`` once whole and verified,
so a file under its final name is always complete. A run skips files already there with the
listed size, continues a ``.part`` left by a killed run with a ranged GET, and resumes the same
way when a stream breaks mid-object. Every GET carries ``If-Match`` with the listed ETag: an
object replaced after the listing fails loudly instead of mixing two versions. Verified: each
file's size against the listing, and its MD5 against the ETag when the ETag is one (an object
uploaded in one part and not encrypted with KMS or a customer key); boto3 also checks the
object's CRC checksum, when it has one, on every GET of a whole object. Last, the marker
``<dest>/.fleetpilot-model.json`` is written; with it present and matching, a run does nothing.

The source is taken as immutable: a new model version belongs under a new prefix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    EndpointConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
)

from fleetpilot.delivery import progress as progress_log
from fleetpilot.delivery.plan import (
    MARKER_NAME,
    PART_SUFFIX,
    DeliveryError,
    RemoteFile,
    VerificationError,
    marker_files,
    marker_matches,
    marker_payload,
    md5_of_etag,
    resume_offset,
    s3_files,
    s3_prefix,
    size_problems,
    verify_sizes,
)
from fleetpilot.delivery.progress import Progress, fetch_all
from fleetpilot.delivery.store import file_size, read_marker, sizes_on_disk, write_marker

log = logging.getLogger("fleetpilot.delivery")

DEFAULT_WORKERS = 8
ADDRESSING_STYLES = ("path", "virtual", "auto")
CHUNK_BYTES = 1 << 20
# Broken streams in a row (no byte received in between) before an object is given up.
STREAM_RETRIES = 5
# Errors of a stream that broke after the request succeeded: worth a ranged retry. Errors of
# the request itself are retried by botocore's own policy before they get here.
_TRANSIENT = (HTTPClientError, ConnectionError, IncompleteReadError)
_CREDENTIAL_CODES = {
    "AccessDenied",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidToken",
    "SignatureDoesNotMatch",
    "403",
}
_UNVERIFIABLE_SSE = {"aws:kms", "aws:kms:dsse"}


@dataclass(frozen=True)
class S3Result:
    """A finished download: where it is, its files, what this run did."""

    dest: Path
    files: tuple[RemoteFile, ...]
    files_fetched: int
    already_complete: bool


def s3_source(bucket: str, prefix: str) -> dict[str, Any]:
    """What a marker records as asked for (the endpoint is kept beside it: the same bucket may
    be reached by more than one URL)."""
    return {"kind": "s3", "bucket": bucket, "prefix": s3_prefix(prefix)}


def fetch_s3(
    *,
    endpoint: str | None,
    bucket: str,
    dest: Path,
    prefix: str = "",
    region: str | None = None,
    addressing_style: str | None = None,
    workers: int = DEFAULT_WORKERS,
) -> S3Result:
    """Download every object under ``s3://bucket/prefix`` at ``endpoint`` into ``dest``.

    ``endpoint``: the store's URL; ``None`` is AWS S3 itself (in ``region``).
    ``addressing_style``: ``path`` (``endpoint/bucket/key``, what MinIO, Ceph and most
    S3-compatible stores expect: the default with an endpoint), ``virtual``
    (``bucket.endpoint/key``) or ``auto`` (boto3's choice: the default for AWS).
    Raises ``DeliveryError`` with a one-line message naming what failed.
    """
    if addressing_style is None:
        addressing_style = "path" if endpoint else "auto"
    if addressing_style not in ADDRESSING_STYLES:
        raise DeliveryError(
            f"addressing style {addressing_style!r}: not one of {ADDRESSING_STYLES}"
        )
    prefix = s3_prefix(prefix)
    where = f"s3://{bucket}/{prefix}"
    source = s3_source(bucket, prefix)
    dest = Path(dest).expanduser().resolve()
    marker_path = dest / MARKER_NAME

    finished = _finished(marker_path, source, dest, where)
    if finished is not None:
        progress_log.already_complete(where, finished, marker=str(marker_path))
        return S3Result(dest, tuple(finished), 0, True)

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        config=Config(
            s3={"addressing_style": addressing_style},
            retries={"mode": "standard", "max_attempts": 5},
            connect_timeout=10,
            read_timeout=60,
            max_pool_connections=max(10, workers + 2),
        ),
    )
    url = str(client.meta.endpoint_url)  # what boto3 chose when no endpoint was given
    files = _listing(client, bucket, prefix, where, url)
    progress = Progress(where, files)
    progress.plan(endpoint=url, dest=str(dest))

    def fetch(file: RemoteFile) -> bool:
        final = dest / file.path
        if file_size(final) == file.size:
            return False
        try:
            _download(client, bucket, prefix + file.path, file, final)
        except DeliveryError:
            raise
        except (BotoCoreError, ClientError, OSError) as exc:
            raise DeliveryError(f"{where}{file.path}: {_describe(exc, url)}") from exc
        return True

    fetch_all(fetch, files, progress, workers)
    verify_sizes(files, sizes_on_disk(dest, [f.path for f in files]), source=where)
    write_marker(marker_path, marker_payload(source, files, datetime.now(UTC), endpoint=url))
    progress.complete(dest=str(dest), marker=str(marker_path))
    return S3Result(dest, tuple(files), progress.files_fetched, False)


def _finished(
    marker_path: Path, source: dict[str, Any], dest: Path, where: str
) -> list[RemoteFile] | None:
    """The files of a matching marker when they are all on disk, else ``None``."""
    marker = read_marker(marker_path)
    if marker is None or not marker_matches(marker, source):
        return None
    files = marker_files(marker) or []
    problems = size_problems(files, sizes_on_disk(dest, [f.path for f in files]))
    if problems:
        log.warning(
            "%s: the marker says complete, but %s: fetching again",
            where,
            "; ".join(problems[:5]),
            extra={"event": "marker-stale"},
        )
        return None
    return files


def _listing(client: Any, bucket: str, prefix: str, where: str, endpoint: str) -> list[RemoteFile]:
    objects: list[tuple[str, int, str | None]] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                objects.append((item["Key"], int(item["Size"]), item.get("ETag")))
    except (BotoCoreError, ClientError) as exc:
        raise DeliveryError(f"listing {where}: {_describe(exc, endpoint)}") from exc
    files = s3_files(objects, prefix)
    if not files:
        raise DeliveryError(f"{where}: no objects under this prefix at {endpoint}")
    return files


def _download(client: Any, bucket: str, key: str, file: RemoteFile, final: Path) -> None:
    """Fetch one object to ``final`` through ``final.part``, continuing what is there."""
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + PART_SUFFIX)
    offset = resume_offset(file.size, file_size(part))
    expected_md5 = md5_of_etag(file.etag)
    digest = hashlib.md5(usedforsecurity=False) if expected_md5 else None
    if offset and digest is not None:
        _hash_prefix(part, offset, digest)
    if offset:
        log.info("%s: resuming at byte %d of %d", file.path, offset, file.size)
    with part.open("ab" if offset else "wb") as out:
        failures = 0
        while offset < file.size:
            request: dict[str, Any] = {"Bucket": bucket, "Key": key}
            if file.etag:
                request["IfMatch"] = file.etag
            if offset:
                request["Range"] = f"bytes={offset}-"
            start = offset
            try:
                response = client.get_object(**request)
                if offset and "ContentRange" not in response:
                    # The server sent the whole object, not the range: start the file over.
                    out.seek(0)
                    out.truncate()
                    offset = 0
                    digest = hashlib.md5(usedforsecurity=False) if expected_md5 else None
                if _sse_hides_md5(response):
                    digest = None
                body = response["Body"]
                try:
                    for chunk in body.iter_chunks(CHUNK_BYTES):
                        out.write(chunk)
                        if digest is not None:
                            digest.update(chunk)
                        offset += len(chunk)
                        if offset > file.size:
                            raise VerificationError(
                                f"{file.path}: the server sent more than the {file.size} "
                                "bytes listed"
                            )
                finally:
                    body.close()
                if offset < file.size:
                    raise IncompleteReadError(actual_bytes=offset, expected_bytes=file.size)
            except _TRANSIENT as exc:
                out.flush()
                failures = 1 if offset > start else failures + 1
                if failures > STREAM_RETRIES:
                    raise
                log.warning(
                    "%s: %s; resuming at byte %d",
                    file.path,
                    exc,
                    offset,
                    extra={"event": "retry", "file": file.path, "offset": offset},
                )
                time.sleep(min(0.5 * 2**failures, 8.0))
        out.flush()
        os.fsync(out.fileno())
    if digest is not None and digest.hexdigest() != expected_md5:
        part.unlink(missing_ok=True)
        raise VerificationError(
            f"{file.path}: MD5 {digest.hexdigest()} differs from the ETag {expected_md5}"
        )
    os.replace(part, final)


def _hash_prefix(part: Path, length: int, digest: Any) -> None:
    with part.open("rb") as existing:
        remaining = length
        while remaining:
            chunk = existing.read(min(CHUNK_BYTES, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)


def _sse_hides_md5(response: dict[str, Any]) -> bool:
    """Whether the object is encrypted so that its ETag is not the MD5 of its bytes."""
    return (
        response.get("ServerSideEncryption") in _UNVERIFIABLE_SSE
        or response.get("SSECustomerAlgorithm") is not None
    )


def _describe(exc: BaseException, endpoint: str) -> str:
    """One line saying what went wrong, with what to check for credential errors."""
    if isinstance(exc, NoCredentialsError):
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if isinstance(exc, EndpointConnectionError):
        return f"cannot reach {endpoint}: {exc}"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "?"))
        message = str(error.get("Message", "")).strip() or str(
            exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
        )
        if code in _CREDENTIAL_CODES:
            return (
                f"{code}: {message} (check the credentials in AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, and that they may read the bucket)"
            )
        if code == "NoSuchBucket":
            return f"no such bucket at {endpoint}"
        if code in ("PreconditionFailed", "412"):
            return "the object changed after it was listed (its ETag differs); run again"
        if code in ("NoSuchKey", "404"):
            return "the object was deleted after it was listed"
        return f"{code}: {message}"
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
