"""Stage export_draft: a trained draft as the directory vLLM serves: config.json + model.safetensors.

The checkpoint is speculators' ``save_pretrained`` output of an ``Eagle3DraftModel``; the export is
the same format (vLLM 0.26.0 loads it natively: vllm/transformers_utils/configs/speculators/)
with the deploy-time verifier name, K, bf16 weights, and optionally without ``embed_tokens`` (vLLM
then shares the target's, which training never changes). Everything is checked before the
directory appears, and the result is round-trip loaded with speculators against the training
target. What vLLM 0.26.0 cannot serve as trained (serving_limits.py) is refused. The model card
(README.md) is the model_card stage's, written once the draft has been evaluated.

    python -m eaglepipe.export_draft --summary results/run/train/summary.json --which best \
        --verifier-name moonshotai/Kimi-K2.5 --num-speculative-tokens 3 --drop-embedding \
        --out-dir results/run/draft
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shlex
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from . import mla_draft
from .atomic import publish_dir, read_json_object, staged_dir, write_json
from .checksum import CHECKSUM, file_checksum
from .draft_model import load_target_embedding
from .layers import aux_layer_ids
from .serving_limits import DRAFT_ARCHS, NORM_FLAGS, aux_count_error, rope_error
from .settings import add_stage_arguments

SUMMARY_KEYS = ("best", "last", "steps", "best_eval", "layer_ids", "aux_layer_ids", "target_model",
                "draft_vocab_size", "ttt_steps")
EMBED = "embed_tokens.weight"
DRAFT = ("config.json", "model.safetensors")
# which checkpoint the draft beside it was exported from: the rule's declared output (rules/export.smk)
RECORD = "export.json"


class ExportError(ValueError):
    """A checkpoint or summary that cannot be exported; the message says what and where."""


# ----------------------------------------------------------------------------- inputs
def load_summary(path: str | os.PathLike) -> dict:
    path = Path(path)
    summary = read_json_object(path, "training summary", ExportError)
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise ExportError(f"training summary {path}: missing key(s) {missing}; the trainer writes {list(SUMMARY_KEYS)}")
    aux, ids = summary["aux_layer_ids"], summary["layer_ids"]
    if not (isinstance(aux, list) and isinstance(ids, list) and aux and aux_layer_ids(ids) == aux):
        raise ExportError(
            f"training summary {path}: field aux_layer_ids {aux} must be layer_ids {ids} without the final id"
        )
    return summary


def resolve_checkpoint(summary_path: str | os.PathLike, summary: dict, which: str) -> Path:
    """The checkpoint directory the summary names as ``which`` (best/last), checked to be complete."""
    rel = summary[which]
    if not isinstance(rel, str) or not rel:
        raise ExportError(f"training summary {summary_path}: field {which!r} is {rel!r}, expected a checkpoint path")
    ckpt = (Path(summary_path).parent / rel).resolve()
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint {ckpt} (summary field {which!r}) does not exist")
    for name, why in (("COMPLETE", "it was not finished (no COMPLETE marker)"),
                      ("config.json", "config.json is missing"),
                      ("model.safetensors", "model.safetensors is missing")):
        if not (ckpt / name).is_file():
            raise ExportError(f"checkpoint {ckpt} cannot be exported: {why}")
    return ckpt


# ----------------------------------------------------------------------------- checks
def check_serving_flags(config: dict, where: str) -> None:
    """Refuse a draft whose config vLLM 0.26.0 would not load or would serve differently from how it was trained."""
    layer_config = config.get("transformer_layer_config", {})
    arch = layer_config.get("model_type")
    if arch not in DRAFT_ARCHS:
        raise ExportError(f"{where}: transformer_layer_config.model_type is {arch!r}; vLLM serves EAGLE-3 "
                          f"drafts of type {list(DRAFT_ARCHS)} only")
    unknown = sorted(k for k, v in config.items() if "norm" in k and k not in NORM_FLAGS and v)
    if unknown:
        raise ExportError(f"{where}: norm flag(s) {unknown} are set but vLLM 0.26.0 ignores them (it honours "
                          f"{list(NORM_FLAGS)}): the served draft would differ from the trained one")
    aux_error = aux_count_error(config.get("eagle_aux_hidden_state_layer_ids") or [])
    if aux_error:
        raise ExportError(f"{where}: eagle_aux_hidden_state_layer_ids: {aux_error}; extract.layer_ids must list "
                          f"3 aux ids then num_hidden_layers")
    rope = rope_error(layer_config.get("rope_parameters"))
    if rope:
        raise ExportError(f"{where}: transformer_layer_config.rope_parameters: {rope}")
    if config.get("speculators_model_type") != "eagle3":
        raise ExportError(f"{where}: speculators_model_type is {config.get('speculators_model_type')!r}, expected 'eagle3'")


def expected_shapes(config: dict) -> tuple[dict[str, tuple], set[str]]:
    """Tensor name -> shape an Eagle3DraftModel of this config saves, and the names vLLM may go without."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig(**{k: v for k, v in config.items() if k not in ("auto_map", "transformers_version")})
    with torch.device("meta"):  # shapes only: no memory, no verifier weights
        model = Eagle3DraftModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if k not in Eagle3DraftModel._keys_to_ignore_on_save}
    return shapes, {EMBED}


def check_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple], optional: set[str], where: str) -> None:
    missing = sorted(set(shapes) - set(tensors) - optional)
    if missing:
        raise ExportError(f"{where}: tensor(s) {missing} missing (the config needs {sorted(shapes)})")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise ExportError(f"{where}: unexpected tensor(s) {extra} for this config (allowed {sorted(shapes)})")
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise ExportError(f"{where}: tensor {name!r} has shape {list(t.shape)}, the config says {list(shapes[name])}")
    if "t2d" in tensors:
        t2d, d2t = tensors["t2d"].bool(), tensors["d2t"].long()
        if int(t2d.sum()) != d2t.numel() or not torch.equal(torch.nonzero(t2d).flatten(), torch.arange(d2t.numel()) + d2t):
            raise ExportError(f"{where}: d2t and t2d disagree (target id = draft index + d2t must list the "
                              f"{d2t.numel()} tokens t2d marks, ascending)")
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ExportError(f"{where}: tensor(s) {bad} hold NaN or inf values")


# ----------------------------------------------------------------------------- export
def export_config(config: dict, summary: dict, verifier_name: str, k: int, where: str) -> dict:
    """The checkpoint's speculators config with the deploy-time fields set and cross-checked."""
    aux = [int(i) for i in summary["aux_layer_ids"]]
    if config.get("eagle_aux_hidden_state_layer_ids") != aux:
        raise ExportError(f"{where}: eagle_aux_hidden_state_layer_ids {config.get('eagle_aux_hidden_state_layer_ids')} "
                          f"differ from the training summary's aux_layer_ids {aux}")
    if config.get("draft_vocab_size") != summary["draft_vocab_size"]:
        raise ExportError(f"{where}: draft_vocab_size {config.get('draft_vocab_size')} differs from the training "
                          f"summary's {summary['draft_vocab_size']}")
    if k < 1:
        raise ExportError(f"--num-speculative-tokens {k}: must be at least 1")
    out = json.loads(json.dumps(config))
    out["dtype"] = "bfloat16"
    out["eagle_aux_hidden_state_layer_ids"] = aux
    # vLLM's defaults differ from speculators' (norm_before_residual: True vs False): always write them.
    for flag in NORM_FLAGS:
        out[flag] = bool(config.get(flag, False))
    spec = out["speculators_config"]
    spec["verifier"]["name_or_path"] = verifier_name
    methods = spec.get("proposal_methods") or []
    if not methods:
        raise ExportError(f"{where}: speculators_config.proposal_methods is empty")
    methods[0]["speculative_tokens"] = int(k)
    return out


def roundtrip_check(out_dir: Path, target: str, written: dict[str, torch.Tensor], name: Path) -> None:
    """Load the export in ``out_dir`` (bound for ``name``) with speculators and compare the tensors."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(out_dir))
    cfg.speculators_config.verifier.name_or_path = target  # the deploy name need not exist here
    try:  # speculators also reads the target's head and final norm here: they must fit the draft
        model = Eagle3DraftModel.from_pretrained(str(out_dir), config=cfg, dtype=torch.bfloat16)
        if EMBED not in written:
            load_target_embedding(model, target)
    except (RuntimeError, KeyError, ValueError) as e:
        detail = " ".join(str(e).split())
        raise ExportError(f"export {name}: speculators cannot load it against the target {target} (whose "
                          f"embedding vLLM shares and whose head the draft was trained on): {detail}") from e
    state = model.state_dict()
    for key, t in written.items():
        if not torch.equal(state[key].cpu(), t):
            raise ExportError(f"export {name}: tensor {key!r} reads back different from what was written")


def export_draft(summary_path: str, which: str, verifier_name: str, k: int, drop_embedding: bool,
                 out_dir: str) -> dict:
    summary = load_summary(summary_path)
    ckpt = resolve_checkpoint(summary_path, summary, which)
    where = f"checkpoint {ckpt}"
    try:
        config = json.loads((ckpt / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{where}: config.json is not valid JSON ({e})") from e
    mla = mla_draft.is_mla_checkpoint(config)  # MLA drafts: see the "MLA drafts" section below
    (prepare_mla if mla else check_serving_flags)(config, where)
    try:
        tensors = load_file(str(ckpt / "model.safetensors"))
    except Exception as e:  # safetensors raises several error types for damaged files
        raise ExportError(f"{where}: model.safetensors cannot be read ({e})") from e
    shapes, optional = expected_shapes(config)
    check_tensors(tensors, shapes, optional, where)
    out_cfg = export_config(config, summary, verifier_name, k, where)
    written_cfg = mla_draft.served_config(out_cfg) if mla else out_cfg

    saved = 0
    if drop_embedding and EMBED in tensors:
        saved = tensors.pop(EMBED).numel() * torch.finfo(torch.bfloat16).bits // 8
    elif not drop_embedding and EMBED not in tensors:
        raise ExportError(f"{where}: --no-drop-embedding, but the checkpoint has no {EMBED}")
    # bf16 floats (the serving dtype); d2t (int64) and t2d (bool) exactly as trained.
    tensors = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in tensors.items()}

    out = Path(out_dir)
    with staged_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(written_cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        validate_export(tmp)
        (mla_roundtrip_check if mla else roundtrip_check)(tmp, summary["target_model"], tensors, out)
        record = {"checkpoint": str(ckpt), "files": {name: {"bytes": (tmp / name).stat().st_size,
                                                            CHECKSUM: file_checksum(tmp / name)} for name in DRAFT}}
        kept = deliver(tmp, out, ckpt)
        write_json(out / RECORD, record)
    return {"checkpoint": str(ckpt), "out_dir": str(out), "embedding_bytes_saved": saved, "kept": kept,
            "bytes": (out / "model.safetensors").stat().st_size}


def deliver(staged: Path, out: Path, ckpt: Path) -> bool:
    """Put the staged export in ``out``, or keep the delivered draft there when it is this export
    byte for byte (True); any other content of ``out`` is left as it is and refused, so the
    directory and the message always agree."""
    held = sorted(p.name for p in out.iterdir() if p.name != RECORD) if out.is_dir() else []
    if not held:
        publish_dir(staged, out)
        for name in DRAFT:  # read-only, as Snakemake's protected() leaves a file
            (out / name).chmod((out / name).stat().st_mode & ~0o222)
        return False
    differs = [name for name in DRAFT if not (out / name).is_file()
               or not filecmp.cmp(staged / name, out / name, shallow=False)]
    if not differs:
        return True
    what = (f"a delivered draft whose {' and '.join(differs)} differ{'s' if len(differs) == 1 else ''} from this "
            f"export of {ckpt}" if set(DRAFT) <= set(held) else "no complete draft")
    raise ExportError(f"--out-dir {out} holds {held}, {what}, and is left as it is: a delivered draft is never "
                      f"overwritten, delete it on purpose (rm -rf {shlex.quote(str(out))}) and run again")


def validate_export(draft_dir: str | os.PathLike) -> dict:
    """Check an export dir on its own: required config keys and tensor names vLLM needs. Returns the config."""
    d = Path(draft_dir)
    for name in ("config.json", "model.safetensors"):
        if not (d / name).is_file():
            raise ExportError(f"export {d}: {name} is missing")
    config = json.loads((d / "config.json").read_text())
    if mla_draft.is_served_config(config):
        validate_mla_export(d, config)
        return config
    required = ("speculators_model_type", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                "transformer_layer_config", "speculators_config", *NORM_FLAGS)
    missing = [k for k in required if k not in config]
    spec = config.get("speculators_config", {})
    if not spec.get("verifier", {}).get("name_or_path"):
        missing.append("speculators_config.verifier.name_or_path")
    if not (spec.get("proposal_methods") or [{}])[0].get("speculative_tokens"):
        missing.append("speculators_config.proposal_methods[0].speculative_tokens")
    if missing:
        raise ExportError(f"export {d / 'config.json'}: missing key(s) {missing}")
    check_serving_flags(config, f"export {d / 'config.json'}")
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    shapes, optional = expected_shapes(config)
    lacking = sorted(set(shapes) - names - optional)
    extra = sorted(names - set(shapes))
    if lacking or extra:
        raise ExportError(f"export {d / 'model.safetensors'}: missing tensor(s) {lacking}, unexpected {extra}")
    return config


# ----------------------------------------------------------------------------- MLA drafts
# An MLA draft (mla_draft.py) trains as a speculators checkpoint like any other, but vLLM 0.26.0
# serves it as Eagle3DeepseekV3ForCausalLM from a plain DeepseekV3 config (mla_draft.served_config).
def check_mla_servable(config: dict, layer: dict, where: str) -> None:
    try:
        mla_draft.check_servable(config, layer, where)
    except ValueError as e:
        raise ExportError(str(e)) from e


def prepare_mla(config: dict, where: str) -> None:
    """Refuse what vLLM would serve differently; let speculators build the layer (expected_shapes)."""
    check_mla_servable(config, config["transformer_layer_config"], where)
    mla_draft.register_with_speculators()


def validate_mla_export(d: Path, config: dict) -> None:
    """Names and shapes against what vLLM's Eagle3DeepseekV2ForCausalLM builds for this config."""
    where = f"export {d / 'config.json'}"
    missing = [k for k in ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "kv_lora_rank",
                           "num_aux_hidden_states", *NORM_FLAGS) if k not in config]
    if missing:
        raise ExportError(f"{where}: missing key(s) {missing}")
    if "speculators_config" in config:
        raise ExportError(f"{where}: has speculators_config, so vLLM would read it as the speculators format, "
                          f"which has no MLA layer")
    check_mla_servable(config, config, where)  # the layer fields are top-level here
    tensors = load_file(str(d / "model.safetensors"))
    check_tensors(tensors, mla_draft.served_shapes(config), {EMBED}, f"export {d / 'model.safetensors'} "
                  f"(as vLLM's {mla_draft.SERVED_ARCHITECTURE} loads it)")


def mla_roundtrip_check(out_dir: Path, target: str, written: dict[str, torch.Tensor], name: Path) -> None:
    """Load the MLA export as evaluation does (draft_model.load_draft) and compare the tensors."""
    from .draft_model import load_draft

    try:
        state = load_draft(out_dir, target).state_dict()
    except SystemExit as e:  # load_draft's errors are its CLI messages
        raise ExportError(f"export {name}: cannot be loaded against the target {target}: {e}") from e
    for key, t in written.items():
        if not torch.equal(state[key].to(t.dtype), t):
            raise ExportError(f"export {name}: tensor {key!r} reads back different from what was written")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", required=True, help="train/summary.json written by train_draft")
    p.add_argument("--verifier-name", required=True, help="the target name `vllm serve` is given")
    p.add_argument("--num-speculative-tokens", type=int, required=True)
    add_stage_arguments(p, "export_draft")
    p.add_argument("--out-dir", required=True)
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        info = export_draft(args.summary, args.which, args.verifier_name, args.num_speculative_tokens,
                            args.drop_embedding, args.out_dir)
    except ExportError as e:
        raise SystemExit(f"export_draft: {e}") from None
    if info["kept"]:
        print(f"kept {info['out_dir']}: the delivered draft there is this export of {info['checkpoint']}, "
              "byte for byte")
    else:
        print(f"exported {info['checkpoint']} -> {info['out_dir']} ({info['bytes']:,} bytes of weights)")
    if args.drop_embedding:
        print(f"embed_tokens left out: {info['embedding_bytes_saved']:,} bytes saved (vLLM shares the target's)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
