"""benchmarks/profile_trainer.py on CPU, on tiny-target shards: every phase timed, shares add up,
both totals, the side measurements and the torch.profiler trace are written; bad flags refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_stages import make_run

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import profile_trainer as pt  # noqa: E402


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"), tiny_llama, n_train=12, n_eval=5)


def flags(run, out: Path, *extra: str) -> list[str]:
    return ["--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(run["model"]),
            "--steps", "5", "--warmup", "1", "--batch-tokens", "64", "--ttt-steps", "3", "--device", "cpu",
            "--json", str(out), *extra]


def test_profile_on_cpu(run, tmp_path):
    out = tmp_path / "profile.json"
    # the script as the lead runs it (its own process, its sys.path set up by itself)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_trainer.py"),
                           *flags(run, out, "--torch-profiler", str(tmp_path / "trace"))],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["phases"]) == set(pt.PHASES)
    for name, v in r["phases"].items():
        assert v["median_ms"] > 0 and v["share_pct"] > 0, name
    assert sum(v["share_pct"] for v in r["phases"].values()) == pytest.approx(100, abs=0.1)
    for name in ("profiled", "unprofiled"):
        assert r[name]["steps"] == 5 and r[name]["ms_per_step"] > 0 and r[name]["tokens_per_s"] > 0
        assert 0 < r[name]["real_tokens_per_step"] <= 64
    # both runs train on the same rows (data position (0, warmup))
    assert r["profiled"]["real_tokens_per_step"] == r["unprofiled"]["real_tokens_per_step"]
    assert len(r["warmup_step_ms"]) == 1 and r["row_length"] is None  # CPU rows are not padded
    assert r["row_packing"]["median_ms"] > 0 and r["row_packing"]["row_bytes"] > 0
    assert r["loss_in_forward"]["forward_with_loss_ms"] > 0 and r["loss_in_forward"]["forward_without_loss_ms"] > 0
    assert [1.0 <= ev["acceptance_length"] <= 4.0 and ev["ms"] > 0 for ev in r["eval_passes"]] == [True, True]
    assert (tmp_path / "trace" / "trace.json").stat().st_size > 0
    assert r["torch_profiler"]["sorted_by"] == "cpu_time_total"
    assert r["torch_profiler"]["table"] == (tmp_path / "trace" / "key_averages.txt").read_text()
    assert "aten::mm" in r["torch_profiler"]["table"]
    for name in pt.PHASES:
        assert name in proc.stdout
    assert "unprofiled" in proc.stdout and "tok/s" in proc.stdout


def test_refusals(run, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        pt.main(flags(run, tmp_path / "o.json", "--steps", "0"))
    with pytest.raises(SystemExit):  # a train_draft flag is checked as train_draft checks it
        pt.main(flags(run, tmp_path / "o.json", "--ttt-steps", "0"))
    monkeypatch.setattr(pt.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        pt.main(flags(run, tmp_path / "o.json", "--device", "cuda"))
    assert not (tmp_path / "o.json").exists()


def test_a_failed_side_measurement_is_recorded(run, tmp_path, monkeypatch):
    """One run on a lent GPU: a side measurement that fails leaves the step's figures and the others."""
    def broken(*a, **kw):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(pt, "loss_part_ms", broken)
    out = tmp_path / "o.json"
    pt.main(flags(run, out, "--no-eval", "--steps", "2"))
    r = json.loads(out.read_text())
    assert r["loss_in_forward"] == {"error": "RuntimeError: compile failed"}
    assert r["profiled"]["steps"] == 2 and r["row_packing"]["median_ms"] > 0
    assert "eval_passes" not in r and "torch_profiler" not in r
