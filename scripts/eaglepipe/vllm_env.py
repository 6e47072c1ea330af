"""The environment every process that starts a vLLM engine sets before it imports vllm."""

from __future__ import annotations

import os

# Verified on the H200 with vLLM 0.26.0: its sampler imports flashinfer without a guard and
# setup.sh leaves flashinfer out (README.md), so the engine fails at start unless the flashinfer
# sampler is off; and a parent that touched CUDA (torch.cuda.is_available() is
# enough) breaks forked engine workers ("Cannot re-initialize CUDA in forked subprocess"), so
# they are spawned. A value the caller's environment sets wins.
VLLM_ENV_DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def set_vllm_env_defaults() -> None:
    """Set each of VLLM_ENV_DEFAULTS that the environment leaves unset."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
