"""update_status: the optimistic status write both the operator and the autoscaler use.

Runs on the in-memory API server of tests/support/kube.py, which answers a write carrying a
stale resourceVersion with 409 as the real one does.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fleetpilot.kube.client import KubeError, Obj
from fleetpilot.kube.status import StatusWrite, update_status
from tests.factories import make_manifest
from tests.support.kube import FakeKube

KIND, NS, NAME = "InferenceService", "ml", "chat"


@pytest.fixture
def kube() -> FakeKube:
    kube = FakeKube()
    manifest = make_manifest(NAME, namespace=NS)
    manifest["status"] = {"endpoint": "http://chat-router.ml.svc:8000/v1", "tiersReady": "0/1"}
    kube.put(manifest)
    return kube


def live(kube: FakeKube) -> Obj:
    obj = kube.object(KIND, NS, NAME)
    assert obj is not None
    return obj


def status_writes(kube: FakeKube) -> list[Obj]:
    return [c.body or {} for c in kube.writes_of("PATCH", KIND, "status")]


def set_ready(value: str) -> Callable[[Obj], Obj]:
    return lambda obj: {"tiersReady": value}


def write(
    kube: FakeKube, mutate: Callable[[Obj], Obj | None], live: Obj | None = None
) -> StatusWrite:
    return update_status(kube, KIND, NS, NAME, mutate, manager="me", attempts=3, live=live)


def test_a_change_is_patched_with_the_read_version_and_keeps_other_fields(
    kube: FakeKube,
) -> None:
    """Only the fields mutate returns are sent, preconditioned on the version read; the other
    writers' fields stay."""
    version = live(kube)["metadata"]["resourceVersion"]
    assert write(kube, set_ready("1/1")) is StatusWrite.WRITTEN
    (patch,) = status_writes(kube)
    assert patch == {"status": {"tiersReady": "1/1"}, "metadata": {"resourceVersion": version}}
    assert live(kube)["status"] == {
        "endpoint": "http://chat-router.ml.svc:8000/v1",
        "tiersReady": "1/1",
    }


def test_nothing_changed_writes_nothing(kube: FakeKube) -> None:
    """What mutate computed is already there, or mutate says None: no request but the read."""
    assert write(kube, set_ready("0/1")) is StatusWrite.UNCHANGED
    assert write(kube, lambda obj: None) is StatusWrite.UNCHANGED
    assert kube.writes == 0


def test_a_lost_race_is_computed_again_from_a_fresh_read(kube: FakeKube) -> None:
    """409: the object is read again and mutate sees what the other writer wrote."""
    kube.interleave(
        "PATCH",
        KIND,
        lambda: kube.set_status(KIND, NS, NAME, {**live(kube)["status"], "endpoint": "new"}),
        subresource="status",
    )
    seen: list[str] = []

    def mutate(obj: Obj) -> Obj:
        seen.append(obj["status"]["endpoint"])
        return {"tiersReady": "1/1"}

    assert write(kube, mutate) is StatusWrite.WRITTEN
    assert seen == ["http://chat-router.ml.svc:8000/v1", "new"]
    assert live(kube)["status"] == {"endpoint": "new", "tiersReady": "1/1"}
    first, second = status_writes(kube)
    assert first["metadata"] != second["metadata"]


def test_persistent_conflicts_raise_after_the_last_attempt(kube: FakeKube) -> None:
    """Another writer wins every time: the conflict is raised after ``attempts`` tries."""
    kube.interleave(
        "PATCH", KIND, lambda: kube.touch(KIND, NS, NAME), subresource="status", times=None
    )
    with pytest.raises(KubeError) as raised:
        write(kube, set_ready("1/1"))
    assert raised.value.conflict
    assert len(status_writes(kube)) == 3


def test_an_object_deleted_meanwhile_is_given_up_cleanly(kube: FakeKube) -> None:
    """Deleted before the read, or between a lost race and the re-read: GONE, no error."""
    kube.interleave("PATCH", KIND, lambda: kube.touch(KIND, NS, NAME), subresource="status")
    kube.interleave("GET", KIND, lambda: kube.delete(KIND, NS, NAME), times=None)
    assert write(kube, set_ready("1/1"), live=live(kube)) is StatusWrite.GONE
    assert write(kube, set_ready("1/1")) is StatusWrite.GONE


def test_the_callers_read_stands_in_for_the_first_one(kube: FakeKube) -> None:
    """A caller that has just read the object (kopf's body) saves the first GET."""
    assert write(kube, set_ready("1/1"), live=live(kube)) is StatusWrite.WRITTEN
    assert [c.method for c in kube.calls] == ["PATCH"]


def test_other_errors_are_raised_at_once(kube: FakeKube) -> None:
    """Only a conflict is retried: a refusal (403) goes to the caller after one try."""
    kube.refuse("PATCH", KIND, 403, subresource="status")
    with pytest.raises(KubeError) as raised:
        write(kube, set_ready("1/1"))
    assert raised.value.status == 403
    assert len(status_writes(kube)) == 1
