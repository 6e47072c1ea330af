"""The process runtime every torch stage shares: threads, the distributed group, RNG state."""

from __future__ import annotations

import os
import random

import torch


def set_threads() -> int:
    """Torch threads = the job's threads (Snakemake exports OMP_NUM_THREADS = threads)."""
    n = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    torch.set_num_threads(max(1, n))
    return n


def setup_distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 rest (eval, head) on tensor cores
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def leave_distributed() -> None:
    """Every rank leaves the group together, once its work is done: a rank whose interpreter exits
    with the gloo group alive can abort in the group's teardown ("terminate called without an active
    exception", exit -6, once in a CI run of tests/test_train_ddp.py)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce(counts: dict, world: int) -> dict:
    if world > 1:
        import torch.distributed as dist

        for v in counts.values():
            dist.all_reduce(v)
    return counts


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
