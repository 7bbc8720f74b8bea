"""``fleetpilot model fetch hub|s3``: fill a model cache once, as a Kubernetes Job runs it;
``fleetpilot model gc``: remove from it the downloads nothing keeps any more.

::

    fleetpilot model fetch hub --repo ORG/NAME [--revision REV] --cache-dir DIR
                               [--include PATTERN ...] [--endpoint URL] [--workers N]
    fleetpilot model fetch s3  [--endpoint URL] --bucket B [--prefix P] [--region R] --dest DIR
                               [--addressing-style path|virtual|auto] [--workers N]
    fleetpilot model gc [--hub-cache-dir DIR] [--keep-hub ORG/NAME@REV ...]
                        [--s3-dir DIR] [--keep-s3 NAME ...] [--dry-run]

Exit 0 when the model is complete and verified (also when a marker says an earlier run did it),
printing its folder on standard output: the Hub snapshot folder, or ``--dest``. Exit 1 with one
line ``error: ...`` on standard error when it is not (network, credentials, a file that fails
verification, an unsafe object key); 2 for a wrong command line. Progress goes to standard
error as log lines (``--log-format json``, the default: one object a line, see
``fleetpilot.delivery.progress``). Credentials come from the environment only: ``HF_TOKEN`` for
the Hub, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` for S3.

``gc`` logs a line for each path it removes (``event: removed``, with its bytes and why) and
prints how many bytes it freed; exit 1 when a path cannot be removed (see
``fleetpilot.delivery.gc`` for what it removes and what it never touches).

The download modules (huggingface_hub, boto3) are imported when a fetch runs, not for
``--help``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fleetpilot.logs import add_log_arguments, configure_logging

if TYPE_CHECKING:
    from fleetpilot.delivery.gc import HubKeep

EXIT_OK = 0
EXIT_FAILED = 1
# A request line a file (httpx) and a note on where credentials came from (botocore) at INFO:
# noise in a Job's log, and the Hub's CDN URLs carry short-lived signatures best kept out of
# it. Shown with --log-level debug.
_CHATTY_LOGGERS = ("httpx", "httpx2", "httpcore", "urllib3", "botocore", "boto3")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="{fetch,gc}")
    fetch = actions.add_parser(
        "fetch",
        help="download a model into a cache folder, verified, once per revision",
        description="Download a model into a cache folder, verified, once per revision.",
    )
    sources = fetch.add_subparsers(dest="source", required=True, metavar="{hub,s3}")

    hub = sources.add_parser(
        "hub",
        help="a Hugging Face Hub repo, into a Hub cache folder (HF_HUB_CACHE)",
        description="Download a Hub model repo at a revision into a Hub cache folder, laid out "
        "as huggingface_hub lays it out: vLLM started with HF_HUB_CACHE=<cache-dir> and "
        "HF_HUB_OFFLINE=1 finds it by --model ORG/NAME --revision REV. Token: $HF_TOKEN.",
    )
    hub.add_argument("--repo", required=True, help="model repo id, ORG/NAME")
    hub.add_argument("--revision", default="main", help="branch, tag or commit")
    hub.add_argument("--cache-dir", required=True, type=Path, help="the Hub cache folder")
    hub.add_argument(
        "--include",
        nargs="+",
        action="extend",
        metavar="PATTERN",
        help="fetch only files matching these shell patterns (repeatable; default: what "
        "vLLM reads - *.json *.safetensors *.txt *.model *.py *.tiktoken *.jinja, and *.bin "
        "when the revision has no safetensors)",
    )
    hub.add_argument(
        "--endpoint", help="the Hub or a mirror (default: $HF_ENDPOINT, else huggingface.co)"
    )
    hub.add_argument("--workers", type=_positive, default=8, help="files fetched at once")
    add_log_arguments(hub)
    hub.set_defaults(run=_run_hub)

    s3 = sources.add_parser(
        "s3",
        help="every object under s3://bucket/prefix, into a folder",
        description="Download every object under s3://BUCKET/PREFIX from an S3-compatible "
        "endpoint into a folder, keeping paths relative to the prefix. Credentials: "
        "$AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY (or boto3's usual chain).",
    )
    s3.add_argument(
        "--endpoint", help="endpoint URL, e.g. http://minio.storage:9000 (default: AWS S3)"
    )
    s3.add_argument("--bucket", required=True)
    s3.add_argument("--prefix", default="", help="the folder in the bucket (default: all)")
    s3.add_argument("--region", help="region to sign for (default: boto3's)")
    s3.add_argument("--dest", required=True, type=Path, help="folder to fill")
    s3.add_argument(
        "--addressing-style",
        choices=["path", "virtual", "auto"],
        help="path: ENDPOINT/BUCKET/KEY (MinIO, Ceph; the default with --endpoint); virtual: "
        "BUCKET.ENDPOINT/KEY; auto: boto3's choice (the default for AWS S3)",
    )
    s3.add_argument("--workers", type=_positive, default=8, help="objects fetched at once")
    add_log_arguments(s3)
    s3.set_defaults(run=_run_s3)

    gc = actions.add_parser(
        "gc",
        help="remove from a model cache the downloads nothing keeps",
        description="Remove from a model cache every download the fetch commands wrote that "
        "is not kept: Hub snapshots of other revisions (with their refs and markers), blobs no "
        "kept snapshot links to, Hub repos not kept at all, S3 download folders not kept. "
        "Nothing else: repos and folders without a fleetpilot marker, and any other file, "
        "stay. Run it when no download into the cache is running.",
    )
    gc.add_argument(
        "--hub-cache-dir",
        type=Path,
        metavar="DIR",
        help="the Hub cache folder (fetch hub's --cache-dir); not given: not looked at",
    )
    gc.add_argument(
        "--keep-hub",
        nargs="+",
        action="extend",
        default=[],
        type=_hub_keep,
        metavar="ORG/NAME@REV",
        help="a Hub download to keep (repeatable; no @REV: main); a branch or tag is "
        "resolved through the cache's refs, as an offline engine resolves it",
    )
    gc.add_argument(
        "--s3-dir",
        type=Path,
        metavar="DIR",
        help="the folder holding S3 downloads, one folder each (fetch s3's --dest is inside "
        "it); not given: not looked at",
    )
    gc.add_argument(
        "--keep-s3",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME",
        help="the folder name, in --s3-dir, of an S3 download to keep (repeatable)",
    )
    gc.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    add_log_arguments(gc)
    gc.set_defaults(run=_run_gc, usage_error=gc.error)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    if args.log_level != "debug":
        for name in _CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    from fleetpilot.delivery.plan import DeliveryError

    try:
        outcome: Path | str = args.run(args)
    except DeliveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(outcome)
    return EXIT_OK


def _run_hub(args: argparse.Namespace) -> Path:
    from huggingface_hub.utils.tqdm import disable_progress_bars

    from fleetpilot.delivery.hub import fetch_hub, hub_token

    # Progress is ours, one log line a file; the library's bars would fill a Job's log, and its
    # own stderr handler would print its warnings a second time beside our formatter's.
    disable_progress_bars()
    logging.getLogger("huggingface_hub").handlers.clear()
    result = fetch_hub(
        args.repo,
        args.cache_dir,
        revision=args.revision,
        include=args.include,
        endpoint=args.endpoint,
        token=hub_token(),
        workers=args.workers,
    )
    return result.snapshot


# boto3 is the `s3` extra (the fleetpilot image installs it; a bare `pip install fleetpilot`
# does not).
S3_EXTRA_MISSING = (
    "fetching from S3 needs boto3, which is not installed: "
    "pip install 'fleetpilot[s3]' (the fleetpilot image has it)"
)


def _run_s3(args: argparse.Namespace) -> Path:
    from fleetpilot.delivery.plan import DeliveryError

    try:
        from fleetpilot.delivery.s3 import fetch_s3
    except ModuleNotFoundError as exc:
        if exc.name not in {"boto3", "botocore"}:
            raise
        raise DeliveryError(S3_EXTRA_MISSING) from exc

    result = fetch_s3(
        endpoint=args.endpoint,
        bucket=args.bucket,
        prefix=args.prefix,
        region=args.region,
        dest=args.dest,
        addressing_style=args.addressing_style,
        workers=args.workers,
    )
    return result.dest


def _hub_keep(text: str) -> HubKeep:
    from fleetpilot.delivery.gc import HubKeep
    from fleetpilot.delivery.plan import DeliveryError

    try:
        return HubKeep.parse(text)
    except DeliveryError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_gc(args: argparse.Namespace) -> str:
    from fleetpilot.delivery.gc import collect_garbage

    if args.keep_hub and args.hub_cache_dir is None:
        args.usage_error("--keep-hub needs --hub-cache-dir")
    if args.keep_s3 and args.s3_dir is None:
        args.usage_error("--keep-s3 needs --s3-dir")
    if args.hub_cache_dir is None and args.s3_dir is None:
        args.usage_error("give --hub-cache-dir, --s3-dir or both")
    result = collect_garbage(
        hub_cache_dir=args.hub_cache_dir,
        keep_hub=args.keep_hub,
        s3_dir=args.s3_dir,
        keep_s3=args.keep_s3,
        dry_run=args.dry_run,
    )
    return result.summary()
