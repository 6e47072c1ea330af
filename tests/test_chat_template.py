"""Loss masks from real chat templates: exactly the assistant contents plus their end markers."""

import pytest
import tiny
from transformers import AutoTokenizer

from eaglepipe.chat_template import TemplateSkip, encode_chat, template_digest

LLAMA3 = (
    "<|begin_of_text|>"
    "{% if messages[0]['role'] != 'system' %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# SmolLM2's template: ChatML plus a default system prompt
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
KIMI = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{- m['content'] -}}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# Qwen3-like: assistant turns before the last user turn lose their thinking block in history
DROPS_THINKING = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
GENERATION_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
STYLES = {
    "llama3": (LLAMA3, "<|eot_id|>", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "chatml": (CHATML, "<|im_end|>", []),
    "kimi": (KIMI, "<|im_end|>", ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]),
}

SYSTEM = {"role": "system", "content": "you are a good help."}
TURNS = [
    {"role": "user", "content": "what is the time?"},
    {"role": "assistant", "content": "<think>the user asks the time. i do not know it.</think>I can not see a clock."},
    {"role": "user", "content": "tell me a number"},
    {"role": "assistant", "content": "It is 42, a good number!"},
    {"role": "user", "content": "and one more"},
    {"role": "assistant", "content": "Here is 7.\nThat is all."},
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny.make_tokenizer(d)
    return d


def tokenizer(base_dir, template, extra_special=()):
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    tok.add_tokens(list(extra_special), special_tokens=True)
    tok.chat_template = template
    return tok


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("style", sorted(STYLES))
def test_mask_is_exactly_assistant_content_and_end_marker(base_dir, style, with_system):
    template, end, special = STYLES[style]
    tok = tokenizer(base_dir, template, special)
    messages = ([SYSTEM] if with_system else []) + TURNS
    enc = encode_chat(tok, messages)
    assert len(enc.input_ids) == len(enc.loss_mask) and not enc.context_turns
    # the ids are the template's own tokenization of the whole conversation
    assert enc.input_ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    expected = [m["content"].strip() + end for m in messages if m["role"] == "assistant"]
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == expected
    # the default system prompt is context, never trained on
    assert "Kimi" not in "".join(masked_runs(tok, enc.input_ids, enc.loss_mask))


def test_slow_tokenizer_path_gives_the_same_mask(base_dir, monkeypatch):
    tok = tokenizer(base_dir, KIMI, STYLES["kimi"][2])
    fast = encode_chat(tok, TURNS)
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    assert encode_chat(tok, TURNS) == fast


def test_tokens_merging_across_a_turn_edge_are_detected_without_offsets(base_dir, monkeypatch):
    # "Assistant: " style header: its trailing space and the content's first word form one BPE token
    template = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n '")
    template = template.replace("message['role'] + '\n' +",
                                "message['role'] + '\n' + (' ' if message['role'] == 'assistant' else '') +")
    assert template.count("\n '") == 1 and template.count("' ' if") == 1
    tok = tokenizer(base_dir, template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the said"}]
    enc = encode_chat(tok, messages)  # offsets: the straddling token carries assistant text, so it is marked
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [" the said<|im_end|>"]
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    with pytest.raises(TemplateSkip) as e:
        encode_chat(tok, messages)
    assert e.value.reason == "tokens_cross_turn_edges"


def test_template_dropping_earlier_thinking_keeps_those_turns_as_context(base_dir):
    tok = tokenizer(base_dir, DROPS_THINKING)
    enc = encode_chat(tok, TURNS)
    # turn 1 renders without its thinking in history: it is not what the model generated there
    assert enc.context_turns == {"template_prefix_mismatch": 1}
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [TURNS[3]["content"] + "<|im_end|>",
                                                             TURNS[5]["content"] + "<|im_end|>"]
    text = tok.decode(enc.input_ids)
    assert "I can not see a clock." in text and "<think>" not in text
    # a last turn with thinking is rendered as generated, and is masked with its thinking block
    enc = encode_chat(tok, TURNS[:2])
    assert not enc.context_turns
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [TURNS[1]["content"] + "<|im_end|>"]


def test_template_rendering_every_turn_differently_is_skipped(base_dir):
    # numbers each turn with the conversation length: no prefix rendering matches the full one
    template = CHATML.replace("message['role'] + '\n'", "message['role'] + (messages|length|string) + '\n'")
    assert "messages|length" in template
    tok = tokenizer(base_dir, template)
    with pytest.raises(TemplateSkip) as e:
        encode_chat(tok, TURNS[:4])
    assert e.value.reason == "template_prefix_mismatch"
    with pytest.raises(TemplateSkip) as e:
        encode_chat(tokenizer(base_dir, CHATML), [{"role": "assistant", "content": "unprompted"}])
    assert e.value.reason == "leading_assistant_turn"


def test_leading_assistant_turn_is_context(base_dir):
    tok = tokenizer(base_dir, CHATML)
    messages = [{"role": "assistant", "content": "hello there"}] + TURNS[:2]
    enc = encode_chat(tok, messages)
    assert enc.context_turns == {"leading_assistant_turn": 1}
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [TURNS[1]["content"] + "<|im_end|>"]


def test_template_errors_and_no_assistant_turn_are_skips(base_dir):
    tok = tokenizer(base_dir, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateSkip) as e:
        encode_chat(tok, TURNS)
    assert e.value.reason == "template_error" and "roles must alternate" in str(e.value)
    tok = tokenizer(base_dir, CHATML)
    with pytest.raises(TemplateSkip) as e:
        encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert e.value.reason == "no_assistant_turn"


def test_generation_markers_use_transformers_assistant_mask(base_dir):
    tok = tokenizer(base_dir, GENERATION_MARKED)
    enc = encode_chat(tok, [SYSTEM] + TURNS)
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [m["content"] + "<|im_end|>" for m in TURNS
                                                             if m["role"] == "assistant"]


def test_template_digest_tracks_template_and_vocabulary(base_dir):
    a = template_digest(tokenizer(base_dir, CHATML))
    assert a == template_digest(tokenizer(base_dir, CHATML))
    assert a != template_digest(tokenizer(base_dir, KIMI))
    assert a != template_digest(tokenizer(base_dir, CHATML, ["<|new|>"]))
    tok = tokenizer(base_dir, CHATML)
    tok.chat_template = None
    with pytest.raises(SystemExit, match="no chat template"):
        template_digest(tok)
