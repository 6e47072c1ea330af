"""--kv-cache-gib (config vllm.kv_cache_gib): the engine arguments it becomes, the stages' checks of
it, and each engine our code starts receiving it (vLLM replaced by a stand-in that records them);
benchmark_serving.engine_args reaching the serving engines, checked against the installed vLLM's."""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType, SimpleNamespace

import pytest

from eaglepipe import benchmark_serving as bs
from eaglepipe import extract_hidden_states as ehs
from eaglepipe import regenerate_responses as rr
from eaglepipe.generation import Sampling
from eaglepipe.vllm_env import kv_cache_kwargs


def test_kv_cache_kwargs_are_bytes_or_nothing():
    assert kv_cache_kwargs(None) == {}
    assert kv_cache_kwargs(8) == {"kv_cache_memory_bytes": 8 * 2**30}
    assert kv_cache_kwargs(0.5) == {"kv_cache_memory_bytes": 2**29}


# each stage's parse, with its required arguments given
PARSERS = {
    "regenerate_responses": lambda extra: rr.main(
        ["--data", "d", "--out", "o", "--stats", "s", "--parts-dir", "p", "--model", "m", *extra]),
    "extract_hidden_states": lambda extra: ehs.parse_args(
        ["--train", "t", "--eval", "e", "--model", "m", "--shard-dir", "s", "--out", "o", *extra]),
    "benchmark_serving": lambda extra: bs.build_parser().parse_args(
        ["--model", "m", "--draft", "d", "--prompts", "p", "--k", "3", "--parity-k", "3", "--out", "o",
         "--parity-samples", "s", *extra]),
}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "eight"])
@pytest.mark.parametrize("stage", sorted(PARSERS))
def test_stages_reject_a_kv_cache_not_above_zero(stage, value, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[stage](["--kv-cache-gib", value])
    assert e.value.code == 2
    assert "--kv-cache-gib" in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["extract_hidden_states", "benchmark_serving"])
def test_stages_read_the_kv_cache_or_leave_it_to_vllm(stage):
    assert PARSERS[stage](["--kv-cache-gib", "8"]).kv_cache_gib == 8.0
    assert PARSERS[stage]([]).kv_cache_gib is None


class Built(Exception):
    """The stand-in LLM's constructor stops the stage here, with the engine arguments."""


@pytest.fixture
def llm_kwargs(monkeypatch) -> list[dict]:
    """A stand-in vllm whose LLM records its arguments and raises Built."""
    seen = []

    def llm(**kwargs):
        seen.append(kwargs)
        raise Built

    vllm = ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = llm, SimpleNamespace
    sampling = ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final", DELTA="delta")
    arg_utils = ModuleType("vllm.engine.arg_utils")  # the engine arguments the installed vLLM knows
    arg_utils.EngineArgs = dataclasses.make_dataclass("EngineArgs", ["model", "max_num_seqs", "async_scheduling"])
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    monkeypatch.setitem(sys.modules, "vllm.engine", ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    return seen


@pytest.mark.parametrize("gib, expected", [(8.0, {"kv_cache_memory_bytes": 8 * 2**30}), (None, {})])
def test_every_engine_gets_the_kv_cache(tmp_path, llm_kwargs, gib, expected):
    regenerate_args = SimpleNamespace(
        backend="vllm", model="m", dtype="bfloat16", tensor_parallel_size=1, max_model_len=64,
        gpu_memory_utilization=0.1, enforce_eager=False, revision=None, trust_remote_code=False, kv_cache_gib=gib,
        loop_stop_every=64, on_loop="drop")
    extract_args = ehs.parse_args(["--train", "t", "--eval", "e", "--model", "m", "--shard-dir", "s", "--out", "o",
                                   "--backend", "vllm", "--gpu-memory-utilization", "0.1",
                                   *(["--kv-cache-gib", str(gib)] if gib else [])])
    serving_settings = {"model": "m", "tensor_parallel_size": 1, "trust_remote_code": False, "dtype": "bfloat16",
                        "gpu_memory_utilization": 0.1, "kv_cache_gib": gib, "max_tokens": 4, "draft": "d",
                        "method": "dflash", "engine_args": {"max_num_seqs": 8}}
    starts = {
        "regeneration": lambda: rr.make_generator(regenerate_args, Sampling(0.0, 1.0, 4, (2,))),
        "extraction": lambda: ehs.load_backend(extract_args, [1, 2], 2, tmp_path / "staging"),
        "serving, target alone": lambda: bs.run_engine(serving_settings, [[1, 2]], None, str(tmp_path / "r.json")),
        "serving, with the draft": lambda: bs.run_engine(serving_settings, [[1, 2]], 3, str(tmp_path / "r.json")),
    }
    for name, start in starts.items():
        with pytest.raises(Built):
            start()
        kwargs = llm_kwargs.pop()
        assert {k: v for k, v in kwargs.items() if k == "kv_cache_memory_bytes"} == expected, name
        assert kwargs["gpu_memory_utilization"] == 0.1, name
        assert kwargs.get("max_num_seqs") == (8 if name.startswith("serving") else None), name
        # loop-checked answers stream their tokens every regenerate.loop_stop_every, not every step
        assert kwargs.get("stream_interval") == (64 if name == "regeneration" else None), name
        if name == "serving, with the draft":  # asked for the method the draft's config names (the settings')
            assert kwargs["speculative_config"] == {"model": "d", "method": "dflash", "num_speculative_tokens": 3}


def test_an_engine_argument_the_installed_vllm_lacks_stops_the_serving_engine_before_it_loads(tmp_path, llm_kwargs):
    settings = {"model": "m", "tensor_parallel_size": 1, "trust_remote_code": False, "dtype": "bfloat16",
                "gpu_memory_utilization": 0.1, "kv_cache_gib": None, "max_tokens": 4, "draft": "d", "method": "eagle3",
                "engine_args": {"max_num_seqs": 8, "speculative_drafting_mode": "fast"}}
    with pytest.raises(SystemExit, match="engine_args.speculative_drafting_mode: not an engine argument of the "
                                         "installed vLLM"):
        bs.run_engine(settings, [[1, 2]], 3, str(tmp_path / "r.json"))
    assert llm_kwargs == []
