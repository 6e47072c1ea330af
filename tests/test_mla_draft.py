"""The MLA draft for DeepseekV3 targets: architecture choice, the layer's shapes, TTT alignment,
training + resume + export + offline evaluation through the CLIs, and the exported tensors against
what vLLM 0.26.0's Eagle3DeepseekV2ForCausalLM builds (read from the wheel's source)."""

from __future__ import annotations

import ast
import copy
import json
import logging
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny
from pinned_vllm import vllm_wheel
import torch
from safetensors.torch import load_file
from tiny_stages import Oracle, make_run, metrics_rows, train_argv, weights

from eaglepipe import evaluate, export_draft, mla_draft, train_draft
from eaglepipe.draft_model import build_draft, load_draft, target_text_config
from eaglepipe.serving_limits import resolve_architecture

MLA_SHAPE_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "num_attention_heads", "hidden_size", "vocab_size")


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """DeepseekV3 (MLA + MoE) in miniature, with the 6 layers make_run's layer ids need."""
    return tiny.make_deepseek_v3(tmp_path_factory.mktemp("dsv3"), num_layers=6)


@pytest.fixture(scope="module")
def run(dsv3, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"), dsv3)


def test_architecture_resolution(dsv3, tiny_llama):
    mla_target, llama_target = target_text_config(dsv3), target_text_config(tiny_llama)
    assert resolve_architecture("auto", mla_target) == "mla"
    assert resolve_architecture("auto", llama_target) == "llama"
    assert resolve_architecture("llama", mla_target) == "llama"
    with pytest.raises(ValueError, match="needs an MLA target"):
        resolve_architecture("mla", llama_target)
    with pytest.raises(ValueError, match="allowed"):
        resolve_architecture("mha", mla_target)


def test_mla_layer_has_the_targets_mla_shapes(dsv3, run):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    model = build_draft(dsv3, [1, 3, 5], run["vocab"], ttt_steps=3, mlp_width=48)
    layer, target = model.config.transformer_layer_config, target_text_config(dsv3)
    assert layer.model_type == "deepseek_v3" and layer.num_hidden_layers == 1
    assert {k: getattr(layer, k) for k in MLA_SHAPE_KEYS} == {k: getattr(target, k) for k in MLA_SHAPE_KEYS}
    assert layer.intermediate_size == 48 and isinstance(model.layers[0].mlp, DeepseekV3MLP)
    assert {k: getattr(model.config, k) for k in mla_draft.NORM_FLAGS} == mla_draft.NORM_FLAGS
    attn = model.layers[0].self_attn
    assert attn.q_a_proj.in_features == attn.kv_a_proj_with_mqa.in_features == 2 * target.hidden_size
    assert attn.o_proj.out_features == target.hidden_size
    # what speculators saves is what the served config says vLLM loads
    ckpt = run["model"].parent / "mla_ckpt"
    model.save_pretrained(str(ckpt))
    cfg = json.loads((ckpt / "config.json").read_text())
    saved = {k: tuple(v.shape) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    assert saved == mla_draft.served_shapes(mla_draft.served_config(cfg))
    forced = build_draft(dsv3, [1, 3, 5], run["vocab"], ttt_steps=3, architecture="llama", mlp_width=40)
    assert forced.config.transformer_layer_config.model_type == "llama"
    assert forced.config.transformer_layer_config.intermediate_size == 40


def test_kimi_preset_trains_an_mla_draft():
    import yaml

    preset = yaml.safe_load((Path(__file__).parents[1] / "config" / "presets" / "kimi-k2.5.yaml").read_text())
    assert preset["draft"]["architecture"] == "mla"


def test_mla_on_a_non_mla_target_is_a_clear_error(tiny_llama, run):
    with pytest.raises(SystemExit, match="needs an MLA target"):
        build_draft(tiny_llama, [1, 3, 5], run["vocab"], ttt_steps=3, architecture="mla")


def test_mla_draft_of_more_than_one_layer_is_a_clear_error(dsv3, run):
    with pytest.raises(SystemExit, match="the MLA draft has 1 decoder layer .* use draft.layers 1 or draft.architecture llama"):
        build_draft(dsv3, [1, 3, 5], run["vocab"], ttt_steps=3, num_layers=2)
    two = build_draft(dsv3, [1, 3, 5], run["vocab"], ttt_steps=3, architecture="llama", num_layers=2, mlp_width=40)
    assert two.config.transformer_layer_config.num_hidden_layers == 2 and len(two.layers) == 2


def test_yarn_factor_one_is_the_plain_rotation(dsv3):
    """An unscaled target's draft is a factor-1 YaRN layer (what vLLM serves it as): same rotation."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    target = target_text_config(dsv3)
    yarn = mla_draft.layer_config(target)
    assert yarn.rope_parameters["rope_type"] == "yarn" and yarn.rope_parameters["factor"] == 1.0
    plain = DeepseekV3Config(**{**yarn.to_dict(), "rope_parameters": target.rope_parameters})
    pos, x = torch.arange(300)[None], torch.zeros(1)
    for a, b in zip(DeepseekV3RotaryEmbedding(yarn)(x, pos), DeepseekV3RotaryEmbedding(plain)(x, pos), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert yarn_apply_mscale(yarn.rope_parameters, 0.125) == 0.125
    scaled = SimpleNamespace(rope_parameters={"type": "yarn", "factor": 64.0, "rope_theta": 50000.0, "mscale": 1.0,
                                              "original_max_position_embeddings": 4096}, max_position_embeddings=262144)
    assert mla_draft.draft_rope(scaled) == {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "mscale": 1.0,
                                            "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="rope type 'linear'"):
        mla_draft.draft_rope(SimpleNamespace(rope_parameters={"rope_type": "linear", "rope_theta": 1.0}))


def test_ttt_alignment_oracle_reaches_accuracy_one(dsv3, run):
    """The offline estimator drives the MLA draft's TTT loop: the right shift is exact, others fail."""
    from speculators.losses import resolve_loss_config

    from eaglepipe.acceptance import evaluate_rows, summarize
    from eaglepipe.draft_model import load_target_head
    from eaglepipe.packed_data import PackedRows
    from eaglepipe.shard_manifest import load_manifest

    draft = build_draft(dsv3, [1, 3, 5], run["vocab"], ttt_steps=3)
    assert draft.config.transformer_layer_config.model_type == "deepseek_v3"
    t2d_index = torch.cumsum(draft.t2d.long(), 0) - 1
    head, loss = load_target_head(dsv3), resolve_loss_config("kl_div", "eager")

    def run_eval(shift):
        rows = PackedRows(load_manifest(run["manifest"]), "eval", 64, shuffle=False).once()
        return summarize(evaluate_rows(Oracle(draft, t2d_index, shift), rows, head, 3, loss))

    assert run_eval(1)["accuracy_per_position"] == [1.0, 1.0, 1.0]
    for wrong in (0, 2):
        assert max(run_eval(wrong)["accuracy_per_position"]) < 0.5


def test_resume_after_kill_gives_identical_weights(run, tmp_path, caplog):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train_draft.train(train_draft.parse_args(train_argv(run, straight)))
    assert train_draft.train(train_draft.parse_args(train_argv(run, killed)), stop_after=3) is None
    with caplog.at_level(logging.INFO):
        train_draft.train(train_draft.parse_args(train_argv(run, killed)))
    assert "step-0000002 at step 2" in caplog.text
    a, b = weights(straight, 6), weights(killed, 6)
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in a
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(metrics_rows(straight)) == len(metrics_rows(killed))


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """train_draft -> export_draft -> evaluate, all through their CLIs, on the tiny DeepseekV3 run."""
    work = tmp_path_factory.mktemp("cli")
    train_draft.main(train_argv(run, work / "train", draft_architecture="mla", draft_mlp_width=96))
    export_draft.main(["--summary", str(work / "train" / "summary.json"), "--verifier-name", "org/dsv3",
                       "--num-speculative-tokens", "3", "--out-dir", str(work / "draft")])
    evaluate.main(["--draft", str(work / "draft"), "--manifest", str(run["manifest"]), "--model", str(run["model"]),
                   "--k", "3", "--out", str(work / "offline.json")])
    return work


def test_cli_export_is_what_vllm_serves_as_eagle3_deepseek(exported, run):
    cfg = json.loads((exported / "draft" / "config.json").read_text())
    target = target_text_config(run["model"])
    assert cfg["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    assert "speculators_config" not in cfg and "speculators_model_type" not in cfg  # not the speculators format
    assert {k: cfg[k] for k in MLA_SHAPE_KEYS} == {k: getattr(target, k) for k in MLA_SHAPE_KEYS}
    assert cfg["intermediate_size"] == 96 and cfg["num_hidden_layers"] == 1 and cfg["first_k_dense_replace"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] and cfg["num_aux_hidden_states"] == 3
    assert cfg["eaglepipe"] == {"draft_architecture": "mla", "verifier": "org/dsv3", "num_speculative_tokens": 3}
    assert {k: cfg[k] for k in mla_draft.NORM_FLAGS} == mla_draft.NORM_FLAGS
    # as vLLM reads it (its config registry reads kimi_k2 with DeepseekV3Config): the class keeps the
    # EAGLE-3 keys as attributes, and the rope_scaling that vLLM's draft layer turns into
    # deepseek_yarn carries what that rotation needs
    from transformers import DeepseekV3Config

    loaded = DeepseekV3Config.from_pretrained(str(exported / "draft"))
    assert type(loaded).__name__ == "DeepseekV3Config" and loaded.architectures == ["Eagle3DeepseekV3ForCausalLM"]
    assert (loaded.draft_vocab_size, loaded.target_hidden_size, loaded.num_aux_hidden_states) == (256, 64, 3)
    assert loaded.eagle_aux_hidden_state_layer_ids == [1, 3, 5] and loaded.norm_before_residual and loaded.norm_output
    assert {"factor", "original_max_position_embeddings", "rope_theta"} <= set(loaded.rope_scaling)
    tensors = load_file(str(exported / "draft" / "model.safetensors"))
    expected = mla_draft.served_shapes(cfg)
    del expected["embed_tokens.weight"]  # left out: vLLM shares the target's
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    summary = json.loads((exported / "train" / "summary.json").read_text())
    trained = load_file(str(exported / "train" / summary["best"] / "model.safetensors"))
    assert torch.equal(tensors["layers.0.self_attn.q_a_proj.weight"],
                       trained["layers.0.self_attn.q_a_proj.weight"].to(torch.bfloat16))
    offline = json.loads((exported / "offline.json").read_text())
    assert offline["acceptance_length"] >= 1.0 and len(offline["per_position_acceptance"]) == 3


def test_exported_mla_draft_loads_for_evaluation(exported, run):
    model = load_draft(exported / "draft", run["model"])
    assert model.config.transformer_layer_config.model_type == "deepseek_v3"
    assert model.target_layer_ids == [1, 3, 5] and not model.training
    target = load_file(str(run["model"] / "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight, target["model.embed_tokens.weight"])  # left out, from the target


def test_validation_refuses_what_vllm_would_not_load(exported, tmp_path):
    import shutil

    bad = tmp_path / "draft"
    shutil.copytree(exported / "draft", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "speculators_config": {}}))
    with pytest.raises(export_draft.ExportError, match="speculators format"):
        export_draft.validate_export(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(export_draft.ExportError, match="no norm before fc"):
        export_draft.validate_export(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(export_draft.ExportError, match="silu only"):
        export_draft.validate_export(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": cfg["kv_lora_rank"] * 2}))
    with pytest.raises(export_draft.ExportError, match="kv_a_layernorm.weight. has shape"):
        export_draft.validate_export(bad)


def test_export_refuses_an_mla_checkpoint_trained_with_norm_before_fc(exported, tmp_path):
    import shutil

    shutil.copytree(exported / "train", tmp_path / "train")
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    cfg_path = tmp_path / "train" / summary["best"] / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "norm_before_fc": True}))
    with pytest.raises(export_draft.ExportError, match="norm_before_fc"):
        export_draft.export_draft(str(tmp_path / "train" / "summary.json"), "best", "org/dsv3", 3, True,
                                  str(tmp_path / "draft"))
    assert not (tmp_path / "draft").exists()


# ----------------------------------------------------------------------------- vLLM's own source
# module-building calls in vLLM's draft classes -> the shapes of the parameters they create
LINEARS = {"ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear"}
STACKED = {"DeepSeekV2FusedQkvAProjLinear", "MergedColumnParallelLinear"}
TABLES = {"ParallelLMHead", "VocabParallelEmbedding"}


class VllmSource:
    """Builds the parameter shapes of a vLLM class by interpreting its ``__init__`` source: simple
    assignments and if/else are evaluated with the exported config, known layer constructors give
    their weight shapes, and child classes of the same files are entered recursively."""

    def __init__(self, wheel: Path):
        with zipfile.ZipFile(wheel) as z:
            self.sources = {name: z.read(f"vllm/model_executor/models/{name}.py").decode()
                            for name in ("deepseek_eagle3", "deepseek_v2")}
        self.classes = {node.name: node for src in self.sources.values() for node in ast.walk(ast.parse(src))
                        if isinstance(node, ast.ClassDef)}
        self.mapper = self._weights_mapper()

    def _weights_mapper(self) -> dict:
        for node in ast.walk(self.classes["DeepseekV2Eagle3Model"]):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "WeightsMapper":
                return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        raise AssertionError("WeightsMapper not found in DeepseekV2Eagle3Model")

    def shapes(self, cls: str, ns: dict, prefix: str = "") -> dict[str, tuple]:
        init = next(f for f in self.classes[cls].body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
        out: dict[str, tuple] = {}
        self._run(init.body, ns, prefix, out)
        return out

    def _eval(self, node, ns):
        return eval(compile(ast.Expression(node), "<vllm>", "eval"), ns)  # noqa: S307 (vLLM's own source)

    def _run(self, body, ns, prefix, out):
        for stmt in body:
            if isinstance(stmt, ast.If):
                try:
                    taken = self._eval(stmt.test, ns)
                except Exception:  # a runtime-only test (platform, TP group): not a shape decision
                    continue
                self._run(stmt.body if taken else stmt.orelse, ns, prefix, out)
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
                name = target.attr if isinstance(target, ast.Attribute) and getattr(target.value, "id", "") == "self" \
                    else target.id if isinstance(target, ast.Name) else None
                if name is None:
                    continue
                if isinstance(target, ast.Attribute) and self._module(name, value, ns, prefix, out):
                    continue
                try:
                    result = self._eval(value, ns)
                except Exception:  # runtime objects (vllm_config, quant config): not shapes
                    continue
                if isinstance(target, ast.Attribute):
                    setattr(ns["self"], name, result)
                else:
                    ns[name] = result

    def _module(self, name, value, ns, prefix, out) -> bool:
        if not isinstance(value, ast.Call):
            return False
        ctor = getattr(value.func, "id", getattr(value.func, "attr", None))
        args = [self._eval(a, ns) for a in value.args if not isinstance(a, ast.Starred)] if ctor in (
            LINEARS | STACKED | TABLES | {"RMSNorm"}) else []
        kw = {k.arg: k.value for k in value.keywords}
        path = f"{prefix}{name}"
        if ctor in LINEARS:
            inp = args[0] if args else self._eval(kw["input_size"], ns)
            outp = args[1] if len(args) > 1 else self._eval(kw["output_size"], ns)
            out[f"{path}.weight"] = (outp, inp)
        elif ctor in STACKED:
            out[f"{path}.weight"] = (sum(args[1]), args[0])
            out[f"{path}.shards"] = tuple(args[1])
        elif ctor in TABLES:
            out[f"{path}.weight"] = (args[0], args[1])
        elif ctor == "RMSNorm":
            out[f"{path}.weight"] = (args[0],)
        elif ctor == "Parameter":
            out[path] = tuple(self._eval(value.args[0], ns).shape)
        elif ctor in self.classes:  # a child module of these files: enter it with its keyword arguments
            child = {}
            for k, v in kw.items():
                try:
                    child[k] = self._eval(v, ns)
                except Exception:  # runtime objects (vllm_config, start_layer_id from the target): not shapes
                    continue
            parent_config = getattr(ns["self"], "config", None)  # the draft config, read via self.config
            out.update(self.shapes(ctor, {**ns, **child, "self": SimpleNamespace(config=parent_config)}, f"{path}."))
        elif ctor == "ModuleList" and "DeepseekV2Eagle3DecoderLayer" in ast.dump(value):
            # layers = [DecoderLayer(..., config=self.config, layer_idx=i) for i in range(num_hidden_layers)]
            for i in range(ns["self"].config.num_hidden_layers):
                out.update(self.shapes("DeepseekV2Eagle3DecoderLayer",
                                       {**ns, "config": ns["self"].config, "layer_idx": i, "self": SimpleNamespace()},
                                       f"{path}.{i}."))
        else:
            return False
        return True


def served_names_to_vllm(names, mapper: dict) -> dict[str, tuple[str, int | None]]:
    """Eagle3DeepseekV2ForCausalLM.load_weights: t2d skipped, d2t -> draft_id_to_target_id, the rest
    under model. (lm_head excepted), then the model's WeightsMapper (substrings, stacked shards)."""
    mapped = {}
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            mapped[name] = (name.replace("d2t", "draft_id_to_target_id"), None)
            continue
        new, shard = name, None
        for old, repl in mapper.get("orig_to_new_substr", {}).items():
            new = new.replace(old, repl)
        for old, (repl, index) in mapper.get("orig_to_new_stacked", {}).items():
            if old in new:
                new, shard = new.replace(old, repl), index
        mapped[name] = (new if "lm_head" in name else f"model.{new}", shard)
    return mapped


def vllm_mismatches(tensors: dict, vllm: dict, mapper: dict) -> list[str]:
    """What vLLM's loader would refuse or leave unfilled when given ``tensors``."""
    problems, stacked = [], {}
    mapped = served_names_to_vllm(tensors, mapper)
    for name, (vllm_name, shard) in mapped.items():
        if vllm_name not in vllm:
            problems.append(f"{name} -> {vllm_name}: no such parameter")
        elif shard is None and tuple(tensors[name].shape) != vllm[vllm_name]:
            problems.append(f"{name}: {tuple(tensors[name].shape)} != {vllm[vllm_name]}")
        elif shard is not None:
            stacked.setdefault(vllm_name, []).append((shard, tuple(tensors[name].shape)))
    for vllm_name, parts in stacked.items():
        rows = tuple(shape[0] for _, shape in sorted(parts))
        if rows != vllm[vllm_name.replace(".weight", ".shards")] or {s[1] for _, s in parts} != {vllm[vllm_name][1]}:
            problems.append(f"{vllm_name}: shards {sorted(parts)} != {vllm[vllm_name]}")
    loaded = {n for n, _ in mapped.values()}
    unfilled = {n for n in vllm if n.endswith(".weight") or n == "draft_id_to_target_id"} - loaded
    problems += [f"{n}: not in the checkpoint" for n in sorted(unfilled - {"model.embed_tokens.weight"})]
    return problems


def test_exported_names_and_shapes_are_what_the_vllm_class_builds(exported):
    wheel = vllm_wheel()
    if wheel is None or not wheel.is_file():
        pytest.skip("the vllm 0.26.0 wheel is not here: pip download --no-deps vllm==0.26.0 -d /tmp/vllmwheel")
    source = VllmSource(wheel)
    cfg = json.loads((exported / "draft" / "config.json").read_text())
    ns = {"self": SimpleNamespace(config=SimpleNamespace(**cfg)), "torch": torch, "nn": torch.nn, "copy": copy,
          "getattr": getattr, "hasattr": hasattr, "len": len, "get_tensor_model_parallel_world_size": lambda: 1}
    vllm = source.shapes("Eagle3DeepseekV2ForCausalLM", ns)
    assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" in vllm  # the interpreter did reach the MLA layer
    tensors = load_file(str(exported / "draft" / "model.safetensors"))
    assert vllm_mismatches(tensors, vllm, source.mapper) == []
    # and the comparison does catch what vLLM would refuse
    attn = "layers.0.self_attn."
    wrong = {**tensors, attn + "kv_a_proj_with_mqa.weight": tensors[attn + "kv_a_proj_with_mqa.weight"][:, :64]}
    del wrong["layers.0.hidden_norm.weight"]
    wrong["layers.0.mlp.gate_proj.weight"] = wrong["layers.0.mlp.gate_proj.weight"].T
    assert len(vllm_mismatches(wrong, vllm, source.mapper)) == 3
    renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    assert vllm_mismatches(renamed, vllm, source.mapper) == []  # EAGLE-3's midlayer.* names map the same


def test_vllm_keeps_the_exported_model_type_on_the_eagle3_path(exported):
    """vLLM 0.26.0 applies SpeculativeConfig.hf_config_override to every draft config: run that
    function from the wheel's source on our exported config; it must leave the EAGLE-3 architecture
    (a deepseek_v3 model_type became DeepSeek MTP there and the H200 refused the draft)."""
    wheel = vllm_wheel()
    if wheel is None or not wheel.is_file():
        pytest.skip("the vllm 0.26.0 wheel is not here: pip download --no-deps vllm==0.26.0 -d /tmp/vllmwheel")
    with zipfile.ZipFile(wheel) as z:
        speculative = ast.parse(z.read("vllm/config/speculative.py").decode())
        registry = z.read("vllm/transformers_utils/config.py").decode()
    override = next(n for n in ast.walk(speculative)
                    if isinstance(n, ast.FunctionDef) and n.name == "hf_config_override")
    override.decorator_list = []
    namespace = {"PretrainedConfig": object}
    exec(compile(ast.Module([override], []), "speculative.py", "exec"), namespace)

    class Config(SimpleNamespace):
        def update(self, values):
            self.__dict__.update(values)

    cfg = json.loads((exported / "draft" / "config.json").read_text())
    ours = namespace["hf_config_override"](Config(**cfg))
    assert (ours.model_type, ours.architectures) == (cfg["model_type"], ["Eagle3DeepseekV3ForCausalLM"])
    assert f'{cfg["model_type"]}="DeepseekV3Config"' in registry.replace(" ", "")  # read as DeepseekV3Config
    # the comparison sees the failure the H200 showed
    mtp = namespace["hf_config_override"](Config(**{**cfg, "model_type": "deepseek_v3"}))
    assert mtp.architectures == ["DeepSeekMTPModel"]
