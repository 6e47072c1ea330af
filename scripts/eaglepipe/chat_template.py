"""Tokenize a conversation with the target's own chat template and mark exactly the assistant tokens.

The loss mask covers what the model generates in an assistant turn: the content (thinking blocks
included) and its end-of-turn marker, never the role header or the separator after the marker.

Templates with ``{% generation %}`` markers: transformers' ``return_assistant_tokens_mask``.
Other templates (most, SmolLM2 and Kimi included): each assistant turn i is located by rendering
the prefix ``messages[:i]`` with the generation prompt (text up to and including the header) and
``messages[:i+1]`` (text through the turn); the turn's span lies between the two, with trailing
whitespace after the end marker dropped. The full conversation is tokenized once with offsets and
tokens overlapping a span are marked.

Templates whose rendering of a prefix is not a prefix of the full rendering (ones that drop the
thinking of earlier turns, number turns, inject changing text): such a turn renders differently in
history than when the model generated it, so its span cannot be located and it is not what the
model generates there. It stays in the sample as unmasked context, counted in
``Encoded.context_turns`` (as is a leading assistant turn, which has no prompt to locate it by);
if no assistant turn can be located the sample is skipped (``TemplateSkip``). A wrong mask is
never produced silently.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import NamedTuple

from jinja2 import TemplateError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateSkip(Exception):
    """The conversation cannot be rendered with a trustworthy mask; ``reason`` is a short count key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Encoded(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]
    context_turns: Counter  # assistant turns left unmasked, by reason


def chat_template_text(tokenizer) -> str:
    template = tokenizer.get_chat_template() if tokenizer.chat_template is not None else None
    if not template:
        raise SystemExit(f"tokenizer {tokenizer.name_or_path} has no chat template; a chat template is required")
    return template


def template_digest(tokenizer) -> str:
    """sha256 of the chat template and the vocabulary: equal digests tokenize chats identically."""
    h = hashlib.sha256(chat_template_text(tokenizer).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    return h.hexdigest()


def _render(tokenizer, messages, add_generation_prompt=False, **template_kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def encode_prompt(tokenizer, messages: list[dict], template_kwargs: dict) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt: what the target continues.

    ``template_kwargs`` reach the template as variables (e.g. ``enable_thinking``). The rendered
    text carries the template's own special tokens, so none are added again.
    """
    text = _render(tokenizer, messages, add_generation_prompt=True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]], Counter]:
    """The full rendering, the character spans of the locatable assistant turns, the others by reason."""
    full = _render(tokenizer, messages)
    spans, context = [], Counter()
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:  # no prompt precedes it (e.g. the second part of a split ShareGPT chat): nothing to locate it by
            context["leading_assistant_turn"] += 1
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (through.startswith(head) and full.startswith(through)):
            context["template_prefix_mismatch"] += 1
            continue
        end = max(len(head), len(through.rstrip()))
        if end > len(head):
            spans.append((len(head), end))
    return full, spans, context


def _mask_from_offsets(offsets, spans, n_chars) -> list[int]:
    inside = bytearray(n_chars + 1)
    for s, e in spans:
        inside[s:e] = b"\x01" * (e - s)
    # a token straddling a span edge carries assistant text, so it is marked
    return [int(e > s and any(inside[s:e])) for s, e in offsets]


def _mask_by_segments(tokenizer, text, spans, full_ids) -> list[int]:
    """Slow tokenizers have no offsets: tokenize the pieces between span edges and check they add up."""
    ids, mask, pos = [], [], 0
    for s, e in spans:
        for a, b, flag in ((pos, s, 0), (s, e, 1)):
            piece = tokenizer.encode(text[a:b], add_special_tokens=False) if b > a else []
            ids += piece
            mask += [flag] * len(piece)
        pos = e
    tail = tokenizer.encode(text[pos:], add_special_tokens=False) if pos < len(text) else []
    ids += tail
    mask += [0] * len(tail)
    if ids != full_ids:
        raise TemplateSkip("tokens_cross_turn_edges",
                           "the tokenizer merges text across an assistant turn edge, so the mask is ambiguous")
    return mask


def encode_chat(tokenizer, messages: list[dict]) -> Encoded:
    """Token ids and assistant loss mask of one conversation (see the module docstring)."""
    try:
        if GENERATION_MARKER.search(chat_template_text(tokenizer)):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return Encoded(list(out["input_ids"]), list(out["assistant_masks"]), Counter())
        text, spans, context = assistant_spans(tokenizer, messages)
    except (TemplateError, TypeError, ValueError) as e:  # raise_exception() and template bugs: skip one chat
        raise TemplateSkip("template_error", f"the chat template failed on this conversation: {e}") from e
    if not spans:
        if context:  # the most common reason names the skip
            raise TemplateSkip(context.most_common(1)[0][0], "no assistant turn could be located in the "
                               f"rendering ({', '.join(f'{k}={n}' for k, n in context.items())})")
        raise TemplateSkip("no_assistant_turn", "the conversation has no assistant turn with text")
    if tokenizer.is_fast:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return Encoded(enc["input_ids"], _mask_from_offsets(enc["offset_mapping"], spans, len(text)), context)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return Encoded(ids, _mask_by_segments(tokenizer, text, spans, ids), context)
