"""The floor of an endpoint picker in Python: an ext_proc servicer on grpc.aio (uvloop, as the
router runs) that decides nothing - every request to the one endpoint it was given - but speaks
the protocol as fleetpilot's picker does (``fleetpilot.routing.epp.protocol``): the pick in
header and metadata once the body is in, the body streamed back, the answer passed through
chunk by chunk. ``bench/router_cpu.py``'s ``python ext_proc floor`` arm runs it behind the
test gateway: the CPU a request that Python's gRPC alone costs, under any picker's decisions.

Run: .venv/bin/python bench/epp_floor.py --port P --endpoint HOST:PORT
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from fleetpilot.routing.epp import protocol


class FloorPicker(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def Process(  # noqa: N802 - the protocol's name
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        body = b""
        async for request in requests:
            kind = protocol.phase(request)
            if kind == "request_body":
                body += request.request_body.body
                if request.request_body.end_of_stream:
                    length = {"content-length": str(len(body))}
                    yield protocol.picked([self.endpoint], length)
                    for answer in protocol.request_body(body):
                        yield answer
            elif kind == "response_headers":
                yield protocol.response_headers()
            elif kind == "response_body":
                chunk = request.response_body
                for answer in protocol.response_body(chunk.body, chunk.end_of_stream):
                    yield answer


async def serve(port: int, endpoint: str) -> None:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(FloorPicker(endpoint), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
