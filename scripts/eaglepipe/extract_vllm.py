"""Hidden states from vLLM's built-in ``extract_hidden_states`` speculative method.

The call is the one verified on an H200 with vLLM 0.26.0 (benchmarks/README.md): the
``ExampleHiddenStatesConnector`` writes one safetensors file per request into a staging
directory; we read each file (``load_hidden_states`` waits on the writer's lock), hand the
states to the caller and delete the file. vLLM is imported lazily: CPU users do not have it.

Requests are streamed through the engine under ``LLM`` (``llm_engine.add_request`` with our own
request ids, which the outputs carry back, and ``step()``, which returns what finished): the
engine stays fed, and a batch goes to the writers as soon as its last request is done.
``generate()`` on windows of requests let the engine drain at every window's end.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

import torch

from .vllm_env import kv_cache_kwargs, set_vllm_env_defaults

# Tokens queued in the engine and not yet finished: several scheduler steps' worth keeps the GPU
# busy while the caller is busy, and it bounds the files staged at any time.
LOOKAHEAD_TOKENS = 1 << 17

Loader = Callable[[], list[tuple[torch.Tensor, list[int]]]]


class VLLMExtractor:
    def __init__(self, model: str, layer_ids: list[int], dtype: str, staging_dir: str | os.PathLike,
                 tensor_parallel_size: int = 1, max_model_len: int = 8192,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 revision: str | None = None, trust_remote_code: bool = False,
                 connector_threads: int | None = None, kv_cache_gib: float | None = None):
        set_vllm_env_defaults()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.staging = Path(staging_dir)
        shutil.rmtree(self.staging, ignore_errors=True)  # leftovers of a crashed run
        self.staging.mkdir(parents=True)
        self.llm = LLM(
            model=model, revision=revision, trust_remote_code=trust_remote_code,
            skip_tokenizer_init=True, dtype=dtype, enable_prefix_caching=False,
            tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, seed=0,
            **kv_cache_kwargs(kv_cache_gib),
            speculative_config={
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
            },
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.staging)} | (
                    {"num_writer_threads": connector_threads} if connector_threads is not None else {}),
            },
        )
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                     output_kind=RequestOutputKind.FINAL_ONLY)

    def batches(self, batches: Iterable[tuple[object, list[list[int]]]]) -> Iterator[tuple[object, Loader]]:
        """For each (key, token lists) yield (key, loader) in the order the batches finish;
        loader() -> [(states [T, L, H], token ids)] in the batch's order, callable from any thread
        or, pickled, from another process (it holds only the file paths)."""
        for key, paths in stream_requests(self.llm, self.params, batches, LOOKAHEAD_TOKENS):
            yield key, partial(load_files, paths)

    def close(self) -> None:
        del self.llm
        gc.collect()
        shutil.rmtree(self.staging, ignore_errors=True)


def stream_requests(llm, params, batches: Iterable[tuple[object, list[list[int]]]],
                    lookahead_tokens: int) -> Iterator[tuple[object, list[str]]]:
    """Yield (key, the connector's file of each sequence) for each batch once all its requests finished.

    At most ``lookahead_tokens`` (or one batch, if larger) are queued in the engine, and more are
    enqueued only when the caller asks for the next batch: a caller that stops asking (its
    writers are behind) stops the feed. The engine core runs in its own process and computes
    while the caller works.
    """
    engine = llm.llm_engine
    feed = iter(batches)
    owner: dict[str, tuple[int, int, int]] = {}  # request id -> (batch number, position, tokens)
    unfinished: dict[int, tuple[object, list[str | None]]] = {}
    queued = number = 0
    fed_all = False
    while True:
        while not fed_all and queued < lookahead_tokens:
            item = next(feed, None)
            if item is None:
                fed_all = True
                break
            key, seqs = item
            unfinished[number] = (key, [None] * len(seqs))
            for pos, s in enumerate(seqs):
                rid = f"eaglepipe-{number}-{pos}"
                engine.add_request(rid, {"prompt_token_ids": s}, params)
                owner[rid] = (number, pos, len(s))
            queued += sum(map(len, seqs))
            number += 1
        if not owner:
            return
        for out in engine.step():
            if not out.finished:
                continue
            b, pos, n = owner.pop(out.request_id)
            queued -= n
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"vLLM request {out.request_id} returned no hidden_states_path "
                                   f"(kv_transfer_params={out.kv_transfer_params!r})")
            key, paths = unfinished[b]
            paths[pos] = path
            if all(paths):
                del unfinished[b]
                yield key, paths


# what a writer process imports when it starts rather than in its first job (vLLM's import is slow)
WRITER_IMPORTS = (__name__, "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector")


def load_files(paths: list[str]) -> list[tuple[torch.Tensor, list[int]]]:
    """Read the connector's files of one batch and delete them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    out = []
    for path in paths:
        d = load_hidden_states(path)  # blocks until the connector's writer releases the lock
        out.append((d["hidden_states"], d["token_ids"].tolist()))
        os.unlink(path)
        Path(path + ".lock").unlink(missing_ok=True)
    return out
