"""Text generation engines behind one small interface: ``submit`` a request, ``step`` for finished ones.

``VLLMGenerator`` drives the engine under vLLM's ``LLM`` with its request stream
(``llm_engine.add_request`` with our own request ids, which the outputs carry back, and ``step()``,
as extract_vllm does): requests are added as soon as they are known (a conversation's next turn
right after its previous answer), so continuous batching keeps the engine full, where
``generate()`` on windows would drain it at every window's end. vLLM is imported lazily (CPU users
do not have it). Calls checked against the vLLM 0.26.0 wheel: ``SamplingParams(temperature,
top_p, seed, max_tokens, stop_token_ids, detokenize)``; a finished ``RequestOutput`` carries
``outputs[0].token_ids`` (the stop token included) and ``finish_reason`` "stop" / "length".

``HFGenerator`` runs transformers' ``generate`` one request at a time (CPU tests, tiny targets):
seeded with ``torch.manual_seed`` per request, so answers do not depend on the order requests run in.
"""

from __future__ import annotations

import gc
from collections import deque
from functools import partial
from typing import NamedTuple

import torch

from .vllm_env import kv_cache_kwargs, set_vllm_env_defaults


class Sampling(NamedTuple):
    temperature: float  # 0 = greedy
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]  # the tokens that end the target's turn


class Finished(NamedTuple):
    request_id: str
    token_ids: list[int]  # the completion, its stop token included
    finish_reason: str  # "stop" or "length"; anything else is an engine failure


def stop_token_ids(tokenizer, model: str, revision: str | None, trust_remote_code: bool) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence token and the generation config's: any of them ends a turn."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        gen = GenerationConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except OSError:  # no generation_config.json: the tokenizer's token alone
        gen = None
    if gen is not None and gen.eos_token_id is not None:
        ids |= {gen.eos_token_id} if isinstance(gen.eos_token_id, int) else set(gen.eos_token_id)
    if not ids:
        raise SystemExit(f"{model}: neither the tokenizer nor generation_config.json names an end-of-sequence "
                         "token, so no generated answer could end")
    return tuple(sorted(ids))


class HFGenerator:
    # conversations worth keeping open: it runs one request at a time, so more would only delay
    # the parts (the resume points) without speeding anything up
    lookahead = 1

    def __init__(self, model: str, sampling: Sampling, device: str = "cpu", dtype: str = "float32",
                 revision: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        compute = torch.float32 if self.device.type == "cpu" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code, dtype=compute).to(self.device).eval()
        self.sampling = sampling
        self.queue: deque[tuple[str, list[int], int]] = deque()

    def submit(self, request_id: str, prompt_ids: list[int], seed: int) -> None:
        self.queue.append((request_id, prompt_ids, seed))

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        if not self.queue:
            return []
        request_id, prompt_ids, seed = self.queue.popleft()
        s = self.sampling
        torch.manual_seed(seed)
        sample = s.temperature > 0
        out = self.model.generate(
            torch.tensor([prompt_ids], device=self.device), attention_mask=None,
            max_new_tokens=s.max_new_tokens, do_sample=sample,
            temperature=s.temperature if sample else None, top_p=s.top_p if sample else None, top_k=None,
            eos_token_id=list(s.stop_token_ids), pad_token_id=s.stop_token_ids[0],
        )[0, len(prompt_ids):].tolist()
        stops = set(s.stop_token_ids)
        end = next((i + 1 for i, t in enumerate(out) if t in stops), None)
        return [Finished(request_id, out[:end] if end else out, "stop" if end else "length")]

    def close(self) -> None:
        del self.model
        gc.collect()


class VLLMGenerator:
    """``load`` starts the engine; the constructor takes one already made (tests give a stand-in)."""

    # conversations kept open: well above the scheduler's batch (max_num_seqs, 1024 at most by
    # default) so it stays full while conversations wait for their next turn and parts finish
    lookahead = 4096

    def __init__(self, llm, sampling: Sampling, make_params):
        self.llm, self.engine, self.sampling, self.make_params = llm, llm.llm_engine, sampling, make_params

    @classmethod
    def load(cls, model: str, sampling: Sampling, dtype: str, tensor_parallel_size: int = 1,
             max_model_len: int = 8192, gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
             revision: str | None = None, trust_remote_code: bool = False,
             kv_cache_gib: float | None = None) -> "VLLMGenerator":
        set_vllm_env_defaults()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = LLM(
            model=model, revision=revision, trust_remote_code=trust_remote_code, skip_tokenizer_init=True,
            dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, seed=0,
            **kv_cache_kwargs(kv_cache_gib),
        )
        # detokenize=False: the engine has no tokenizer (skip_tokenizer_init); we decode ourselves
        return cls(llm, sampling, partial(SamplingParams, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY))

    def submit(self, request_id: str, prompt_ids: list[int], seed: int) -> None:
        s = self.sampling
        # stop_token_ids given explicitly: without a tokenizer vLLM knows only generation_config's
        params = self.make_params(temperature=s.temperature, top_p=s.top_p, seed=seed, max_tokens=s.max_new_tokens,
                                  stop_token_ids=list(s.stop_token_ids))
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)

    def step(self) -> list[Finished]:
        return [Finished(out.request_id, list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
                for out in self.engine.step() if out.finished]

    def close(self) -> None:
        del self.engine, self.llm
        gc.collect()
