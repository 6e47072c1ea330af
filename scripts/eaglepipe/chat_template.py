"""Tokenize a conversation as the target renders it and mark exactly what the target generates.

The training template is the tokenizer's chat template, or a file overriding it (``data.chat_template``),
rendered with ``data.chat_template_kwargs`` (e.g. ``{thinking: true}``) and the record's ``tools``.

Each assistant turn i is located by two renderings: the prompt ``messages[:i]`` with the generation
prompt (what the target is given when it writes turn i) and ``messages[:i+1]`` (the conversation
through turn i). The turn is the text between the two: its reasoning as the template renders it,
the answer, tool calls and the end-of-turn marker; whitespace after the marker is not part of it (the
target stops at the marker). A template with ``{% generation %}`` blocks starts the turn at the
start of its block when that is later than the prompt; the turn still ends with its end marker,
whether the block wraps it or not. The loss mask covers exactly these turns. Within a turn, the
text up to the end of its reasoning is "thinking", the rest "answer" (counted apart in the stats).

A turn whose rendering through it is a prefix of the whole conversation's rendering is trained in
that one sample. Templates that render history differently from what the target generated (Qwen3
and Kimi drop the reasoning of earlier turns; Qwen3 adds an empty think block to the last turn
only) make the whole rendering wrong for such a turn: it becomes its own sample, the rendering
through it (``rerendered="own_sample"``, the default), or stays unmasked context ("context").

Nothing is left out silently: turns that are not trained (a leading assistant turn has no prompt,
an empty answer, a turn the template does not render after its prompt) and reasoning that the
template does not render for the trained turn are counted by reason, with their tokens; a
conversation with no trainable turn raises ``TemplateSkip``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from jinja2 import TemplateError
from transformers.utils.chat_template_utils import render_jinja_template

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
RERENDERED = ("own_sample", "context")


class TemplateSkip(Exception):
    """The conversation cannot be rendered with a trustworthy mask; ``reason`` is a short count key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Part(NamedTuple):
    turn: int  # index of the assistant message
    kind: str  # "thinking" or "answer"; "regenerated" for the target's token ids (tokenized_samples)


class Sample(NamedTuple):
    whole: bool  # the rendering of the whole conversation (else of the conversation through its one turn)
    turns: tuple[int, ...]  # the assistant messages trained in it
    input_ids: list[int]
    token_parts: list[int]  # per token: the index into Encoded.parts it trains, or -1

    @property
    def loss_mask(self) -> list[int]:
        return [int(p >= 0) for p in self.token_parts]


class Encoded(NamedTuple):
    samples: list[Sample]  # the whole conversation first when it trains a turn, then turns of their own
    parts: list[Part]
    turns: int  # assistant turns in the conversation
    untrained_turns: Counter  # reason -> assistant turns not trained
    untrained_tokens: Counter  # reason -> assistant tokens not trained (turns and unrendered reasoning)
    prompt_mismatches: int  # turns whose prompt differs from the tokenizer's own template's


class ChatTemplate:
    """The template a run trains with: the tokenizer's or an override file, with fixed kwargs."""

    def __init__(self, tokenizer, path: str | None = None, kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(kwargs or {})
        own = tokenizer.get_chat_template() if tokenizer.chat_template is not None else None
        if path:
            try:
                self.text = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise SystemExit(f"chat template file {path} cannot be read ({e})") from e
            # the prompts must be the ones the target is served with: compared turn by turn
            self.served = own if own != self.text else None
        else:
            if not own:
                raise SystemExit(f"tokenizer {tokenizer.name_or_path} has no chat template; set data.chat_template "
                                 "to a template file")
            self.text, self.served = own, None
        self.marked = bool(GENERATION_MARKER.search(self.text))

    def digest(self) -> str:
        """sha256 of template, kwargs and vocabulary: equal digests tokenize chats identically."""
        h = hashlib.sha256(self.text.encode())
        h.update(json.dumps(self.kwargs, sort_keys=True).encode())
        h.update(json.dumps(sorted(self.tokenizer.get_vocab().items()), ensure_ascii=False).encode())
        return h.hexdigest()

    def render(self, messages, tools=None, add_generation_prompt=False, template=None):
        """Text and ``{% generation %}`` character spans. render_jinja_template is what
        apply_chat_template calls; it is used directly for the spans, which apply_chat_template only
        returns as a token mask (and only with a fast tokenizer)."""
        texts, spans = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=template or self.text,
            return_assistant_tokens_mask=self.marked, add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens_map, **self.kwargs})
        return texts[0], spans[0] if spans else []

    def prompt_ids(self, messages, tools=None) -> list[int]:
        """Token ids of what the target continues: ``messages`` and the generation prompt. The
        rendering carries the template's own special tokens, so none are added again."""
        text, _ = self.render(messages, tools, add_generation_prompt=True)
        return token_ids(self.tokenizer, text)

    def count_tokens(self, text: str) -> int:
        return len(token_ids(self.tokenizer, text)) if text else 0


def token_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids, no special tokens added. Quiet (verbose=False): past the tokenizer's
    model_max_length transformers warns that running the sequence "will result in indexing errors",
    but the stages bound lengths themselves (data.max_length, regeneration's prompt bound) and never
    run such a sequence."""
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


def turn_text(message: dict) -> str:
    """What the assistant wrote in a turn, for counting the tokens of turns that are not trained."""
    calls = json.dumps(message["tool_calls"], ensure_ascii=False) if message.get("tool_calls") else ""
    return (message.get("reasoning_content") or "") + message["content"] + calls


class _Located(NamedTuple):
    turn: int
    text: str  # the rendering through the turn
    prompt_end: int  # text[:prompt_end] is the prompt of the turn
    start: int
    think_end: int  # == start when the turn has no rendered reasoning
    end: int


def _locate(template: ChatTemplate, messages, tools, i, untrained_tokens) -> _Located | str:
    """Turn i within the rendering through it, or the reason it cannot be trained."""
    m = messages[i]
    if i == 0:  # no prompt precedes it (e.g. the second part of a split ShareGPT chat)
        return "leading_assistant_turn"
    if not (m["content"].strip() or (m.get("reasoning_content") or "").strip() or m.get("tool_calls")):
        return "empty_answer"
    head, _ = template.render(messages[:i], tools, add_generation_prompt=True)
    through, blocks = template.render(messages[: i + 1], tools)
    if not through.startswith(head):
        return "template_prefix_mismatch"
    start = max([len(head)] + [s for s, _ in blocks[-1:]])  # the last block is this turn's
    end = len(through.rstrip())
    if end <= start:
        return "empty_answer"
    reasoning = (m.get("reasoning_content") or "").strip()
    think_end = start
    if reasoning:
        at = through.find(reasoning, start, end)
        if at < 0:
            untrained_tokens["reasoning_not_rendered"] += template.count_tokens(reasoning)
        else:
            think_end = at + len(reasoning)
    return _Located(i, through, len(head), start, think_end, end)


def _token_parts(tokenizer, text: str, spans: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and, per token, the part index of the span it overlaps (-1: none)."""
    if tokenizer.is_fast:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)  # see token_ids
        owner = [-1] * (len(text) + 1)
        for s, e, part in spans:
            owner[s:e] = [part] * (e - s)
        # a token straddling a span edge carries assistant text, so it is marked
        return enc["input_ids"], [next((p for p in owner[s:e] if p >= 0), -1) for s, e in enc["offset_mapping"]]
    # slow tokenizers have no offsets: tokenize the text between turn edges and check the pieces add
    # up. Within a turn (spans that touch: thinking, answer) the tokens of the first span's text come
    # first; a token straddling the edge between them is counted with the later span.
    turns = []
    for s, e, part in spans:
        if turns and turns[-1][1] == s:
            turns[-1][1] = e
            turns[-1][2].append((s, e, part))
        else:
            turns.append([s, e, [(s, e, part)]])
    ids, parts, pos = [], [], 0
    for s, e, inner in turns + [[len(text), len(text), []]]:
        gap = token_ids(tokenizer, text[pos:s]) if s > pos else []
        piece = token_ids(tokenizer, text[s:e]) if e > s else []
        labels = []
        for a, b, part in inner[:-1]:
            sub = token_ids(tokenizer, text[a:b])
            labels += [part] * (len(sub) - (sub != piece[len(labels): len(labels) + len(sub)]))
        labels += [inner[-1][2]] * (len(piece) - len(labels)) if inner else []
        ids += gap + piece
        parts += [-1] * len(gap) + labels
        pos = e
    if ids != token_ids(tokenizer, text):
        raise TemplateSkip("tokens_cross_turn_edges",
                           "the tokenizer merges text across an assistant turn edge, so the mask is ambiguous")
    return ids, parts


def encode_chat(template: ChatTemplate, messages: list[dict], tools=None,
                rerendered: str = "own_sample") -> Encoded:
    """The samples of one conversation with their per-token parts (see the module docstring)."""
    untrained_turns, untrained_tokens = Counter(), Counter()
    in_full, own, mismatches = [], [], 0
    try:
        full, _ = template.render(messages, tools)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            loc = _locate(template, messages, tools, i, untrained_tokens)
            if isinstance(loc, str):
                untrained_turns[loc] += 1
                untrained_tokens[loc] += template.count_tokens(turn_text(m))
                continue
            if template.served is not None:
                mismatches += loc.text[: loc.prompt_end] != template.render(messages[:i], tools, True, template.served)[0]
            if full.startswith(loc.text):
                in_full.append(loc)
            elif rerendered == "own_sample":
                own.append(loc)
            else:
                untrained_turns["history_rerendered"] += 1
                untrained_tokens["history_rerendered"] += template.count_tokens(loc.text[loc.start:loc.end])
    except (TemplateError, TypeError, ValueError, KeyError) as e:  # raise_exception() and template bugs
        raise TemplateSkip("template_error", f"the chat template failed on this conversation: {e}") from e
    if not in_full and not own:
        if untrained_turns:  # the most common reason names the skip
            raise TemplateSkip(untrained_turns.most_common(1)[0][0], "no assistant turn can be trained ("
                               + ", ".join(f"{k}={n}" for k, n in untrained_turns.items()) + ")")
        raise TemplateSkip("no_assistant_turn", "the conversation has no assistant turn")
    parts, samples = [], []
    for whole, text, located in ([(True, full, in_full)] if in_full else []) + [(False, loc.text, [loc]) for loc in own]:
        spans = []
        for loc in located:
            for kind, s, e in (("thinking", loc.start, loc.think_end), ("answer", loc.think_end, loc.end)):
                if e > s:
                    spans.append((s, e, len(parts)))
                    parts.append(Part(loc.turn, kind))
        ids, token_parts = _token_parts(template.tokenizer, text, spans)
        samples.append(Sample(whole, tuple(loc.turn for loc in located), ids, token_parts))
    n_turns = sum(m["role"] == "assistant" for m in messages)
    return Encoded(samples, parts, n_turns, untrained_turns, untrained_tokens, mismatches)
