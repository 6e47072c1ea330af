"""Text generation engines behind one small interface: ``submit`` a request, ``step`` for finished ones.

``VLLMGenerator`` drives the engine under vLLM's ``LLM`` with its request stream
(``llm_engine.add_request`` with our own request ids, which the outputs carry back, and ``step()``,
as extract_vllm does): requests are added as soon as they are known (a conversation's next turn
right after its previous answer), so continuous batching keeps the engine full, where
``generate()`` on windows would drain it at every window's end. vLLM is imported lazily (CPU users
do not have it). Calls checked against the vLLM 0.26.0 wheel: ``SamplingParams(temperature,
top_p, seed, max_tokens, stop_token_ids, detokenize, output_kind)``; a finished ``RequestOutput``
carries ``outputs[0].token_ids`` (the stop token included) and ``finish_reason`` "stop" / "length".
With ``Sampling.loop_stop`` a request streams its tokens (``RequestOutputKind.DELTA``: the new ones,
every ``stream_interval`` tokens) and a looping one is ended with ``llm_engine.abort_request([id])``:
vLLM has no stop condition of that kind, and a loop of a small target otherwise runs to ``max_tokens``.

``HFGenerator`` decodes batches of requests with a transformers model (CPU, tests, tiny targets):
each request samples from its own ``torch.Generator`` seeded with its request seed, as vLLM's
per-request ``seed`` does. transformers' ``generate`` cannot do that (one generator draws every row
of a batch, so a row's answer would depend on its partners), hence the loop here. It draws what
``torch.manual_seed(seed)`` then ``generate`` drew one request at a time, as that backend did, at
4x its speed on 2 CPU cores (SmolLM2-135M, batches of 32: benchmarks/README.md).
"""

from __future__ import annotations

import gc
import inspect
import time
from functools import partial
from typing import NamedTuple

import torch

from .degenerate import DistinctNgrams
from .vllm_env import kv_cache_kwargs, set_vllm_env_defaults


class LoopStop(NamedTuple):
    """Stop an unfinished answer as soon as it loops (eaglepipe.degenerate.is_loop), judged each time
    it has grown by ``every`` tokens: a looping answer of a small target otherwise runs on to
    max_new_tokens, and is then dropped or trimmed all the same."""
    every: int
    ngram: int
    min_distinct_share: float


class LoopWatch:
    """One answer as it comes, judged at each check (is_loop over the whole answer at every check
    would cost its length each time; DistinctNgrams costs its new tokens)."""

    def __init__(self, stop: LoopStop):
        self.stop, self.answer = stop, DistinctNgrams(stop.ngram)

    @property
    def tokens(self) -> list[int]:
        return self.answer.tokens

    def add(self, new) -> bool:
        """Take the answer's next tokens; whether it crossed a check and loops there (as is_loop says)."""
        before = len(self.tokens)
        self.answer.add(new)
        return (len(self.tokens) // self.stop.every > before // self.stop.every
                and self.answer.share() < self.stop.min_distinct_share)


class Sampling(NamedTuple):
    temperature: float  # 0 = greedy
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]  # the tokens that end the target's turn
    loop_stop: LoopStop | None = None  # None: every answer runs to its stop token or max_new_tokens


class Finished(NamedTuple):
    request_id: str
    token_ids: list[int]  # the completion, its stop token included
    # "stop", "length", or "loop" (stopped early by Sampling.loop_stop); anything else is an engine failure
    finish_reason: str


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
    # one resumable part at a time: its batches are then made from that part's requests alone, so a
    # resumed run makes the same batches as an uninterrupted one (a batch's float sums depend on its
    # rows and padding, which could flip a near tie)
    lookahead = 1

    def __init__(self, model: str, sampling: Sampling, device: str = "cpu", dtype: str = "float32",
                 revision: str | None = None, trust_remote_code: bool = False, batch_size: int = 32):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.precision = self.compute_precision(device, dtype)  # what the answers are computed in
        compute = getattr(torch, self.precision)
        self.model = AutoModelForCausalLM.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code, dtype=compute).to(self.device).eval()
        # only the last position's logits when the model can skip the others (a prompt's [T, vocab] is large)
        self.last_logits_only = ({"logits_to_keep": 1}
                                 if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {})
        self.sampling, self.batch_size = sampling, batch_size
        self.queue: list[tuple[str, list[int], int]] = []

    @staticmethod
    def compute_precision(device: str, dtype: str) -> str:
        """The dtype the answers are computed in: float32 on CPU (its bf16 matmuls are slow), else ``dtype``."""
        return "float32" if torch.device(device).type == "cpu" else dtype

    def submit(self, request_id: str, prompt_ids: list[int], seed: int) -> None:
        self.queue.append((request_id, prompt_ids, seed))

    def step(self) -> list[Finished]:
        """The ``batch_size`` shortest queued prompts, decoded together to their ends: a batch pads every
        prompt to its longest, so one long prompt among short ones would multiply the work."""
        queued = sorted(self.queue, key=lambda request: len(request[1]))  # stable: ties keep their order
        batch, self.queue = queued[:self.batch_size], queued[self.batch_size:]
        return self._decode(batch) if batch else []

    @torch.inference_mode()
    def _decode(self, batch: list[tuple[str, list[int], int]]) -> list[Finished]:
        from transformers import DynamicCache

        s, dev, stops = self.sampling, self.device, set(self.sampling.stop_token_ids)
        width = max(len(prompt) for _, prompt, _ in batch)
        ids = torch.full((len(batch), width), s.stop_token_ids[0], dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, prompt, _) in enumerate(batch):  # left-padded, so every row's next token is the last column
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = ([torch.Generator(device=dev).manual_seed(seed) for _, _, seed in batch]
                      if s.temperature > 0 else None)
        # the config tells the cache which layers slide (as generate() builds it)
        cache = DynamicCache(config=self.model.config)
        alive, answers, looped = list(range(len(batch))), [[] for _ in batch], set()
        watches = [LoopWatch(s.loop_stop) for _ in batch] if s.loop_stop else None
        for _ in range(s.max_new_tokens):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                use_cache=True, **self.last_logits_only).logits[:, -1].float()
            picked = self._pick(logits, generators and [generators[r] for r in alive])
            going = []
            for i, (r, token) in enumerate(zip(alive, picked.tolist())):
                answers[r].append(token)
                if token in stops:
                    continue
                if watches and watches[r].add([token]):
                    looped.add(r)
                else:
                    going.append(i)
            if not going:
                break
            if len(going) < len(alive):  # finished rows leave the batch and its cache
                keep = torch.tensor(going, device=dev)
                cache.batch_select_indices(keep)
                mask, positions, picked = mask[keep], positions[keep], picked[keep]
                alive = [alive[i] for i in going]
            ids, positions = picked[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
        return [Finished(rid, answer, "loop" if r in looped else "stop" if answer[-1] in stops else "length")
                for r, ((rid, _, _), answer) in enumerate(zip(batch, answers))]

    def _pick(self, logits: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """Greedy, or a sample from the temperature-scaled top-p nucleus (the smallest set of tokens whose
        probability reaches top_p), each row with its own generator."""
        if generators is None:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            sorted_probs[sorted_probs.cumsum(-1) - sorted_probs >= self.sampling.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])

    def close(self) -> None:
        del self.model
        gc.collect()


class VLLMGenerator:
    """``load`` starts the engine; the constructor takes one already made (tests give a stand-in)."""

    # conversations kept open: well above the scheduler's batch (max_num_seqs, 1024 at most by
    # default) so it stays full while conversations wait for their next turn and parts finish
    lookahead = 4096

    def __init__(self, llm, sampling: Sampling, make_params, precision: str,
                 output_kinds: tuple = ("final_only", "delta")):
        self.llm, self.engine, self.sampling, self.make_params = llm, llm.llm_engine, sampling, make_params
        self.precision = precision
        # vLLM's RequestOutputKind FINAL_ONLY and DELTA: a request whose answer is checked for a loop
        # streams its new tokens (DELTA), the others come back once, finished
        self.final_only, self.delta = output_kinds
        self.streams: dict[str, LoopWatch] = {}  # the loop-checked requests being answered

    @staticmethod
    def compute_precision(device: str, dtype: str) -> str:
        """The dtype flag: "auto" follows the model's config, which the key names."""
        return dtype

    @classmethod
    def load(cls, model: str, sampling: Sampling, dtype: str, tensor_parallel_size: int = 1,
             max_model_len: int = 8192, gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
             revision: str | None = None, trust_remote_code: bool = False,
             kv_cache_gib: float | None = None, stream_interval: int | None = None) -> "VLLMGenerator":
        """``stream_interval``: a streaming (loop-checked) request's tokens come back every that many
        (vLLM's engine argument), not at every step: the checks' step, without the host work of an
        output per token."""
        set_vllm_env_defaults()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = LLM(
            model=model, revision=revision, trust_remote_code=trust_remote_code, skip_tokenizer_init=True,
            dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, seed=0,
            **kv_cache_kwargs(kv_cache_gib), **({"stream_interval": stream_interval} if stream_interval else {}),
        )
        # detokenize=False: the engine has no tokenizer (skip_tokenizer_init); we decode ourselves
        return cls(llm, sampling, partial(SamplingParams, detokenize=False), dtype,
                   (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA))

    def submit(self, request_id: str, prompt_ids: list[int], seed: int) -> None:
        s = self.sampling
        # stop_token_ids given explicitly: without a tokenizer vLLM knows only generation_config's
        params = self.make_params(temperature=s.temperature, top_p=s.top_p, seed=seed, max_tokens=s.max_new_tokens,
                                  stop_token_ids=list(s.stop_token_ids),
                                  output_kind=self.delta if s.loop_stop else self.final_only)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
        if s.loop_stop:
            self.streams[request_id] = LoopWatch(s.loop_stop)

    def step(self) -> list[Finished]:
        done = []
        for out in self.engine.step():
            watch = self.streams.get(out.request_id)
            if watch is None:
                if out.finished:
                    done.append(Finished(out.request_id, list(out.outputs[0].token_ids), out.outputs[0].finish_reason))
                continue
            loops = watch.add(out.outputs[0].token_ids if out.outputs else [])
            if out.finished:
                done.append(Finished(out.request_id, watch.tokens, out.outputs[0].finish_reason))
            elif loops:  # the engine drops it (LLMEngine.abort_request)
                self.engine.abort_request([out.request_id])
                done.append(Finished(out.request_id, watch.tokens, "loop"))
            else:
                continue
            del self.streams[out.request_id]
        return done

    def close(self) -> None:
        del self.engine, self.llm
        gc.collect()


class LazyGenerator:
    """A generator whose engine starts at the first request: a run whose answers are all on disk
    (reused parts) loads nothing, where one start of the real target at TP=8 takes ~20 minutes.
    ``precision`` and ``lookahead`` are known before the load (they key and pace the parts)."""

    def __init__(self, load, sampling: Sampling, precision: str, lookahead: int, announce=None):
        self._load, self._sampling, self._announce = load, sampling, announce
        self.precision, self.lookahead = precision, lookahead
        self.engine = None
        self.load_s = 0.0  # 0: never loaded (as an extraction that reused every shard records it)

    @property
    def sampling(self) -> Sampling:
        return self._sampling

    @sampling.setter
    def sampling(self, sampling: Sampling) -> None:
        self._sampling = sampling
        if self.engine is not None:
            self.engine.sampling = sampling

    def submit(self, request_id: str, prompt_ids: list[int], seed: int) -> None:
        if self.engine is None:
            t0 = time.perf_counter()
            self.engine = self._load(self._sampling)
            self.load_s = round(time.perf_counter() - t0, 2)
            if self._announce:
                self._announce(self.load_s)
        self.engine.submit(request_id, prompt_ids, seed)

    def step(self) -> list[Finished]:
        return self.engine.step() if self.engine is not None else []

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
