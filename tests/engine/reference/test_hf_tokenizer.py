"""The byte tokenizer in Hugging Face's formats: what a router loads to tokenize a request
exactly as the reference engine does (issue 14: matching prompts against the engines' KV
events needs the engine's own token ids)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from fleetpilot.engine.reference.hf_tokenizer import SHIPPED, build_tokenizer, tokenizer_config
from fleetpilot.engine.reference.tokenizer import ByteTokenizer

SHIPPED_TOKENIZER = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
SHIPPED_CONFIG = json.loads((SHIPPED / "tokenizer_config.json").read_text())
BYTES = ByteTokenizer()

messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()}
    ),
    max_size=4,
)


@given(st.text())
def test_the_shipped_tokenizer_encodes_exactly_as_the_engine(text: str) -> None:
    """Any text, multi-byte characters and surrogate-free Unicode included: the same ids as
    ByteTokenizer (BOS, then the UTF-8 bytes) - one differing id and a router would never
    find a prompt in the engines' caches."""
    assert SHIPPED_TOKENIZER.encode(text).ids == BYTES.encode(text)
    assert build_tokenizer().encode(text).ids == BYTES.encode(text)


def test_special_token_names_in_a_prompt_stay_bytes() -> None:
    """A prompt that spells <|bos|> or <|eos|> is encoded byte by byte, as the engine does."""
    for text in ("<|bos|>", "a<|eos|>b", "<|bos|><|bos|>"):
        assert SHIPPED_TOKENIZER.encode(text).ids == BYTES.encode(text)


@given(messages, st.booleans())
def test_the_chat_template_renders_as_the_engine_formats_chats(
    chat: list[dict[str, str]], generation_prompt: bool
) -> None:
    """The Jinja template, rendered as vLLM renders chat templates (sandboxed, trim_blocks,
    lstrip_blocks, the config's special tokens passed in), gives the BOS token and then the
    engine's own chat text for any conversation: vLLM encodes a rendered chat without adding
    special tokens, where the engine prepends BOS to its chat text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(SHIPPED_CONFIG["chat_template"])
    rendered = template.render(
        messages=chat, add_generation_prompt=generation_prompt, **special_tokens()
    )
    expected = BYTES.apply_chat_template(chat, add_generation_prompt=generation_prompt)
    assert rendered == SHIPPED_CONFIG["bos_token"] + expected


def special_tokens() -> dict[str, str]:
    return {k: v for k, v in SHIPPED_CONFIG.items() if k.endswith("_token")}


def test_the_shipped_config_is_what_the_builder_writes() -> None:
    """tokenizer_config.json names the special tokens and carries the template the engine
    uses; regenerate with python -m fleetpilot.engine.reference.hf_tokenizer."""
    assert tokenizer_config() == SHIPPED_CONFIG
