"""Hidden states from vLLM's built-in ``extract_hidden_states`` speculative method.

The call is the one verified on an H200 with vLLM 0.26.0 (shared/device/README.md §2): the
``ExampleHiddenStatesConnector`` writes one safetensors file per request into a staging
directory; we read each file (``load_hidden_states`` waits on the writer's lock), hand the
states to the caller and delete the file. vLLM is imported lazily: CPU users do not have it.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

# Tokens handed to one generate() call (at least one batch): enough to keep the GPU busy, small
# enough that the caller's threads pack and write one window while the GPU runs the next.
WINDOW_TOKENS = 1 << 17

Loader = Callable[[], list[tuple[torch.Tensor, list[int]]]]


class VLLMExtractor:
    def __init__(self, model: str, layer_ids: list[int], dtype: str, staging_dir: str | os.PathLike,
                 tensor_parallel_size: int = 1, max_model_len: int = 8192,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 revision: str | None = None, trust_remote_code: bool = False):
        # flashinfer is not part of the verified install; spawn keeps the engine clean of CUDA state
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM, SamplingParams

        self.staging = Path(staging_dir)
        shutil.rmtree(self.staging, ignore_errors=True)  # leftovers of a crashed run
        self.staging.mkdir(parents=True)
        self.llm = LLM(
            model=model, revision=revision, trust_remote_code=trust_remote_code,
            skip_tokenizer_init=True, dtype=dtype, enable_prefix_caching=False,
            tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, seed=0,
            speculative_config={
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
            },
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.staging)},
            },
        )
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def batches(self, batches: Iterable[tuple[object, list[list[int]]]]) -> Iterator[tuple[object, Loader]]:
        """For each (key, token lists) yield (key, loader); loader() -> [(states [T, L, H], token ids)].

        Loaders may run in other threads; the next window is generated only when the caller asks
        for the next item after the current window's last one, so the caller overlaps writing
        with generation.
        """
        window: list[tuple[object, list[list[int]]]] = []
        tokens = 0
        for key, seqs in batches:
            window.append((key, seqs))
            tokens += sum(len(s) for s in seqs)
            if tokens >= WINDOW_TOKENS:
                yield from self._generate(window)
                window, tokens = [], 0
        if window:
            yield from self._generate(window)

    def _generate(self, window):
        prompts = [{"prompt_token_ids": s} for _, seqs in window for s in seqs]
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        start = 0
        for key, seqs in window:
            paths = []
            for o in outs[start:start + len(seqs)]:
                path = (o.kv_transfer_params or {}).get("hidden_states_path")
                if not path:
                    raise RuntimeError(f"vLLM request {o.request_id} returned no hidden_states_path "
                                       f"(kv_transfer_params={o.kv_transfer_params!r})")
                paths.append(path)
            start += len(seqs)
            yield key, _loader(paths)

    def close(self) -> None:
        del self.llm
        gc.collect()
        shutil.rmtree(self.staging, ignore_errors=True)


def _loader(paths: list[str]) -> Loader:
    def load():
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
    return load
