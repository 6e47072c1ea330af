"""Layer ids in vLLM's convention, the one every backend, shard and exported config uses.

Id k (1 <= k < N) is the residual stream after k decoder layers, i.e. the input of 0-based
layer k (transformers ``hidden_states[k]``). Id N = num_hidden_layers is the last decoder
layer's output *before* the final norm (transformers 5's ``hidden_states[N]`` is after it).
Measured on an H200 by matching every slot vLLM saved against every transformers state
(benchmarks/gpu_check_extraction.sh compares the two backends). Id 0 (the embeddings) is
rejected: vLLM 0.26 returned a wrong tensor for it on Llama in eager mode (the embedding buffer
is overwritten in place) and crashed on DeepseekV3 at engine start (vllm/model_executor/models/
deepseek_v2.py: ``hidden_states + residual`` with residual None).
The old speculators 0.3 convention ("output of 0-based layer i") is one layer off from this.
"""

from __future__ import annotations

CONVENTION = (
    "vllm: id k = residual stream after k decoder layers (input of 0-based layer k); "
    "id N = num_hidden_layers = last decoder layer output before the final norm"
)


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's aux taps [2, N//2, N-3] plus the final layer N (Kimi-K2.5: [2, 30, 58, 61]).

    Three distinct aux ids always (vLLM's draft reads exactly three, serving_limits.AUX_STATES): for
    N <= 6, where those collide, [1, N//2, N-1]; fewer than 4 layers have no three to give.
    """
    n = num_hidden_layers
    if n < 4:
        raise ValueError(
            f"the target has {n} decoder layers, fewer than the 4 that three distinct aux ids plus the "
            f"final layer need; give extract.layer_ids explicitly"
        )
    aux = [2, n // 2, n - 3] if n > 6 else [1, n // 2, n - 1]
    return aux + [n]


def validate_layer_ids(layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    """Check ids against the target; return them as given (ascending, final layer last)."""
    n = num_hidden_layers
    ids = [int(i) for i in layer_ids]
    if len(ids) < 2:
        raise ValueError(f"layer ids {ids}: need at least one aux id plus the final id {n}")
    if ids != sorted(set(ids)):
        raise ValueError(
            f"layer ids {ids} must be strictly ascending (vLLM stores the slots in ascending order)"
        )
    if ids[0] < 1:
        raise ValueError(f"layer id {ids[0]} is not allowed: vLLM's id 0 is broken; use ids 1..{n}")
    if ids[-1] != n:
        raise ValueError(
            f"the last layer id must be the final layer {n} (num_hidden_layers of the target), "
            f"got {ids[-1]}: the draft's targets come from it"
        )
    return ids


def aux_layer_ids(layer_ids: list) -> list:
    """The aux ids, whose states feed the draft: every layer id but the last, the final layer's."""
    return list(layer_ids[:-1])


def resolve_layer_ids(configured: list[int] | None, num_hidden_layers: int) -> list[int]:
    """The configured ids (validated) or the default for this target."""
    if configured is None:
        return default_layer_ids(num_hidden_layers)
    return validate_layer_ids(configured, num_hidden_layers)
