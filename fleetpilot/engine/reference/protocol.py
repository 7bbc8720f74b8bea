"""The OpenAI-compatible wire format, as vLLM's server speaks it: request and response models
and OpenAI-shaped errors.

Requests ignore fields they do not know (OpenAI clients send many optional ones), but a known
field whose value would change the result in a way this engine cannot honour (``n > 1``,
``logprobs``, penalties, ``logit_bias``, tools, ...) is refused with a 400 rather than silently
ignored. Errors have OpenAI's shape, with vLLM's ``type`` names and an integer ``code``:
``{"error": {"message", "type", "param", "code"}}``.

``kv_transfer_params`` follows vLLM's NIXL connector (``do_remote_decode``/``do_remote_prefill``,
``remote_engine_id``, ``remote_block_ids`` (one list per KV-cache group), ``remote_request_id``,
``remote_host``, ``remote_port``, ``tp_size`` and the rest its prefill side answers);
``expires_at`` (unix seconds) is our addition.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from fleetpilot.engine.reference.sampling import SamplingParams
from fleetpilot.openai_errors import error_body as error_body  # shared with the router

# The largest seed torch's generators take; negative seeds are accepted too.
_MAX_SEED = 2**64 - 1
_MIN_SEED = -(2**63)


class APIError(Exception):
    """An error the server answers with an OpenAI-shaped body and ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param)


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first offending field (``param``)."""
    first = exc.errors(include_url=False)[0]
    # Union members add their type (``str``, ``list[int]``) to the location: keep field names
    # and list indexes only, so ``param`` is the path a client knows.
    loc = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p))
    message = f"{loc}: {first['msg']}" if loc else first["msg"]
    return APIError(400, message, param=loc or None)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_type_tag(part: int | str) -> bool:
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


# ---- requests --------------------------------------------------------------------------


class _Request(BaseModel):
    # Unknown fields are dropped, as vLLM does: OpenAI clients send optional extras freely.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class KVTransferParams(_Request):
    """vLLM's NIXL proxy protocol fields (the router fills them; nulls are allowed)."""

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    # One list per KV-cache group, as vLLM's prefill side and this engine answer; flat, as
    # vLLM before hybrid KV-cache groups sent it, is read too.
    remote_block_ids: list[int] | list[list[int]] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    expires_at: float | None = None
    tp_size: int | None = None

    def block_ids(self) -> list[int] | None:
        """The block ids to check against the pin; None when there is nothing to check."""
        ids = self.remote_block_ids
        if not ids:
            return None
        if all(isinstance(b, int) for b in ids):
            return [int(b) for b in ids]  # type: ignore[arg-type]
        return list(ids[0]) if len(ids) == 1 else None  # type: ignore[arg-type]


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # vLLM serves its one model when omitted
    # vLLM's SamplingParams refuses a non-finite temperature and one outside [0, 2].
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=_MIN_SEED, le=_MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    return_token_ids: bool = False  # vLLM extension: token ids in the response
    allowed_token_ids: list[StrictInt] | None = None  # vLLM extension: the tokens it may use
    kv_transfer_params: KVTransferParams | None = None
    # Accepted only at their neutral values: the engine does not implement them.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    best_of: int | None = None

    def _refuse_unsupported(self, extra: Mapping[str, object]) -> None:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported by this engine", param="n")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported by this engine", param="best_of")
        neutral: dict[str, tuple[object, ...]] = {
            "presence_penalty": (None, 0, 0.0),
            "frequency_penalty": (None, 0, 0.0),
            "repetition_penalty": (None, 1, 1.0),
            "min_tokens": (None, 0),
        }
        for name, allowed in neutral.items():
            value = getattr(self, name)
            if value not in allowed:
                raise APIError(400, f"{name} is not supported by this engine", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this engine", param="logit_bias")
        for name, value in extra.items():
            if value not in (None, False, 0, [], {}):
                raise APIError(400, f"{name} is not supported by this engine", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=self.seed,
                stop=self.stop_strings(),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                allowed_token_ids=tuple(self.allowed_token_ids or ()),
            )
        except ValueError as e:  # the engine's own range checks, as a 400
            raise APIError(400, str(e)) from e

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. A batch of prompts is refused: send one request per prompt."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # OpenAI's (and vLLM's) default for the legacy completions API.
    # Strict: JSON's true is not a token count (lax pydantic would read it as 1).
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._refuse_unsupported(
            {"echo": self.echo, "logprobs": self.logprobs, "suffix": self.suffix}
        )

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [int(x) for x in p]  # type: ignore[arg-type]
        if len(p) != 1:
            raise APIError(
                400, "batched prompts are not supported: send one request per prompt", "prompt"
            )
        item = p[0]
        if isinstance(item, list) and not item:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return item  # type: ignore[return-value]


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    400, f"content parts of type {part.type!r} are not supported", "messages"
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the context length, as vLLM does for chat.
    max_tokens: StrictInt | None = Field(default=None, ge=1)  # deprecated, still accepted
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's template switches: continue_final_message continues the final (assistant) message
    # in place of opening a new one.
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        self._refuse_unsupported(
            {
                "logprobs": self.logprobs,
                "top_logprobs": self.top_logprobs,
                "tools": self.tools,
            }
        )
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is not supported by this engine", "tool_choice")
        check_template_switches(self.add_generation_prompt, self.continue_final_message)
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError(
                400, "only response_format type 'text' is supported", param="response_format"
            )

    @property
    def effective_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def check_template_switches(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        # vLLM's own refusal.
        raise APIError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        )


@dataclass
class PreparedRequest:
    """A validated generation request, before it reaches the engine: the server builds it, the
    SSE writer reads it."""

    kind: Literal["completion", "chat"]
    request: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    model: str  # the served model name the response carries


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # BOS for a plain prompt
    add_generation_prompt: bool = True  # for messages
    continue_final_message: bool = False  # for messages


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class KVPullRequest(_Request):
    """Body of ``POST /internal/kv/{request_id}`` (decode server -> prefill server)."""

    engine_id: str | None = None
    block_ids: list[int] | None = None
    release: bool = True


class LoadLoRAAdapterRequest(_Request):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (its ``lora_int_id`` is ignored, as there)."""

    lora_name: str


# ---- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fleetpilot"
    root: str
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None  # vLLM gives none for adapters


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[StrictInt]


def to_json(model: BaseModel) -> str:
    """Compact JSON of a response model (SSE lines stay short; non-ASCII text stays as is)."""
    return json.dumps(model.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))
