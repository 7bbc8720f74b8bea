"""``--model ORG/NAME``: a Hub repo id, found in a Hugging Face Hub cache folder offline.

An engine pod of a tier whose weights come from the model cache starts with ``HF_HUB_CACHE``
(the cache a download Job filled with ``fleetpilot model fetch hub``) and ``HF_HUB_OFFLINE=1``,
and vLLM is told ``--model ORG/NAME --revision REV``: it resolves the repo id in that cache, a
branch or tag through ``refs/<rev>``, a commit directly, without asking the Hub. The reference
engine does the same through huggingface_hub's own offline resolution
(``snapshot_download(..., local_files_only=True)``), then loads the snapshot folder with the
loader every checkpoint takes (:func:`~fleetpilot.engine.reference.checkpoint.load_checkpoint`).

As vLLM: ``--model`` that is an existing directory is that checkpoint (``--revision`` ignored);
anything else is a repo id. The cache is ``--download-dir`` (vLLM's flag), else
``$HF_HUB_CACHE``, else huggingface_hub's default (``$HF_HOME/hub``). The reference engine
downloads nothing, whether or not ``HF_HUB_OFFLINE`` is set: it is always offline, so a repo
the cache does not hold fails the start with an error naming the repo, revision and cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

HUB_CACHE_ENV = "HF_HUB_CACHE"
DEFAULT_REVISION = "main"


class ModelNotCachedError(ValueError):
    """A repo id the Hub cache does not hold (at that revision)."""


class NotARepoIdError(ModelNotCachedError):
    """Not a Hub repo id (``name`` or ``org/name``) at all, as huggingface_hub checks one."""


def hub_cache_dir(download_dir: str | None, environ: Mapping[str, str]) -> Path:
    """Where a repo id is looked up: ``--download-dir``, ``$HF_HUB_CACHE`` or the library's
    default (itself from ``HF_HOME`` when set)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if environ.get(HUB_CACHE_ENV):
        return Path(environ[HUB_CACHE_ENV]).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_snapshot(repo: str, revision: str | None, cache_dir: Path) -> Path:
    """The snapshot folder of ``repo`` at ``revision`` (default ``main``) in the Hub cache
    ``cache_dir``, resolved offline by huggingface_hub; ModelNotCachedError when absent,
    NotARepoIdError when ``repo`` cannot be one."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    wanted = revision or DEFAULT_REVISION
    try:
        folder = snapshot_download(
            repo, revision=wanted, cache_dir=cache_dir, local_files_only=True
        )
    except HFValidationError as e:  # the library's own check of the repo id
        raise NotARepoIdError(f"{repo}: {_first_line(e)}") from e
    except LocalEntryNotFoundError as e:
        # No snapshot for the revision (or, in recent huggingface_hub releases,
        # one its cached file listing shows incomplete).
        raise ModelNotCachedError(
            f"{repo} at revision {wanted} is not in the Hub cache {cache_dir} (the reference "
            "engine downloads nothing, as vLLM with HF_HUB_OFFLINE=1: fill the cache with "
            f"`fleetpilot model fetch hub --repo {repo} --revision {wanted} --cache-dir "
            f"{cache_dir}`): {_first_line(e)}"
        ) from e
    return Path(folder)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = [
    "DEFAULT_REVISION",
    "HUB_CACHE_ENV",
    "ModelNotCachedError",
    "NotARepoIdError",
    "hub_cache_dir",
    "resolve_snapshot",
]
