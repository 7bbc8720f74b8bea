"""Streaming responses: OpenAI's server-sent events for completions and chat completions.

A stream is ``data: {json}\\n\\n`` chunks (``text_completion`` or ``chat.completion.chunk``
objects), an optional usage chunk, then ``data: [DONE]``. An engine that dies mid-stream ends it
with an OpenAI-shaped error chunk, since the 200 status line is already sent.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from fleetpilot.engine.reference.protocol import PreparedRequest, Usage, error_body
from fleetpilot.engine.reference.request import RequestOutput
from fleetpilot.engine.reference.runner import EngineDeadError, RequestStream

log = logging.getLogger(__name__)


async def stream_events(
    request: web.Request, p: PreparedRequest, rid: str, stream: RequestStream
) -> web.StreamResponse:
    """Answer ``request`` with ``stream``'s outputs as events until it finishes.

    A client that disconnects ends the loop quietly; the caller aborts the engine request.
    """
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    writer = SSEWriter(resp, p, rid)
    # A chat stream's role chunk goes out with the request's first output, after its prefill,
    # as vLLM's serving_chat sends it (inside its loop over the engine's outputs), not at once:
    # the router takes an answer's first chunk as the end of its prefill.
    role_due = p.kind == "chat"
    try:
        while True:
            try:
                item = await stream.next()
            except EngineDeadError as e:
                await writer.send_error(503, str(e))
                break
            if role_due:
                await writer.send_role()
                role_due = False
            await writer.send_output(item.output)
            if item.output.finished:
                await writer.send_usage(item.output)
                break
        await writer.send_done()
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client disconnected from %s", rid)  # the caller's finally aborts
    return resp


class SSEWriter:
    """OpenAI's streaming format: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]``.

    While a request runs, text that could be the start of a stop string is held back (as vLLM
    does), so the streamed text is always a prefix of the final text, which is cut at the stop.
    """

    def __init__(self, resp: web.StreamResponse, p: PreparedRequest, rid: str) -> None:
        self.resp = resp
        self.p = p
        self.rid = rid
        self.created = int(time.time())
        stops = p.params.stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent_text = 0
        self.sent_tokens = 0

    async def _send(self, data: dict[str, Any]) -> None:
        line = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        await self.resp.write(f"data: {line}\n\n".encode())

    def _base(self, object_: str) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.rid,
            "object": object_,
            "created": self.created,
            "model": self.p.model,
        }
        if self.p.request.include_usage:
            data["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return data

    def _object(self) -> str:
        return "chat.completion.chunk" if self.p.kind == "chat" else "text_completion"

    async def send_role(self) -> None:
        data = self._base(self._object())
        data["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        await self._send(data)

    async def send_output(self, out: RequestOutput) -> None:
        text = out.text
        visible = len(text) if out.finished else max(len(text) - self.hold, 0)
        delta = text[self.sent_text : visible] if visible > self.sent_text else ""
        if not delta and not out.finished:
            return
        self.sent_text = max(self.sent_text, visible)
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.p.kind == "chat":
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        choice["finish_reason"] = out.finish_reason if out.finished else None
        choice["stop_reason"] = out.stop_reason if out.finished else None
        if self.p.request.return_token_ids:
            choice["token_ids"] = list(out.token_ids[self.sent_tokens :])
            self.sent_tokens = len(out.token_ids)
        data = self._base(self._object())
        data["choices"] = [choice]
        if self.p.request.continuous_usage:
            data["usage"] = _usage(out)
        await self._send(data)

    async def send_usage(self, out: RequestOutput) -> None:
        if not self.p.request.include_usage:
            return
        data = self._base(self._object())
        data["choices"] = []
        data["usage"] = _usage(out)
        await self._send(data)

    async def send_error(self, status: int, message: str) -> None:
        await self._send(error_body(status, message))

    async def send_done(self) -> None:
        await self.resp.write(b"data: [DONE]\n\n")


def _usage(out: RequestOutput) -> dict[str, Any]:
    usage = Usage.of(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)
    return usage.model_dump(mode="json")
