"""routing.auth on the local fleet: keys from --auth-dir files laid out as the Secrets mount
them in a cluster, or no auth (logged) without one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fleetpilot.api import parse_service
from fleetpilot.runtime.local import LocalFleet
from tests.factories import make_manifest, make_tier

AUTH = {"tenants": [{"name": "team-a", "keysSecretRef": {"name": "api-keys", "key": "team-a"}}]}


def _fleet(tmp_path: Path, auth_dir: Path | None) -> LocalFleet:
    manifest = make_manifest(tiers=[make_tier("small")], routing={"auth": AUTH})
    return LocalFleet(parse_service(manifest), tmp_path / "work", 0, auth_dir=auth_dir)


def test_keys_are_read_from_the_auth_dir_as_a_cluster_mounts_them(tmp_path: Path) -> None:
    config = _fleet(tmp_path, tmp_path / "keys").router_config()
    assert config.auth is not None
    assert config.auth.tenants[0].key_files == [str(tmp_path / "keys" / "api-keys" / "team-a")]


def test_without_an_auth_dir_the_local_router_admits_everyone_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fleetpilot.runtime.local"):
        config = _fleet(tmp_path, None).router_config()
    assert config.auth is None
    assert "admits every request" in caplog.text
