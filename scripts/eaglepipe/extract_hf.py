"""Hidden states from a transformers forward with hooks (CPU, tests, small models on one GPU).

Id k < N is the input of 0-based decoder layer k (= transformers ``hidden_states[k]``); id N is
the input of the decoder's final norm. transformers 5 returns ``hidden_states[N]`` *after* the
norm, which is not what vLLM captures (layers.py), hence the hooks.
"""

from __future__ import annotations

from functools import partial

import torch

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
# Padded tokens per forward. CPU, 2 cores, hidden 576, lengths 20-256, batches of 8: per sample
# and 512-1024-token groups ~1.8-1.9k tok/s, 2048 ~1.4k, the whole batch padded ~0.8-1.4k.
DEFAULT_BATCH_TOKENS = {"cpu": 1024, "cuda": 16384}


def decoder_parts(model, num_hidden_layers: int):
    """(decoder, its layer list, its final norm) of a causal LM, found by structure not class."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        lists = [m for m in decoder.children()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == num_hidden_layers]
        if len(lists) != 1:
            raise ValueError(f"{type(decoder).__name__}: cannot find its list of {num_hidden_layers} "
                             "decoder layers")
        layers = lists[0]
    for name in FINAL_NORM_NAMES:
        norm = getattr(decoder, name, None)
        if isinstance(norm, torch.nn.Module):
            return decoder, layers, norm
    raise ValueError(f"{type(decoder).__name__}: no final norm among attributes {FINAL_NORM_NAMES}")


class HFExtractor:
    """Loads the target once; ``extract(list of token lists)`` -> list of [T_i, L, H] in ``dtype``."""

    def __init__(self, model: str, layer_ids: list[int], num_hidden_layers: int, dtype: torch.dtype,
                 device: str = "cpu", revision: str | None = None, trust_remote_code: bool = False,
                 max_batch_tokens: int | None = None):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.dtype = dtype
        # bf16 matmuls were ~4x slower than fp32 on the project's x86 CPUs: compute fp32, store bf16
        compute = torch.float32 if self.device.type == "cpu" else dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code, dtype=compute
        ).to(self.device).eval()
        self.decoder, layers, norm = decoder_parts(self.model, num_hidden_layers)
        self.layer_ids = list(layer_ids)
        self.max_batch_tokens = max_batch_tokens or DEFAULT_BATCH_TOKENS[self.device.type]
        self._captured: dict[int, torch.Tensor] = {}
        modules = [norm if k == num_hidden_layers else layers[k] for k in self.layer_ids]
        for k, module in zip(self.layer_ids, modules):
            module.register_forward_pre_hook(self._hook(k), with_kwargs=True)

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    @torch.no_grad()
    def _forward(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """One padded forward (right padding: real tokens never attend to pads)."""
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        self._captured.clear()
        self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        hs = torch.stack([self._captured[k] for k in self.layer_ids], dim=2)  # [B, T, L, H]
        hs = hs.to(self.dtype).cpu()
        return [hs[i, : len(s)].contiguous() for i, s in enumerate(seqs)]

    def extract(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Samples sorted by length into forwards of at most max_batch_tokens padded tokens."""
        groups: list[list[int]] = [[]]
        for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i])):
            # ascending lengths: the newest sample sets the group's padded length
            if groups[-1] and (len(groups[-1]) + 1) * len(seqs[i]) > self.max_batch_tokens:
                groups.append([])
            groups[-1].append(i)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for group in groups:
            for j, h in zip(group, self._forward([seqs[j] for j in group])):
                out[j] = h
        return out

    def batches(self, batches):
        """Same interface as VLLMExtractor.batches: (key, loader), loader() -> [(states, None)];
        the loader pickles (with its tensors) for a writer process."""
        for key, seqs in batches:
            yield key, partial(as_loaded, self.extract(seqs))

    def close(self) -> None:
        del self.model


def as_loaded(states: list[torch.Tensor]) -> list[tuple[torch.Tensor, None]]:
    """What a writer takes: (states, token ids), the ids unknown (the forward took the input's)."""
    return [(h, None) for h in states]
