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


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        k = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(k)) + rng.choice([".", "?", "!"]))
    lines += ["0123456789 " * 3, "Hello, world! What is 2+2? It is 4."]
    return lines


def make_tokenizer(out_dir: str | Path, vocab_size: int = 400, chat_template: str = CHATML_TEMPLATE):
    """Byte-level BPE trained on a small corpus, ChatML special tokens, saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def make_llama(out_dir: str | Path, num_layers: int = 6, hidden: int = 64, vocab: int = 400, seed: int = 0,
               dtype=torch.float32, tokenizer: bool = True) -> Path:
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
        make_tokenizer(out_dir, vocab_size=vocab)
    return out_dir


def make_deepseek_v3(out_dir: str | Path, num_layers: int = 4, hidden: int = 64, vocab: int = 400,
                     seed: int = 0, dtype=torch.float32, tokenizer: bool = True) -> Path:
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
        make_tokenizer(out_dir, vocab_size=vocab)
    return out_dir


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
