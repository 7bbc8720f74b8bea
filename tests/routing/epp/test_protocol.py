"""The ext_proc message helpers, judged on the generated Envoy messages themselves."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from fleetpilot.routing.epp import protocol


def with_metadata(namespace: str, values: dict[str, object]) -> ext_proc.ProcessingRequest:
    request = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders())
    data = struct_pb2.Struct()
    data.update(values)
    request.metadata_context.filter_metadata[namespace].CopyFrom(data)
    return request


def test_headers_are_read_lower_cased_raw_value_first() -> None:
    headers = ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key="Content-Type", value="application/json"),
                base_pb2.HeaderValue(key="x-both", value="old", raw_value=b"raw"),
            ]
        )
    )
    assert protocol.headers_of(headers) == {
        ":path": "/v1/completions",
        "content-type": "application/json",
        "x-both": "raw",
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (["10.0.0.1:8000", "10.0.0.2:8000"], {"10.0.0.1:8000", "10.0.0.2:8000"}),
        ("10.0.0.1:8000, 10.0.0.2:8000", {"10.0.0.1:8000", "10.0.0.2:8000"}),
        ([], set()),
    ],
)
def test_the_subset_hint_is_a_list_or_a_comma_separated_string(
    value: object, expected: set[str]
) -> None:
    request = with_metadata(protocol.SUBSET_NAMESPACE, {protocol.SUBSET_KEY: value})
    assert protocol.subset_hint(request) == expected


def test_no_hint_means_the_whole_pool_and_the_served_endpoint_is_read() -> None:
    assert protocol.subset_hint(ext_proc.ProcessingRequest()) is None
    request = with_metadata(protocol.DESTINATION_NAMESPACE, {protocol.SERVED_KEY: "10.0.0.2:8000"})
    assert protocol.served_endpoint(request) == "10.0.0.2:8000"
    assert protocol.served_endpoint(ext_proc.ProcessingRequest()) is None


def test_the_pick_sets_the_same_endpoints_in_the_header_and_the_metadata() -> None:
    response = protocol.picked(["a:1", "b:2"], {"content-length": "12"}, ["authorization"])
    mutation = response.request_headers.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    assert set_headers == {protocol.DESTINATION_KEY: b"a:1,b:2", "content-length": b"12"}
    assert list(mutation.remove_headers) == ["authorization"]
    metadata = response.dynamic_metadata.fields[protocol.DESTINATION_NAMESPACE]
    assert metadata.struct_value.fields[protocol.DESTINATION_KEY].string_value == "a:1,b:2"
    assert response.request_headers.response.clear_route_cache


def test_a_long_body_goes_in_chunks_and_only_the_last_ends_the_stream() -> None:
    body = b"x" * (protocol.BODY_CHUNK_BYTES * 2 + 5)
    responses = protocol.request_body(body)
    streamed = [r.request_body.response.body_mutation.streamed_response for r in responses]
    assert [len(s.body) for s in streamed] == [protocol.BODY_CHUNK_BYTES] * 2 + [5]
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    assert b"".join(s.body for s in streamed) == body
    (empty,) = protocol.response_body(b"", True)
    assert empty.response_body.response.body_mutation.streamed_response.end_of_stream


def test_an_immediate_answer_carries_status_json_and_headers() -> None:
    response = protocol.immediate(429, b'{"error": {}}', {"retry-after": "1"})
    answer = response.immediate_response
    assert answer.status.code == 429
    assert answer.body == b'{"error": {}}'
    set_headers = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
    assert set_headers == {"content-type": b"application/json", "retry-after": b"1"}
