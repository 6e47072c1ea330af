"""Tiny random-weight targets with a locally trained tokenizer: real loading code, no model hub."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATES = Path(__file__).resolve().parents[1] / "config" / "templates"
KIMI_TRAIN_TEMPLATE = TEMPLATES / "kimi-k2.5-train.jinja"
_KIMI_TRAIN_RULE = "messages|length - (2 if messages and messages[-1]['role'] == 'assistant' else 1)"


def kimi_k25_template() -> str:
    """Kimi-K2.5's own template: the shipped training template with Kimi's history rule (every
    assistant turn up to the last one without tool calls loses its reasoning, a final one included)."""
    text = KIMI_TRAIN_TEMPLATE.read_text()
    assert text.count(_KIMI_TRAIN_RULE) == 1
    return text.replace(_KIMI_TRAIN_RULE, "messages|length - 1")


# Qwen3's official template, written after Qwen/Qwen3-8B's tokenizer_config.json (revision 895c8d17):
# thinking of the turns after the last user query only, an empty think block on the last turn, tool
# calls as <tool_call> JSON
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3.1's template (meta-llama/Llama-3.1-8B-Instruct), without the built-in tools (ipython)
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

# a {% generation %} block that wraps the content only: the end marker after it is still the turn's
GENERATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' }}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
KIMI_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
LLAMA3_TOKENS = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
FAMILIES = {  # make_tokenizer arguments of each template family's tiny target
    "kimi-k2.5": {"chat_template": kimi_k25_template(), "special_tokens": KIMI_TOKENS},
    "qwen3": {"chat_template": QWEN3_TEMPLATE,
              "special_tokens": SPECIAL_TOKENS + ["<think>", "</think>", "<tool_call>", "</tool_call>"]},
    "llama3.1": {"chat_template": LLAMA31_TEMPLATE, "special_tokens": LLAMA3_TOKENS, "eos": "<|eot_id|>",
                 "bos": "<|begin_of_text|>"},
    "generation": {"chat_template": GENERATION_TEMPLATE},
}

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here must big "
    "high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country"
).split()


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The token ids of each maximal run of masked (loss_mask 1) tokens, in order."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        k = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(k)) + rng.choice([".", "?", "!"]))
    lines += ["0123456789 " * 3, "Hello, world! What is 2+2? It is 4."]
    return lines


def make_tokenizer(out_dir: str | Path, vocab_size: int = 400, chat_template: str = CHATML_TEMPLATE,
                   special_tokens: list[str] = SPECIAL_TOKENS, eos: str = "<|im_end|>", bos: str | None = None):
    """Byte-level BPE trained on a small corpus, with the given special tokens, saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        bos_token=bos,
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def make_llama(out_dir: str | Path, num_layers: int = 6, hidden: int = 64, vocab: int = 400, seed: int = 0,
               dtype=torch.float32, tokenizer: bool = True, family: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(str(out_dir))
    if tokenizer:
        make_tokenizer(out_dir, vocab_size=vocab, **FAMILIES.get(family, {}))
    return out_dir


def make_deepseek_v3(out_dir: str | Path, num_layers: int = 4, hidden: int = 64, vocab: int = 400,
                     seed: int = 0, dtype=torch.float32, tokenizer: bool = True, family: str | None = None) -> Path:
    """DeepseekV3 in miniature (MLA + MoE, the Kimi-K2.5 architecture)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
        # as in the real DeepSeek-V3 / Kimi-K2.5 config.json (vLLM reads them)
        scoring_func="sigmoid", topk_method="noaux_tc",
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(str(out_dir))
    if tokenizer:
        make_tokenizer(out_dir, vocab_size=vocab, **FAMILIES.get(family, {}))
    return out_dir


def make_target(out_dir: str | Path, family: str) -> Path:
    """A tiny target of a template family: DeepseekV3 for Kimi-K2.5, LLaMA otherwise."""
    make = make_deepseek_v3 if family == "kimi-k2.5" else make_llama
    return make(out_dir, num_layers=2, family=family)


def make_chats(path: str | Path, n: int = 40, seed: int = 0, sharegpt: bool = False) -> Path:
    """A JSONL chat file: n conversations of 1-3 user/assistant exchanges, some with a system turn."""
    rng = random.Random(seed)
    lines = corpus(n * 8, seed=seed)
    with open(path, "w") as f:
        for i in range(n):
            conv = []
            if i % 3 == 0:
                conv.append(("system", "you are a good help."))
            for _ in range(rng.randint(1, 3)):
                conv.append(("user", rng.choice(lines)))
                conv.append(("assistant", " ".join(rng.choice(lines) for _ in range(rng.randint(1, 4)))))
            if sharegpt:
                role = {"system": "system", "user": "human", "assistant": "gpt"}
                rec = {"id": f"c{i}", "conversations": [{"from": role[r], "value": c} for r, c in conv]}
            else:
                rec = {"id": f"c{i}", "conversations": [{"role": r, "content": c} for r, c in conv]}
            f.write(json.dumps(rec) + "\n")
    return Path(path)


def make_tokenized(path: str | Path, n: int, vocab: int, lengths: tuple[int, int] = (4, 40), seed: int = 0,
                   prefix: str = "s") -> Path:
    """A tokenized JSONL as prepare_data writes it: {id, input_ids, loss_mask}, random ids and lengths."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            t = rng.randint(*lengths)
            f.write(json.dumps({"id": f"{prefix}{i}", "input_ids": [rng.randrange(vocab) for _ in range(t)],
                                "loss_mask": [rng.randint(0, 1) for _ in range(t)]}) + "\n")
    return Path(path)


TOOL_SPEC = {"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                              "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


def make_thinking_chats(path: str | Path, n: int = 40, seed: int = 0) -> Path:
    """A JSONL of agentic chats as thinking models export them: 1-3 exchanges, assistant reasoning as
    ``reasoning_content`` or an inline ``<think>`` block (some turns without), every third chat a tool
    call (assistant ``tool_calls`` with null content, a ``tool`` turn, the answer) with top-level ``tools``."""
    rng = random.Random(seed)
    lines = corpus(n * 12, seed=seed)

    def say(k):
        return " ".join(rng.choice(lines) for _ in range(k))

    with open(path, "w") as f:
        for i in range(n):
            rec = {"id": f"t{i}", "messages": [{"role": "system", "content": "you are a good help."}] if i % 4 == 0 else []}
            for j in range(rng.randint(1, 3)):
                rec["messages"].append({"role": "user", "content": say(1)})
                thought, answer = say(rng.randint(1, 3)), say(rng.randint(1, 2))
                if i % 3 == 0 and j == 0:
                    rec["tools"] = [TOOL_SPEC]
                    rec["messages"] += [
                        {"role": "assistant", "content": None, "reasoning_content": thought, "tool_calls": [
                            {"id": f"functions.lookup:{j}", "type": "function",
                             "function": {"name": "lookup", "arguments": json.dumps({"word": rng.choice(WORDS)})}}]},
                        {"role": "tool", "tool_call_id": f"functions.lookup:{j}", "content": say(1)}]
                    thought = say(1)
                style = rng.random()
                if style < 0.5:
                    rec["messages"].append({"role": "assistant", "content": answer, "reasoning_content": thought})
                elif style < 0.8:
                    rec["messages"].append({"role": "assistant", "content": f"<think>{thought}</think>{answer}"})
                else:
                    rec["messages"].append({"role": "assistant", "content": answer})
            f.write(json.dumps(rec) + "\n")
    return Path(path)


def make_workflow_inputs(out_dir: str | Path) -> None:
    """What tests/configs/*.yaml name under results/tiny-inputs: the targets and the 24 chats the
    whole-workflow tests make for themselves."""
    out_dir = Path(out_dir)
    make_llama(out_dir / "llama")
    make_deepseek_v3(out_dir / "dsv3", num_layers=6)
    make_chats(out_dir / "chats.jsonl", n=24)


if __name__ == "__main__":  # python tests/tiny.py results/tiny-inputs
    import sys

    make_workflow_inputs(sys.argv[1])
