"""Loss masks from real chat templates: exactly what the target generates in each assistant turn."""


import pytest
import tiny
from transformers import AutoTokenizer

from eaglepipe.chat_data import normalize
from eaglepipe.chat_template import ChatTemplate, TemplateSkip, encode_chat

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


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """A tokenizer directory per template family of tests/tiny.py (its special tokens, its template)."""
    dirs = {}
    for family, kwargs in tiny.FAMILIES.items():
        dirs[family] = tmp_path_factory.mktemp(family)
        tiny.make_tokenizer(dirs[family], **kwargs)
    return dirs


def tokenizer(base_dir, template, extra_special=()):
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    tok.add_tokens(list(extra_special), special_tokens=True)
    tok.chat_template = template
    return tok


def encode(tok, messages, path=None, kwargs=None, **kw):
    return encode_chat(ChatTemplate(tok, path, kwargs), messages, **kw)


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    return [tok.decode(r, skip_special_tokens=False) for r in tiny.masked_runs(ids, mask)]


def all_runs(tok, enc):
    """Masked runs of every sample, in sample order."""
    return [r for s in enc.samples for r in masked_runs(tok, s.input_ids, s.loss_mask)]


def chat(*turns, tools=None):
    """Messages as chat_data normalizes them (inline think blocks split, tool calls kept)."""
    return normalize({"messages": list(turns), "tools": tools}, "test:1", "t").messages


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("style", sorted(STYLES))
def test_mask_is_exactly_assistant_content_and_end_marker(base_dir, style, with_system):
    template, end, special = STYLES[style]
    tok = tokenizer(base_dir, template, special)
    messages = ([SYSTEM] if with_system else []) + TURNS
    enc = encode(tok, messages)
    assert len(enc.samples) == 1 and not enc.untrained_turns and enc.samples[0].whole
    sample = enc.samples[0]
    # the ids are the template's own tokenization of the whole conversation
    assert sample.input_ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    expected = [m["content"].strip() + end for m in messages if m["role"] == "assistant"]
    assert masked_runs(tok, sample.input_ids, sample.loss_mask) == expected
    # the default system prompt is context, never trained on
    assert "Kimi" not in "".join(masked_runs(tok, sample.input_ids, sample.loss_mask))
    if style == "llama3":
        assert sample.input_ids.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == 1


def test_slow_tokenizer_path_gives_the_same_mask(base_dir, monkeypatch):
    tok = tokenizer(base_dir, KIMI, STYLES["kimi"][2])
    fast = encode(tok, TURNS)
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    assert encode(tok, TURNS) == fast


def test_tokens_merging_across_a_turn_edge_are_detected_without_offsets(base_dir, monkeypatch):
    # "Assistant: " style header: its trailing space and the content's first word form one BPE token
    template = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n '")
    template = template.replace("message['role'] + '\n' +",
                                "message['role'] + '\n' + (' ' if message['role'] == 'assistant' else '') +")
    assert template.count("\n '") == 1 and template.count("' ' if") == 1
    tok = tokenizer(base_dir, template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the said"}]
    enc = encode(tok, messages)  # offsets: the straddling token carries assistant text, so it is marked
    assert all_runs(tok, enc) == [" the said<|im_end|>"]
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    with pytest.raises(TemplateSkip) as e:
        encode(tok, messages)
    assert e.value.reason == "tokens_cross_turn_edges"


def test_template_rendering_every_turn_differently_is_skipped(base_dir):
    # numbers each turn with the conversation length: no turn renders after its own prompt
    template = CHATML.replace("message['role'] + '\n'", "message['role'] + (messages|length|string) + '\n'")
    assert "messages|length" in template
    tok = tokenizer(base_dir, template)
    with pytest.raises(TemplateSkip) as e:
        encode(tok, TURNS[:4])
    assert e.value.reason == "template_prefix_mismatch"
    with pytest.raises(TemplateSkip) as e:
        encode(tokenizer(base_dir, CHATML), [{"role": "assistant", "content": "unprompted"}])
    assert e.value.reason == "leading_assistant_turn"


def test_leading_assistant_turn_and_empty_answers_are_counted_not_trained(base_dir):
    tok = tokenizer(base_dir, CHATML)
    messages = [{"role": "assistant", "content": "hello there"}] + TURNS[:2] + [
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": "  "}]
    enc = encode(tok, messages)
    assert enc.untrained_turns == {"leading_assistant_turn": 1, "empty_answer": 1} and enc.turns == 3
    assert enc.untrained_tokens["leading_assistant_turn"] == len(tok.encode("hello there"))
    assert all_runs(tok, enc) == [TURNS[1]["content"] + "<|im_end|>"]  # no lone end marker
    with pytest.raises(TemplateSkip) as e:
        encode(tok, TURNS[:1] + [{"role": "assistant", "content": ""}])
    assert e.value.reason == "empty_answer"


def test_template_errors_and_no_assistant_turn_are_skips(base_dir):
    tok = tokenizer(base_dir, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateSkip) as e:
        encode(tok, TURNS)
    assert e.value.reason == "template_error" and "roles must alternate" in str(e.value)
    with pytest.raises(TemplateSkip) as e:
        encode(tokenizer(base_dir, CHATML), [{"role": "user", "content": "hi"}])
    assert e.value.reason == "no_assistant_turn"


def test_template_digest_tracks_template_kwargs_and_vocabulary(base_dir, tmp_path):
    a = ChatTemplate(tokenizer(base_dir, CHATML)).digest()
    assert a == ChatTemplate(tokenizer(base_dir, CHATML)).digest()
    assert a != ChatTemplate(tokenizer(base_dir, KIMI)).digest()
    assert a != ChatTemplate(tokenizer(base_dir, CHATML, ["<|new|>"])).digest()
    assert a != ChatTemplate(tokenizer(base_dir, CHATML), kwargs={"enable_thinking": False}).digest()
    override = tmp_path / "t.jinja"
    override.write_text(KIMI)
    assert ChatTemplate(tokenizer(base_dir, CHATML), str(override)).digest() == ChatTemplate(tokenizer(base_dir, KIMI)).digest()
    tok = tokenizer(base_dir, CHATML)
    tok.chat_template = None
    with pytest.raises(SystemExit, match="no chat template; set data.chat_template"):
        ChatTemplate(tok)
    assert ChatTemplate(tok, str(override)).text == KIMI
    with pytest.raises(SystemExit, match="cannot be read"):
        ChatTemplate(tok, str(tmp_path / "missing.jinja"))


# --- the template families of tests/tiny.py: thinking, tools, history re-rendering -------------

THINK = [
    {"role": "user", "content": "what is the time?"},
    {"role": "assistant", "reasoning_content": "the user asks the time. i do not know it.",
     "content": "I can not see a clock."},
    {"role": "user", "content": "tell me a number"},
    {"role": "assistant", "content": "<think>a small one is good.</think>It is 42, a good number!"},
    {"role": "user", "content": "and one more"},
    {"role": "assistant", "reasoning_content": "one more number.", "content": "Here is 7.\nThat is all."},
]
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                           "parameters": {"type": "object", "properties": {}}}}]
TOOL_CHAT = [
    {"role": "user", "content": "what is the time?"},
    {"role": "assistant", "content": None, "reasoning_content": "i must look.",
     "tool_calls": [{"id": "functions.get_time:0", "type": "function",
                     "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "it is 4"},
    {"role": "assistant", "content": "It is 4."},
]


def test_kimi_k25_own_template_cannot_render_the_trained_turn_s_reasoning(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["kimi-k2.5"]))
    messages = chat(*THINK)
    enc = encode(tok, messages)
    # every turn renders "<think></think>answer" after a prompt ending "<think>": reasoning is counted, not trained
    assert all_runs(tok, enc) == ["</think>" + m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert enc.untrained_tokens["reasoning_not_rendered"] == sum(
        len(tok.encode(m["reasoning_content"])) for m in messages if m.get("reasoning_content"))


def test_kimi_k25_training_template_trains_reasoning_as_kimi_generates_it(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["kimi-k2.5"]))
    messages = chat(*THINK)
    enc = encode(tok, messages, str(tiny.KIMI_TRAIN_TEMPLATE))
    assert enc.prompt_mismatches == 0  # the prompts are Kimi's own
    assert not enc.untrained_turns and not enc.untrained_tokens
    # the last turn in the whole conversation; the earlier ones (history drops their reasoning) alone
    assert [(s.whole, s.turns) for s in enc.samples] == [(True, (5,)), (False, (1,)), (False, (3,))]
    expected = {i: messages[i]["reasoning_content"] + "</think>" + messages[i]["content"] + "<|im_end|>"
                for i in (1, 3, 5)}
    assert all_runs(tok, enc) == [expected[5], expected[1], expected[3]]
    assert "</think><think>" not in "".join(tok.decode(s.input_ids) for s in enc.samples)
    for s in enc.samples[1:]:  # a turn's own sample is its prompt as Kimi renders it, then the turn
        i = s.turns[0]
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        assert tok.decode(s.input_ids) == prompt + expected[i]
    kinds = [(enc.parts[p].kind, tok.decode([t])) for s in enc.samples[:1] for t, p in zip(s.input_ids, s.token_parts) if p >= 0]
    assert "".join(t for k, t in kinds if k == "thinking") == messages[5]["reasoning_content"]
    assert "".join(t for k, t in kinds if k == "answer") == "</think>" + messages[5]["content"] + "<|im_end|>"


def test_kimi_k25_kwargs_reach_the_template(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["kimi-k2.5"]))
    messages = chat(THINK[0], {"role": "assistant", "content": "I can not see a clock."})
    thinking = encode(tok, messages)
    instant = encode(tok, messages, kwargs={"thinking": False})
    assert all_runs(tok, thinking) == ["</think>I can not see a clock.<|im_end|>"]
    # thinking off: the prompt ends "<think></think>", the model writes the answer only
    assert all_runs(tok, instant) == ["I can not see a clock.<|im_end|>"]
    # the training template renders the reasoning, which cannot follow a prompt that closed the think
    # block: counted, not trained wrongly
    with pytest.raises(TemplateSkip) as e:
        encode(tok, chat(*THINK[:2]), str(tiny.KIMI_TRAIN_TEMPLATE), kwargs={"thinking": False})
    assert e.value.reason == "template_prefix_mismatch"


def test_kimi_k25_tool_calls_are_trained(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["kimi-k2.5"]))
    messages = chat(*TOOL_CHAT, tools=TOOLS)
    enc = encode(tok, messages, str(tiny.KIMI_TRAIN_TEMPLATE), tools=TOOLS)
    assert enc.prompt_mismatches == 0 and not enc.untrained_turns
    call = ("i must look.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
            "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    assert all_runs(tok, enc) == [call, "</think>It is 4.<|im_end|>"]
    assert 'tool_declare<|im_middle|>[{"type":"function"' in tok.decode(enc.samples[0].input_ids)


def test_qwen3_keeps_every_turn_of_a_multi_turn_chat(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["qwen3"]))
    messages = chat(*THINK)
    enc = encode(tok, messages)
    assert not enc.untrained_turns and not enc.untrained_tokens
    expected = {i: f"<think>\n{messages[i]['reasoning_content']}\n</think>\n\n{messages[i]['content']}<|im_end|>"
                for i in (1, 3, 5)}
    assert all_runs(tok, enc) == [expected[5], expected[1], expected[3]]
    assert [s.whole for s in enc.samples] == [True, False, False]
    # the rendering through each turn is the official template's, as the target sees it
    for s in enc.samples:
        assert s.input_ids == tok.apply_chat_template(messages[: s.turns[0] + 1], tokenize=True, return_dict=False)
    # as context of the whole conversation instead: only the last turn is trained, the rest counted
    enc = encode(tok, messages, rerendered="context")
    assert len(enc.samples) == 1 and enc.untrained_turns == {"history_rerendered": 2}
    assert enc.untrained_tokens["history_rerendered"] > 0


def test_qwen3_tool_calls_and_enable_thinking(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["qwen3"]))
    messages = chat(*TOOL_CHAT, tools=TOOLS)
    enc = encode(tok, messages, tools=TOOLS)
    assert not enc.untrained_turns
    assert sorted(all_runs(tok, enc)) == sorted([
        '<think>\ni must look.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 4.<|im_end|>"])
    assert "# Tools" in tok.decode(enc.samples[0].input_ids)
    # enable_thinking=false: the prompt carries the empty think block, the turn is the answer alone
    enc = encode(tok, chat(*THINK[:1], {"role": "assistant", "content": "No clock."}),
                 kwargs={"enable_thinking": False})
    assert all_runs(tok, enc) == ["No clock.<|im_end|>"]


def test_llama31_header_excluded_eot_included_one_bos_and_tool_calls(family_dirs):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["llama3.1"]))
    messages = chat({"role": "system", "content": "be brief."}, *TURNS[:4])
    enc = encode(tok, messages)
    sample = enc.samples[0]
    assert len(enc.samples) == 1
    assert sample.input_ids.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == 1
    assert masked_runs(tok, sample.input_ids, sample.loss_mask) == [
        "I can not see a clock.<|eot_id|>", "It is 42, a good number!<|eot_id|>"]
    enc = encode(tok, chat(*TOOL_CHAT, tools=TOOLS), tools=TOOLS)
    assert all_runs(tok, enc) == ['{"name": "get_time", "parameters": "{}"}<|eot_id|>', "It is 4.<|eot_id|>"]


@pytest.mark.parametrize("slow", [False, True])
def test_generation_block_mask_ends_with_the_end_marker(family_dirs, monkeypatch, slow):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["generation"]))
    if slow:  # no offsets and no transformers assistant mask: the same spans by segments
        monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    enc = encode(tok, [SYSTEM] + TURNS)
    assert all_runs(tok, enc) == [m["content"] + "<|im_end|>" for m in TURNS if m["role"] == "assistant"]


def test_generation_block_starts_the_turn_when_later_than_the_prompt(family_dirs):
    # the block excludes a fixed "Answer: " the template writes at the start of each turn
    template = tiny.GENERATION_TEMPLATE.replace("{% generation %}", "Answer: {% generation %}")
    tok = AutoTokenizer.from_pretrained(str(family_dirs["generation"]))
    tok.chat_template = template
    enc = encode(tok, TURNS[:2])
    assert all_runs(tok, enc) == [TURNS[1]["content"] + "<|im_end|>"]


def test_override_file_prompts_are_compared_with_the_tokenizer_template(family_dirs, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["generation"]))
    same = tmp_path / "same.jinja"  # the tokenizer's template without generation blocks: the same prompts
    same.write_text(tiny.GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    enc = encode(tok, TURNS, str(same))
    assert enc.prompt_mismatches == 0 and len(enc.samples) == 1
    other = tmp_path / "other.jinja"  # a blank line after every turn: every prompt differs
    other.write_text(same.read_text().replace("{{ '\\n' }}{% endfor %}", "{{ '\\n\\n' }}{% endfor %}"))
    assert other.read_text() != same.read_text()
    assert encode(tok, TURNS, str(other)).prompt_mismatches == 3


def test_slow_tokenizer_gives_the_same_samples_with_thinking(family_dirs, monkeypatch):
    tok = AutoTokenizer.from_pretrained(str(family_dirs["kimi-k2.5"]))
    messages = chat(*THINK)
    fast = encode(tok, messages, str(tiny.KIMI_TRAIN_TEMPLATE))
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    slow = encode(tok, messages, str(tiny.KIMI_TRAIN_TEMPLATE))
    assert [(s.input_ids, s.loss_mask) for s in slow.samples] == [(s.input_ids, s.loss_mask) for s in fast.samples]

    def thinking(enc):
        return [sum(enc.parts[p].kind == "thinking" for p in s.token_parts if p >= 0) for s in enc.samples]

    # without offsets, a token straddling the reasoning's end counts as answer
    assert all(0 <= f - s <= 1 for f, s in zip(thinking(fast), thinking(slow))) and min(thinking(slow)) > 0


def test_a_conversation_past_model_max_length_is_encoded_without_transformers_indexing_warning(base_dir, monkeypatch):
    """Stages bound lengths themselves (data.max_length, regeneration's prompt bound); transformers'
    "will result in indexing errors" warning about model_max_length would alarm over a sequence no
    model runs."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        def warned(run) -> bool:
            records.clear()
            tok = tokenizer(base_dir, CHATML)
            tok.model_max_length = 8
            run(tok)
            return any("indexing errors" in r.getMessage() for r in records)

        text = "<|im_start|>user\n" + "many words here " * 20 + "<|im_end|>\n"
        assert warned(lambda tok: tok.encode(text, add_special_tokens=False))  # what the stages avoid
        enc = []
        assert not warned(lambda tok: enc.append(encode(tok, TURNS)))
        assert len(enc[0].samples[0].input_ids) > 8
        assert not warned(lambda tok: ChatTemplate(tok).prompt_ids(TURNS[:1]))
        monkeypatch.setattr(type(tokenizer(base_dir, CHATML)), "is_fast", property(lambda self: False))
        assert not warned(lambda tok: encode(tok, TURNS))  # the slow tokenizers' path
    finally:
        logger.removeHandler(handler)
