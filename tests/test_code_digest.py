from pathlib import Path

from eaglepipe.code_digest import code_digest, module_closure

PKG = Path(__file__).resolve().parents[1] / "scripts" / "eaglepipe"


def write_pkg(d: Path) -> Path:
    (d / "stage_a.py").write_text("from .shared import x\nimport json\n")
    (d / "stage_b.py").write_text("from eaglepipe import helper\n")
    (d / "shared.py").write_text("from eaglepipe.deep import y\nx = 1\n")
    (d / "deep.py").write_text("y = 2\n")
    (d / "helper.py").write_text("z = 3\n")
    return d


def test_closure_follows_relative_absolute_and_transitive_imports(tmp_path):
    pkg = write_pkg(tmp_path)
    assert module_closure(pkg, "stage_a") == ["deep", "shared", "stage_a"]
    assert module_closure(pkg, "stage_b") == ["helper", "stage_b"]


def test_digest_changes_only_with_code_the_stage_runs(tmp_path):
    pkg = write_pkg(tmp_path)
    a, b = code_digest(pkg, "stage_a"), code_digest(pkg, "stage_b")
    (pkg / "deep.py").write_text("y = 3\n")  # imported by stage_a through shared
    assert code_digest(pkg, "stage_a") != a
    assert code_digest(pkg, "stage_b") == b


def test_real_stages_cover_their_shared_modules():
    assert {"shards", "layers", "extract_hf", "extract_vllm", "shard_pipeline", "disk_budget",
            "tokenized_samples"} <= set(module_closure(PKG, "extract_hidden_states"))
    assert "tokenized_samples" in module_closure(PKG, "benchmark_serving")
    assert {"shards", "draft_model", "acceptance"} <= set(module_closure(PKG, "train_draft"))
