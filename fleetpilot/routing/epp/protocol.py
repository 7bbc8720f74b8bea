"""Envoy's external-processing (ext_proc v3) messages as the Gateway API Inference Extension's
endpoint-picker protocol uses them: what a gateway's ``ProcessingRequest`` says (headers, the
subset hint, the endpoint that served) and the ``ProcessingResponse`` s the picker answers with
(the picked endpoints, the body as it goes upstream, a response passed through, an error).
Pure: no I/O, no routing.

The protocol is GIE's proposal 004 as its v1.3.0 EPP implements it (``pkg/epp/handlers``):
the gateway runs the filter in ``FULL_DUPLEX_STREAMED`` body mode, so the picker holds the
request headers' answer until the body is complete, then answers the headers (the picked
endpoints in the ``x-gateway-destination-endpoint`` header and, identically, in the
``envoy.lb`` dynamic metadata) followed by the body as streamed chunks; the response's body
chunks are echoed back as they come.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

# Proposal 004's keys (GIE pkg/epp/metadata).
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# llm-d's convention for a disaggregated request: the decode pod's sidecar reads the prefill
# endpoint from this header and runs the prefill hop itself.
PREFILL_HEADER = "x-prefiller-host-port"
# The most body bytes one streamed body response carries (GIE pkg/common BodyByteLimit,
# under Envoy's default gRPC message limit).
BODY_CHUNK_BYTES = 62_000

ProcessingRequest = Any  # envoy.service.ext_proc.v3.ProcessingRequest (generated, untyped)
ProcessingResponse = Any  # envoy.service.ext_proc.v3.ProcessingResponse


def phase(request: ProcessingRequest) -> str:
    """Which part of the HTTP exchange the message carries: ``request_headers``,
    ``request_body``, ``request_trailers``, ``response_headers``, ``response_body``,
    ``response_trailers`` (or ``""`` for none)."""
    return str(request.WhichOneof("request") or "")


def headers_of(http_headers: Any) -> dict[str, str]:
    """An ``HttpHeaders`` message as a dict of lower-case names (``:path``, ``:status``
    included); a header's ``raw_value`` wins over its ``value``, as Envoy sends either."""
    out: dict[str, str] = {}
    for header in http_headers.headers.headers:
        raw = header.raw_value
        out[header.key.lower()] = raw.decode("utf-8", "replace") if raw else header.value
    return out


def _metadata_value(request: ProcessingRequest, namespace: str, key: str) -> Any:
    if not request.HasField("metadata_context"):
        return None
    filters = request.metadata_context.filter_metadata
    if namespace not in filters:
        return None
    fields = filters[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    return None


def subset_hint(request: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints (``ip:port``) the gateway lets the picker choose among, or None when it
    sets no hint (then the whole pool). An empty hint is an empty set: nothing is eligible."""
    value = _metadata_value(request, SUBSET_NAMESPACE, SUBSET_KEY)
    if value is None:
        return None
    items = value if isinstance(value, list) else value.split(",")
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(request: ProcessingRequest) -> str | None:
    """The endpoint that served the request (``ip:port``), as the gateway reports it with the
    response: the first picked one, or a fallback it retried on."""
    value = _metadata_value(request, DESTINATION_NAMESPACE, SERVED_KEY)
    return value if isinstance(value, str) and value else None


def _header_options(headers: Mapping[str, str]) -> list[Any]:
    return [
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()))
        for name, value in headers.items()
    ]


def picked(
    endpoints: Sequence[str],
    set_headers: Mapping[str, str],
    remove_headers: Iterable[str] = (),
) -> ProcessingResponse:
    """The answer to the request headers once the picker has chosen: the endpoints (the
    first, then fallbacks the gateway tries in order) in the destination header and the same
    value in the ``envoy.lb`` dynamic metadata, the route cache cleared so the gateway routes
    on them; ``set_headers`` (e.g. the new Content-Length) and ``remove_headers`` too."""
    destination = ",".join(endpoints)
    mutation = ext_proc.HeaderMutation(
        set_headers=_header_options({DESTINATION_KEY: destination, **set_headers}),
        remove_headers=list(remove_headers),
    )
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: destination}})
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(clear_route_cache=True, header_mutation=mutation)
        ),
        dynamic_metadata=metadata,
    )


def _chunks(body: bytes, end_of_stream: bool) -> list[Any]:
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    pieces = pieces or [b""]
    return [
        ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(
                    body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1
                )
            )
        )
        for i, piece in enumerate(pieces)
    ]


def request_body(body: bytes) -> list[ProcessingResponse]:
    """The request body as it goes upstream, in streamed chunks, the last ending the stream."""
    return [
        ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common))
        for common in _chunks(body, True)
    ]


def response_headers(set_headers: Mapping[str, str] | None = None) -> ProcessingResponse:
    """The response headers passed on (with ``set_headers`` added)."""
    mutation = ext_proc.HeaderMutation(set_headers=_header_options(set_headers or {}))
    return ext_proc.ProcessingResponse(
        response_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(header_mutation=mutation)
        )
    )


def response_body(chunk: bytes, end_of_stream: bool) -> list[ProcessingResponse]:
    """A response body chunk passed on unchanged."""
    return [
        ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse(response=common))
        for common in _chunks(chunk, end_of_stream)
    ]


def trailers(which: str) -> ProcessingResponse:
    """Trailers passed on unchanged (``request_trailers`` or ``response_trailers``)."""
    return ext_proc.ProcessingResponse(**{which: ext_proc.TrailersResponse()})


def immediate(
    status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> ProcessingResponse:
    """An answer the gateway sends the client itself, the request going nowhere: the picker's
    refusals (400, 401, 413, 429, 503...) with their JSON error body."""
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(
                set_headers=_header_options({"content-type": "application/json", **(headers or {})})
            ),
            body=body,
        )
    )
