"""Where a text may be cut (issue 14): encoding the parts of a cut apart gives the ids of the
whole, on the shipped byte tokenizer (anywhere outside an added token) and on trained BPE
tokenizers (just after an isolated added token); what is no cut."""

from __future__ import annotations

import re

from hypothesis import assume, given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from fleetpilot.routing.tokenizer.request import RequestTokenizer
from tests.routing.tokenizer_support import EXAMPLES, SPECIALS, make, text_with, trained, whole


def spans_cut(text: str, cut: int, names: list[str]) -> bool:
    """Whether an occurrence of one of ``names`` in ``text`` straddles ``cut``."""
    return any(
        m.start() < cut < m.start() + len(name)
        for name in names
        for m in re.finditer(f"(?={re.escape(name)})", text)
    )


@EXAMPLES
@given(text_with("shipped"), text_with("shipped"))
def test_the_shipped_tokenizer_encodes_the_parts_of_any_cut_apart(a: str, b: str) -> None:
    """The byte tokenizer maps each character alone: any cut outside a special token's name
    splits the ids of the whole into the ids of the parts."""
    assume(not spans_cut(a + b, len(a), ["<|bos|>", "<|eos|>"]))
    tok = make("shipped").tokenizer
    joined = tok.encode(a + b, add_special_tokens=False).ids
    parts = [tok.encode(x, add_special_tokens=False).ids for x in (a, b)]
    assert joined == parts[0] + parts[1]


@EXAMPLES
@given(st.sampled_from(["bytelevel", "metaspace"]), st.data())
def test_a_trained_bpe_encodes_the_parts_of_a_cut_after_an_added_token_apart(
    style: str, data: st.DataObject
) -> None:
    """The property the cache rests on, for a real BPE: with ``a`` ending in an added token T,
    the ids of ``a + b`` are those of ``a`` then those of ``T + b`` without T's, whatever the
    text (merges, other special names, NFKC, Metaspace's prepend-first)."""
    a = data.draw(text_with(style))
    b = data.draw(text_with(style))
    token = data.draw(st.sampled_from(SPECIALS[style]))
    tok = make(style).tokenizer
    first = tok.encode(a + token, add_special_tokens=False).ids
    rest = tok.encode(token + b, add_special_tokens=False).ids
    assert rest[0] == tok.token_to_id(token)
    assert tok.encode(a + token + b, add_special_tokens=False).ids == first + rest[1:]


def test_a_cut_encoded_without_its_token_in_front_would_be_wrong() -> None:
    """Why the tail is encoded after its cut's token: Metaspace's prepend-first treats text at
    offset 0 differently, so encoding the parts plainly gives other ids; the router does not."""
    t = make("metaspace")
    tok = t.tokenizer
    a, b = "<s>[INST] hello [/INST]", "foo bar"
    parts = [tok.encode(x, add_special_tokens=False).ids for x in (a, b)]
    naive = parts[0] + parts[1]
    assert naive != tok.encode(a + b, add_special_tokens=False).ids
    body = {"prompt": a, "add_special_tokens": False}
    t.token_ids("completions", body)
    longer = {**body, "prompt": a + b}
    assert t.token_ids("completions", longer) == whole(t, "completions", longer)
    assert t.stats.hits == 1


def test_an_added_token_another_can_overlap_is_no_cut() -> None:
    """A cut after <|a|> is wrong when another added token, <|a|>!, can start at the same place
    (or any two added tokens can overlap): such tokens are never cut after."""
    tokenizer_json, config = trained("bytelevel")
    tok = Tokenizer.from_str(tokenizer_json)
    tok.add_special_tokens(["<|a|>", "<|a|>!", "x<|b|>", "<|b|>"])
    t = RequestTokenizer(tok.to_str(), config)
    for prompt in ("hello <|a|>", "hello <|a|>! there", "y<|b|>", "y<|b|>x<|b|>z"):
        body = {"prompt": prompt, "add_special_tokens": False}
        assert t.token_ids("completions", body) == whole(t, "completions", body)
    assert t.stats.hits == 0
