"""A chat template rendered as vLLM renders it (vLLM 0.33.0 with the transformers 5.x it
requires: ``vllm/renderers/online_renderer.py`` ``preprocess_chat``, ``vllm/renderers/hf.py``
``safe_apply_chat_template``/``resolve_chat_template_kwargs``/``_detect_content_format``).

The template is compiled and rendered by transformers itself (``chat_template_utils``:
``_compile_jinja_template``, as vLLM compiles it for its content-format detection, and
``render_jinja_template``, what ``apply_chat_template(tokenize=False)`` runs), so its Jinja setup
and ``continue_final_message`` cut are transformers' own, not a copy. What is vLLM's stays here:
the special-token names, ``add_generation_prompt`` (default true), ``documents``,
``reasoning_effort`` and ``chat_template_kwargs`` merged as vLLM merges them, and whether the
template gets message content as text or as a list of parts, read from its AST as vLLM reads it.
The online server renders to text (``tokenize=False``) and encodes it with the request's
``add_special_tokens`` (default false for chat: BOS only if the template writes it).
``bench/router_tokenize.py`` measured transformers' rendering against the copy it replaces:
within noise, and within the hot path's budget.

Not followed (raises :class:`TokenizerError`): ``tools``, a request ``chat_template`` (vLLM
refuses it unless ``--trust-request-chat-template``) and chat-template kwargs that change
tokenization. A template calling ``strftime_now`` renders the router's clock, which differs from
the engine's only across a date change. Pure: no I/O (the clock aside); templates render per
call, so one object serves many threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes
from transformers.utils import chat_template_utils

from fleetpilot.routing.tokenizer.errors import TokenizerError, bad
from fleetpilot.routing.tokenizer.messages import (
    check_input_size,
    content_chars,
    conversation,
    developer_as_system,
    flag,
    needles,
)

ContentFormat = Literal["auto", "string", "openai"]

# transformers' apply_chat_template parameters: never passed on to the template itself.
_APPLY_PARAMS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
# chat_template_kwargs that would change tokenization or vLLM's call itself: not followed.
_REFUSED_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "chat_template", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)  # fmt: skip


# ---- vLLM's content-format detection (vllm/renderers/hf.py), on the template's AST ------------


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    if isinstance(node, jinja2.nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var_access(node.node, base)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts: list[str] = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases(root: jinja2.nodes.Template, varname: str) -> list[str]:
    """``varname`` and every variable assigned from it or its elements (vLLM's
    ``_iter_nodes_assign_var_or_elems``)."""
    names = [varname]
    seen = {varname}
    queue = [varname]
    while queue:
        related = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            found: list[str] = []
            if isinstance(lhs, jinja2.nodes.Name) and _is_var_or_elems_access(rhs, related):
                found.append(lhs.name)
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                found += [
                    f"{lhs.name}.{kw.key}"
                    for kw in rhs.kwargs
                    if _is_var_or_elems_access(kw.value, related)
                ]
            elif isinstance(
                lhs, jinja2.nodes.Getattr | jinja2.nodes.NSRef
            ) and _is_var_or_elems_access(rhs, related):
                dotted = _dotted_name(lhs)
                found += [dotted] if dotted is not None else []
            for name in found:
                names.append(name)
                if name not in seen:
                    seen.add(name)
                    queue.append(name)
    return names


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (vLLM's
    ``_iter_nodes_assign_content_item``): then it gets content as a list of parts."""
    message_vars: list[str] = []
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(
            _is_var_or_elems_access(loop.iter, v) for v in _aliases(root, "messages")
        ):
            message_vars.append(loop.target.name)
    content_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                    _is_var_or_elems_access(arg, v, "content") for v in message_vars
                ):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in param_names and any(
                    _is_var_or_elems_access(kw.value, v, "content") for v in message_vars
                ):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                content_params[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, v, "content") for v in message_vars):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


# ---- messages as vLLM hands them to the template -----------------------------------------------


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: an override of None or "auto" leaves the default."""
    out = dict(defaults)
    for key, value in overrides.items():
        if value is None or (isinstance(value, str) and value == "auto"):
            continue
        out[key] = value
    return out


@dataclass
class Rendered:
    """A chat rendered to text, with where its messages' text is in it (the prefix cache looks
    prefixes up at those places)."""

    text: str
    spans: list[tuple[int, int]]  # where the messages' text was found in it, in order
    final: tuple[int, int] | None  # the final message's span, if found
    specials: bool  # encoded with the post-processor's special tokens


class ChatTemplate:
    """One compiled chat template and the server-side settings vLLM renders it with:
    ``content_format`` and ``default_kwargs`` mirror ``vllm serve``'s
    ``--chat-template-content-format`` and ``--default-chat-template-kwargs``; ``special_tokens``
    the config's named special tokens (``bos_token`` ...), which reach the template as variables.
    """

    def __init__(
        self,
        template: str,
        *,
        source: str,
        content_format: ContentFormat = "auto",
        special_tokens: Mapping[str, str] | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
        max_chars: int,
    ) -> None:
        self.text = template  # its source
        self.special_tokens = dict(special_tokens or {})
        self.max_chars = max_chars
        self._default_kwargs = dict(default_kwargs or {})
        try:
            # transformers' own compiled template (cached per source), parsed for its AST as
            # vLLM's content-format detection parses it.
            compiled = chat_template_utils._compile_jinja_template(template)
            ast = compiled.environment.parse(template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{source}: the chat template does not compile: {e}") from e
        self._template_vars = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_as_parts = content_format == "openai"
        if content_format == "auto":
            try:
                self.content_as_parts = _loops_over_content(ast)
            except Exception:  # vLLM falls back to "string" when the walk fails
                self.content_as_parts = False
        self._names_developer = '"developer"' in template or "'developer'" in template

    def render(self, payload: Mapping[str, Any]) -> Rendered:
        """The rendered chat text, where its messages' text is in it, and whether it is encoded
        with the post-processor's special tokens."""
        if payload.get("chat_template") is not None:
            bad("a request chat_template is refused (vLLM: --trust-request-chat-template)")
        if payload.get("tools") is not None:
            bad("requests with tools are not rendered by the router")
        user_kwargs = payload.get("chat_template_kwargs")
        user_kwargs = {} if user_kwargs is None else user_kwargs
        if not isinstance(user_kwargs, Mapping):
            bad("chat_template_kwargs must be an object")
        refused = _REFUSED_KWARGS & user_kwargs.keys()
        if refused:
            bad(f"chat_template_kwargs {sorted(refused)} are not followed by the router")
        effort = payload.get("reasoning_effort")
        if effort is not None and not isinstance(effort, str):
            bad("reasoning_effort must be a string")
        documents = payload.get("documents")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(d, Mapping) for d in documents)
        ):
            bad("documents must be a list of objects")
        extra: dict[str, Any] = {
            "add_generation_prompt": flag(payload, "add_generation_prompt", True),
            "continue_final_message": flag(payload, "continue_final_message", False),
            "documents": documents,
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user_kwargs:
            extra["enable_thinking"] = effort != "none"
        server = _merge(self._default_kwargs, {"tokenize": False})
        kwargs = _merge(server, _merge(user_kwargs, extra))
        generation = kwargs.pop("add_generation_prompt", False)
        continue_final = kwargs.pop("continue_final_message", False)
        tokenize = kwargs.pop("tokenize", True)
        documents = kwargs.pop("documents", None)
        if continue_final and generation:
            bad("continue_final_message and add_generation_prompt cannot both be true")

        messages = payload.get("messages")
        check_input_size(content_chars(messages), self.max_chars)
        chat = conversation(messages, self.content_as_parts)
        if any(m["role"] == "developer" for m in chat) and not self._names_developer:
            chat = developer_as_system(chat)
        if continue_final:
            _check_final(chat, self.text)
        variables = {
            **self.special_tokens,
            **{
                k: v
                for k, v in kwargs.items()
                if k in self._template_vars and k not in _APPLY_PARAMS
            },
        }
        try:
            # What transformers' apply_chat_template(tokenize=False) runs, as vLLM calls it.
            # It returns (texts, generation indices), though annotated as returning a str.
            rendered: Any = chat_template_utils.render_jinja_template(
                conversations=[chat],
                tools=None,
                documents=documents,
                chat_template=self.text,
                continue_final_message=continue_final,
                add_generation_prompt=generation,
                **variables,
            )
        except Exception as e:
            raise TokenizerError(f"the chat template failed: {e}") from e
        text: str = rendered[0][0]
        spans, final = message_spans(text, chat)
        specials = not tokenize and flag(payload, "add_special_tokens", False)
        return Rendered(text, spans, final, specials)


def _check_final(chat: list[dict[str, Any]], template: str) -> None:
    """The request shapes transformers' continue_final_message refuses, said as a client's
    error before rendering (transformers raises a ValueError for most, a TypeError for one)."""
    final = chat[-1].get("content")
    if final is None:
        bad('continue_final_message is set but the final message has no "content"')
    if "content" not in template:
        bad("continue_final_message needs a template that renders content")
    if isinstance(final, list):
        if not any(isinstance(block, Mapping) and "text" in block for block in final):
            bad("continue_final_message: the final message has no text to continue")
    elif not isinstance(final, str):
        bad("continue_final_message: the final message's content is not text")


def message_spans(
    text: str, chat: list[dict[str, Any]]
) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """Where each message's text is in the rendered ``text``, in order (messages not found are
    left out), and the final message's span if it was found: the prefix cache looks prefixes up
    around them."""
    spans: list[tuple[int, int]] = []
    final: tuple[int, int] | None = None
    pos = 0
    for msg in chat:
        final = None
        found = needles(msg.get("content"))
        if found is None:
            continue
        head, tail = found
        at = text.find(head, pos)
        if at < 0:
            continue
        end = at + len(head) if head == tail else text.find(tail, at) + len(tail)
        if end >= at + len(head):
            final = (at, end)
            spans.append(final)
            pos = end
    return spans, final
