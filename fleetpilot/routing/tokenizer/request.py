"""The router's request tokenizer: a request's prompt token ids exactly as the engine computes
them, and their chained KV-index keys (``policies.kv_index.chain_keys``), with a prefix cache so
that a growing conversation re-tokenizes only its new tail.

It puts the package's parts together for vLLM 0.33.0 with the transformers 5.x it requires:
the files read as transformers loads them (``loading``), a chat rendered as vLLM renders it
(``template``, ``messages``), and the ids encoded from the longest cached prefix ending at a safe
cut (``prefix_cache``, ``cuts``). Completions (``vllm/renderers/base.py``
``default_cmpl_tok_params``): a string prompt is encoded with ``add_special_tokens`` (default
true: the post-processor's BOS/EOS); a token-id prompt is used as is.

What is not matched (raises :class:`TokenizerError`, so the router falls back to its guessed
index): ``tools``, a request ``chat_template``, non-text content parts,
``truncate_prompt_tokens``, ``prompt_embeds``, batched prompts, chat-template kwargs that change
tokenization, Mistral and Harmony (gpt-oss) tokenizers, model-specific transformers tokenizer
classes that rebuild their pipeline instead of loading ``tokenizer.json``, and a LoRA adapter's
own tokenizer.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, chain_keys
from fleetpilot.routing.tokenizer import loading
from fleetpilot.routing.tokenizer.cuts import cut_rule, span_cuts
from fleetpilot.routing.tokenizer.errors import TokenizerError, bad
from fleetpilot.routing.tokenizer.messages import (
    Kind,
    check_input_size,
    check_payload,
    flag,
    input_chars,
    single_prompt,
    token_prompt,
)
from fleetpilot.routing.tokenizer.prefix_cache import (
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_CACHE_TOKENS,
    CacheStats,
    Lookup,
    PrefixEncoder,
    Prompt,
)
from fleetpilot.routing.tokenizer.template import ChatTemplate, ContentFormat, Rendered

# The most characters tokenized for one request: the bound on what one request costs the router.
# tokenizers' byte-level BPE runs at ~0.6 us a character on one core of the benchmark machine
# (bench/router_tokenize.py), so a cold prompt at 128k characters (~32k tokens at ~4 characters
# a token, 2,000 blocks of 16) costs the caller ~80 ms (~40 ms with the byte tokenizer), far less
# than the engine's prefill of it. A longer prompt is tokenized only up to its last safe cut
# before the cap: its keys are exact for that head, which is where prompts share prefixes and
# already tells the replicas apart. Raw input over four times the cap is refused before rendering.
DEFAULT_MAX_CHARS = 128 * 1024
# RequestTokenizer.plan looks a request up in the prefix cache (render, find the cuts, digest the
# prefixes) at once only when its text is at most this long, so that a caller learns what is left
# to encode before deciding where to encode it. That pass is linear in the whole text: ~3 ns a
# character for render, digest and an ``added``-mode scan (BPE tokenizers), but ~0.08 us for a
# ``chars``-mode scan (the byte tokenizer: a lookahead at every character), so ~1.3 ms here at
# worst. A longer request costs milliseconds even when its prefix is cached (a 100k-character
# next turn took 4-7 ms here), so it is not probed: its whole pass belongs off the caller's loop.
PLAN_INLINE_MAX_CHARS = 16 * 1024


class RequestTokenizer:
    """Tokenizes OpenAI-style requests as a vLLM engine serving these tokenizer files would.

    ``chat_template``, ``content_format`` and ``default_template_kwargs`` mirror ``vllm serve``'s
    ``--chat-template``, ``--chat-template-content-format`` and
    ``--default-chat-template-kwargs``.

    Thread-safe, for the router's worker threads: the prefix cache locks only around its
    dictionary operations (``prefix_cache.PrefixEncoder``) and Jinja templates render per call.
    """

    def __init__(
        self,
        tokenizer_json: str,
        config: Mapping[str, Any],
        *,
        source: str = "<memory>",
        chat_template: str | None = None,
        content_format: ContentFormat = "auto",
        default_template_kwargs: Mapping[str, Any] | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        self.source = source
        tokenizer, spec = loading.pipeline(tokenizer_json, config, source)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_chars = max_chars
        self._encoder = PrefixEncoder(
            tokenizer,
            cut_rule(spec, tokenizer),
            max_chars=max_chars,
            cache_entries=cache_entries,
            cache_tokens=cache_tokens,
        )
        self.stats: CacheStats = self._encoder.stats
        template = loading.chat_template(config, chat_template)
        self._chat: ChatTemplate | None = None
        if template is not None:
            self._chat = ChatTemplate(
                template,
                source=source,
                content_format=content_format,
                special_tokens=loading.special_tokens(config),
                default_kwargs=default_template_kwargs,
                max_chars=max_chars,
            )

    @classmethod
    def from_dir(cls, path: Path, **options: Any) -> RequestTokenizer:
        """The tokenizer of a model directory: ``tokenizer.json``, ``tokenizer_config.json`` and,
        if present, ``chat_template.jinja``. ``options`` as for the constructor."""
        return cls.from_files(loading.dir_files(path), source=str(path), **options)

    @classmethod
    def from_files(cls, files: loading.Files, *, source: str, **options: Any) -> RequestTokenizer:
        """The tokenizer of these files (``loading.locate``); ``options`` as for the
        constructor."""
        tokenizer_json, config = loading.read_files(files, source)
        return cls(tokenizer_json, config, source=source, **options)

    # ---- public API -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The ``tokenizers`` pipeline as loaded (the config's special tokens added)."""
        return self._encoder.tokenizer

    @property
    def chat_template(self) -> str | None:
        """The chat template's source, if the tokenizer has one."""
        return self._chat.text if self._chat is not None else None

    def token_ids(self, kind: Kind, payload: Mapping[str, Any]) -> list[int]:
        """The prompt token ids the engine prefills for this request body. Raises
        :class:`TokenizerError` as :meth:`keys` does, and for a prompt over ``max_chars``."""
        prompt = self._prompt(kind, payload)
        if prompt.truncated:
            raise TokenizerError(f"the prompt is longer than {self.max_chars} characters")
        return [*prompt.head, *prompt.body, *prompt.tail]

    def keys(
        self,
        kind: Kind,
        payload: Mapping[str, Any],
        block_size: int,
        lora_name: str | None = None,
    ) -> list[bytes]:
        """The chained content keys (``chain_keys``) of the full blocks of the request's prompt,
        at most ``MAX_MATCH_BLOCKS``: what the KV index matches. A prompt over ``max_chars`` gives
        the keys of its head up to its last safe cut before the cap. Raises
        :class:`TokenizerError` for anything the engine would not tokenize this way."""
        return self.plan(kind, payload).keys(block_size, lora_name)

    def plan(self, kind: Kind, payload: Mapping[str, Any]) -> KeysPlan:
        """:meth:`keys` in two steps: this one looks the request up in the prefix cache (for a
        text of at most ``PLAN_INLINE_MAX_CHARS``), so that ``pending_chars`` says what the
        second, :meth:`KeysPlan.keys`, will encode, which may then run on another thread. Raises
        :class:`TokenizerError` as :meth:`keys` does (a longer text: from ``KeysPlan.keys``)."""
        check_payload(payload)
        if kind == "completions" and not isinstance(payload.get("prompt"), str):
            return KeysPlan(self, kind, payload, 0, given=token_prompt(payload, self.vocab_size))
        size = input_chars(kind, payload)
        if size > PLAN_INLINE_MAX_CHARS:
            return KeysPlan(self, kind, payload, size)
        found = self._plan_prompt(kind, payload)
        pending = found.pending_chars if isinstance(found, Lookup) else 0
        return KeysPlan(self, kind, payload, pending, found=found)

    def render_chat(self, payload: Mapping[str, Any]) -> str:
        """The chat prompt text vLLM renders for this ``/v1/chat/completions`` body."""
        return self._render(payload).text

    def remember_reply(self, payload: Mapping[str, Any], reply: str) -> None:
        """Cache the prefix this conversation's next turn starts with: the chat request's
        messages followed by the assistant's reply as the engine generated it (the router sees
        it on its way back), up to the cut after the reply. The next request then tokenizes
        only its new message. A reply the client sends back otherwise is only a miss. Raises
        :class:`TokenizerError` as :meth:`keys` does."""
        if not isinstance(payload, Mapping) or not isinstance(reply, str):
            bad("remember_reply takes a chat body and the reply's text")
        if flag(payload, "continue_final_message", False) or not reply.strip():
            return  # the reply continues a message: the next turn's text is not known
        messages = payload.get("messages")
        if not isinstance(messages, list):
            bad("messages must be a non-empty list")
        body = {
            **payload,
            "messages": [*messages, {"role": "assistant", "content": reply}],
            "add_generation_prompt": False,
        }
        r = self._render(body)
        encoder = self._encoder
        scan = encoder.rule.scan(r.text)
        after = scan.at_or_after(r.final[1]) if r.final is not None else None
        if after is None or after[0] > len(r.text):
            return
        stop = after[0]
        cuts = [c for c in span_cuts(scan, r.spans) if c < stop]
        found = encoder.look_up(r.text[:stop], scan, cuts, [(stop, True)], r.specials, join=True)
        prompt = encoder.finish(found)
        if prompt.base is not None:  # the request's keys, extended over the reply
            with encoder.cache.lock:
                variants = list(prompt.base.keys)
            for variant in variants:
                encoder.chain(prompt, variant)

    # ---- requests ---------------------------------------------------------------------------

    def _prompt(self, kind: Kind, payload: Mapping[str, Any]) -> Prompt:
        found = self._plan_prompt(kind, payload)
        return found if isinstance(found, Prompt) else self._encoder.finish(found)

    def _plan_prompt(self, kind: Kind, payload: Mapping[str, Any]) -> Prompt | Lookup:
        """The request's prompt looked up in the cache (a token-id prompt: its ids at once)."""
        check_payload(payload)
        if kind == "chat":
            r = self._render(payload)
            scan = self._encoder.rule.scan(r.text)
            # Stored: the prefix before the final message (a retry or another branch of this
            # conversation has it; from scratch, it may be a shared system prompt) and the whole
            # prompt to its last cut (the next turn extends it when the template renders the
            # generation prompt as the start of the reply, as nearly all do).
            before_final = scan.at_or_before(r.final[0]) if r.final is not None else None
            whole = scan.at_or_before(len(r.text))
            stores = [(before_final[0], False)] if before_final is not None else []
            stores += [(whole[0], True)] if whole is not None else []
            return self._encoder.look_up(r.text, scan, span_cuts(scan, r.spans), stores, r.specials)
        if kind != "completions":
            bad(f"unknown request kind {kind!r}")
        prompt = single_prompt(payload)
        if not isinstance(prompt, str):
            ids = token_prompt(payload, self.vocab_size)
            return Prompt((), array("I", ids), ())
        check_input_size(len(prompt), self.max_chars)
        scan = self._encoder.rule.scan(prompt)
        cuts = scan.plain_cuts(len(prompt))
        specials = flag(payload, "add_special_tokens", True)
        return self._encoder.look_up(
            prompt, scan, cuts, [(cuts[-1], False)] if cuts else [], specials
        )

    def _render(self, payload: Mapping[str, Any]) -> Rendered:
        """The chat rendered by this tokenizer's template (refused without one, or for a body
        that is not an object, before the template reads anything)."""
        if not isinstance(payload, Mapping):
            bad("the request body must be a JSON object")
        if self._chat is None:
            bad(f"{self.source}: the tokenizer has no chat template")
        return self._chat.render(payload)


class KeysPlan:
    """A request's :meth:`RequestTokenizer.keys`, split where the cheap part ends: made by
    :meth:`RequestTokenizer.plan`, then :meth:`keys` (any thread) encodes what the prefix cache
    lacks and chains the keys, per block size.

    ``pending_chars``: the characters :meth:`keys` will encode (past the longest cached prefix)
    when the plan looked the request up; for a request over ``PLAN_INLINE_MAX_CHARS``, left whole
    to :meth:`keys`, the size of its text; 0 for a token-id prompt. One plan is for one thread at
    a time; its tokenizer serves many at once."""

    def __init__(
        self,
        tokenizer: RequestTokenizer,
        kind: Kind,
        payload: Mapping[str, Any],
        pending_chars: int,
        *,
        found: Prompt | Lookup | None = None,
        given: list[int] | None = None,
    ) -> None:
        self.pending_chars = pending_chars
        self._tokenizer = tokenizer
        self._kind: Kind = kind
        self._payload = payload
        self._found = found
        self._given = given
        self._prompt: Prompt | None = found if isinstance(found, Prompt) else None

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens once :meth:`keys` ran; None for a prompt cut at the
        tokenizer's ``max_chars``, whose keys cover only its head (keys are also cut at
        ``MAX_MATCH_BLOCKS``: a caller that needs the whole prompt checks their number too)."""
        if self._given is not None:
            return len(self._given)
        prompt = self._prompt
        if prompt is None or prompt.truncated:
            return None
        return len(prompt.head) + len(prompt.body) + len(prompt.tail)

    def keys(self, block_size: int, lora_name: str | None = None) -> list[bytes]:
        """As :meth:`RequestTokenizer.keys`; the prompt is encoded once for all block sizes."""
        if self._given is not None:
            return chain_keys(self._given, block_size, lora_name, max_blocks=MAX_MATCH_BLOCKS)
        tokenizer = self._tokenizer
        prompt = self._prompt
        if prompt is None:
            found = self._found
            if found is None:
                found = tokenizer._plan_prompt(self._kind, self._payload)
            prompt = found if isinstance(found, Prompt) else tokenizer._encoder.finish(found)
            self._prompt = prompt
        tail = () if prompt.truncated else prompt.tail
        return tokenizer._encoder.chain(prompt, (block_size, lora_name, prompt.head), tail)


def load_tokenizer(
    ref: str,
    *,
    cache_dir: Path | None = None,
    local_files_only: bool = False,
    **options: Any,
) -> RequestTokenizer:
    """The tokenizer ``ref`` names: a local model directory or ``hf://<org>/<name>@<revision>``
    (``loading.locate`` says where the files come from; ``options`` as for the constructor).
    Raises :class:`TokenizerError` naming the file that is missing or unusable."""
    files = loading.locate(ref, cache_dir=cache_dir, local_files_only=local_files_only)
    return RequestTokenizer.from_files(files, source=ref, **options)
