"""API keys at the router (routing.auth): tenants from key files, checked before any routing
work, reloaded without a restart, never logged; a tenant limited to its tiers and adapters."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import openai
import pytest

from fleetpilot.api.router_config import AuthConfig, TenantKeys
from fleetpilot.routing.auth import MIN_KEY_CHARS, AuthGate, KeyRing, Tenant, build_ring, key_digest
from fleetpilot.routing.errors import AuthenticationError
from fleetpilot.testing.polling import eventually_async
from tests.routing.support import (
    HARD,
    SHORT,
    FakeEngine,
    assert_openai_error,
    engines,
    make_config,
    post,
    running_router,
    tier,
)

KEY_A = "sk-team-a-0123456789abcdef"
KEY_A2 = "sk-team-a-rotated-fedcba9876543210"
KEY_B = "sk-team-b-0123456789abcdef"


def _auth(tmp_path: Path, **tenants: tuple[str, dict[str, Any]]) -> AuthConfig:
    """One key file per tenant with the given text, and the tenant's limits."""
    specs = []
    for name, (text, limits) in tenants.items():
        path = tmp_path / f"{name}.keys"
        path.write_text(text)
        specs.append(TenantKeys(name=name, key_files=[str(path)], **limits))
    return AuthConfig(tenants=specs, reload_interval="50ms")


# -- the key ring ------------------------------------------------------------------------


def test_a_key_maps_to_its_tenant_and_only_digests_are_kept(tmp_path: Path) -> None:
    """Each line of a tenant's file is one of its keys (comments and blanks skipped); the
    ring holds SHA-256 digests, not the keys."""
    config = _auth(
        tmp_path,
        a=(f"# team a\n{KEY_A}\n\n{KEY_A2}\n", {"tiers": ["small"]}),
        b=(KEY_B, {}),
    )
    ring = AuthGate(config).ring
    assert ring is not None
    assert ring.authenticate(f"Bearer {KEY_A}") == Tenant("a", frozenset({"small"}))
    assert ring.authenticate(f"bearer  {KEY_A2} ").name == "a"
    assert ring.authenticate(f"Bearer {KEY_B}").name == "b"
    assert ring.key_counts() == {"a": 2, "b": 1}
    stored = repr(ring.entries)
    assert KEY_A not in stored
    assert key_digest(KEY_A) in [digest for digest, _ in ring.entries]


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        (f"Basic {KEY_A}", "malformed_authorization"),
        ("Bearer ", "malformed_authorization"),
        ("Bearer sk-not-a-key-of-anyone-at-all", "invalid_api_key"),
        (f"Bearer {KEY_A}x", "invalid_api_key"),
    ],
)
def test_no_valid_key_is_a_401_with_a_challenge(
    tmp_path: Path, header: str | None, reason: str
) -> None:
    ring = AuthGate(_auth(tmp_path, a=(KEY_A, {}))).ring
    assert ring is not None
    with pytest.raises(AuthenticationError) as refused:
        ring.authenticate(header)
    assert refused.value.status == 401
    assert refused.value.reason == reason
    assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")


def test_the_comparison_visits_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time: a matching key is compared with every stored digest, not only up to
    the first match (where it matched must not show in how long it took)."""
    tenants = [Tenant(f"t{i}") for i in range(5)]
    ring = KeyRing(tuple((key_digest(f"sk-key-number-{i:08d}"), t) for i, t in enumerate(tenants)))
    calls: list[bytes] = []
    real = __import__("hmac").compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(a)
        return bool(real(a, b))

    monkeypatch.setattr("fleetpilot.routing.auth.hmac.compare_digest", counting)
    assert ring.authenticate("Bearer sk-key-number-00000000").name == "t0"
    assert len(calls) == 5


def test_short_and_shared_keys_are_refused_and_logged_without_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key shorter than the minimum, or one two tenants hold (which tenant is it?), is
    refused; the log names tenants and files, never a key."""
    short = "x" * (MIN_KEY_CHARS - 1)
    config = _auth(tmp_path, a=(f"{short}\n{KEY_A}\n{KEY_B}", {}), b=(KEY_B, {}))
    with caplog.at_level(logging.INFO, logger="fleetpilot.routing.auth"):
        ring = build_ring(
            config, {f: Path(f).read_text() for t in config.tenants for f in t.key_files}
        )
    assert ring.key_counts() == {"a": 1}
    with pytest.raises(AuthenticationError):
        ring.authenticate(f"Bearer {KEY_B}")
    logged = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "shorter than" in logged
    assert "more than one tenant" in logged
    for key in (short, KEY_A, KEY_B):
        assert key not in logged


def test_a_rotated_file_is_read_again_and_an_unreadable_one_keeps_its_keys(tmp_path: Path) -> None:
    """A Secret updated in place (the kubelet swaps the file) changes the keys without a
    restart; a file gone mid-swap keeps the keys last read, so nobody is locked out."""
    config = _auth(tmp_path, a=(KEY_A, {}))
    gate = AuthGate(config)
    assert gate.check() is False  # unchanged
    path = Path(config.tenants[0].key_files[0])
    path.write_text(f"{KEY_A2}\n")
    assert gate.check() is True
    assert gate.ring is not None
    assert gate.ring.authenticate(f"Bearer {KEY_A2}").name == "a"
    with pytest.raises(AuthenticationError):
        gate.ring.authenticate(f"Bearer {KEY_A}")
    path.unlink()
    gate.check()
    assert gate.ring.authenticate(f"Bearer {KEY_A2}").name == "a"
    gate.apply(None)
    assert gate.ring is None


# -- at the router -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_official_client_gets_401_without_a_key_and_200_with_one(tmp_path: Path) -> None:
    """The openai package: no key or a wrong one raises its AuthenticationError (401, the
    body in vLLM's error shape), the tenant's key is served; the key never reaches the
    engine, and the metrics count the tenant by name."""
    engine = FakeEngine("e", chunks=2)
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])], auth=_auth(tmp_path, a=(KEY_A, {})))
        async with running_router(config) as router:
            # The client will not send no key at all; no header is the plain request below.
            for key in ("sk-wrong-key-0123456789", "sk"):
                async with openai.AsyncOpenAI(
                    base_url=router.url + "/v1", api_key=key, max_retries=0
                ) as client:
                    with pytest.raises(openai.AuthenticationError) as refused:
                        await client.completions.create(model="chat", prompt="hi")
                    assert refused.value.status_code == 401
                    with pytest.raises(openai.AuthenticationError):
                        await client.models.list()
            assert engine.requests == []
            async with openai.AsyncOpenAI(
                base_url=router.url + "/v1", api_key=KEY_A, max_retries=0
            ) as client:
                completion = await client.completions.create(model="chat", prompt="hi")
                assert completion.choices[0].text == "from e"
                assert [m.id for m in (await client.models.list()).data] == ["chat", "only-model"]
            assert "authorization" not in engine.headers[0]
            assert router.metric("fleetpilot_router_tenant_requests_total", tenant="a") == 1
            assert router.metric("fleetpilot_router_auth_keys", tenant="a") == 1
            status, payload, _ = await post(router, SHORT)
            assert_openai_error(status, payload, 401)
            assert (
                router.metric(
                    "fleetpilot_router_rejected_requests_total",
                    status="401",
                    code="missing_api_key",
                )
                == 1
            )


@pytest.mark.asyncio
async def test_a_tenant_routes_only_within_its_tiers(tmp_path: Path) -> None:
    """A tenant limited to the small tier: a hard prompt the router would send to the large
    tier stays on small; naming the large tier is 403; the other tenant is unlimited."""
    small, large = FakeEngine("small"), FakeEngine("large")
    async with engines(small, large):
        auth = _auth(tmp_path, a=(KEY_A, {"tiers": ["small"]}), b=(KEY_B, {}))
        config = make_config([tier("small", 0.4, [small]), tier("large", 1.0, [large])], auth=auth)
        async with running_router(config) as router:
            limited = {"Authorization": f"Bearer {KEY_A}"}
            status, payload, _ = await post(router, HARD, headers=limited)
            assert status == 200, payload
            assert payload["choices"][0]["text"] == "from small"
            status, payload, headers = await post(
                router, {**SHORT, "model": "large-model"}, headers=limited
            )
            assert_openai_error(status, payload, 403)
            assert headers["x-fleetpilot-error"] == "tier_not_allowed"
            status, payload, _ = await post(
                router, HARD, headers={"Authorization": f"Bearer {KEY_B}"}
            )
            assert payload["choices"][0]["text"] == "from large"
            async with openai.AsyncOpenAI(
                base_url=router.url + "/v1", api_key=KEY_A, max_retries=0
            ) as client:
                assert [m.id for m in (await client.models.list()).data] == ["chat", "small-model"]
                with pytest.raises(openai.PermissionDeniedError):
                    await client.completions.create(model="large-model", prompt="hi")


@pytest.mark.asyncio
async def test_a_tenant_may_request_only_its_adapters(tmp_path: Path) -> None:
    engine = FakeEngine("e")
    async with engines(engine):
        only = tier("only", 1.0, [engine]).model_copy(update={"adapters": ["sql", "legal"]})
        auth = _auth(tmp_path, a=(KEY_A, {"adapters": ["sql"]}))
        async with running_router(make_config([only], auth=auth)) as router:
            headers = {"Authorization": f"Bearer {KEY_A}"}
            status, payload, _ = await post(router, {**SHORT, "model": "sql"}, headers=headers)
            assert status == 200, payload
            status, payload, reply = await post(
                router, {**SHORT, "model": "legal"}, headers=headers
            )
            assert_openai_error(status, payload, 403)
            assert reply["x-fleetpilot-error"] == "adapter_not_allowed"


@pytest.mark.asyncio
async def test_keys_rotate_without_a_restart(tmp_path: Path) -> None:
    """The running router takes a rotated key file within its reload interval."""
    engine = FakeEngine("e")
    async with engines(engine):
        auth = _auth(tmp_path, a=(KEY_A, {}))
        async with running_router(make_config([tier("only", 1.0, [engine])], auth=auth)) as router:
            Path(auth.tenants[0].key_files[0]).write_text(KEY_A2)
            rotated = {"Authorization": f"Bearer {KEY_A2}"}

            async def status() -> int:
                return (await post(router, SHORT, headers=rotated))[0]

            await eventually_async("the rotated key taken", status, 5.0, until=lambda s: s == 200)
            status, _, _ = await post(router, SHORT, headers={"Authorization": f"Bearer {KEY_A}"})
            assert status == 401
