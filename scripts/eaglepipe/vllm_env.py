"""What every process that starts a vLLM engine shares: the environment it sets before it imports
vllm, and the engine arguments its settings turn into."""

from __future__ import annotations

import argparse
import os

# Verified on the H200 with vLLM 0.26.0: its sampler imports flashinfer without a guard and
# setup.sh leaves flashinfer out (docs/gpu-hosts.md), so the engine fails at start unless the flashinfer
# sampler is off; and a parent that touched CUDA (torch.cuda.is_available() is
# enough) breaks forked engine workers ("Cannot re-initialize CUDA in forked subprocess"), so
# they are spawned. A value the caller's environment sets wins.
VLLM_ENV_DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def set_vllm_env_defaults() -> None:
    """Set each of VLLM_ENV_DEFAULTS that the environment leaves unset."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def kv_cache_kwargs(kv_cache_gib: float | None) -> dict:
    """The LLM arguments of a fixed KV cache (config vllm.kv_cache_gib): none for None (vLLM sizes the
    cache by profiling the free memory, gpu_memory_utilization's share); else kv_cache_memory_bytes,
    which skips the profiling (vllm/v1/worker/gpu_worker.py of vLLM 0.26.0), so an engine starting
    while others on its GPU allocate still gets its cache."""
    return {} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}


def gib_above_zero(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a number of GiB above 0")
    return value

