"""benchmarks/serving_spread.py on benchmark_serving-shaped files: per run and per setting figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def serving(target_ms: float, draft_ms: float, al: float, k: int = 3) -> dict:
    return {"points": [
        {"concurrency": 1, "k": None, "mean_tpot_ms": target_ms},
        {"concurrency": 4, "k": None, "mean_tpot_ms": target_ms / 2},
        {"concurrency": 1, "k": k, "mean_tpot_ms": draft_ms, "acceptance_length": al,
         "speedup": round(target_ms / draft_ms, 3)},
    ]}


def run(tmp_path: Path, files: dict[str, dict], *extra: str) -> subprocess.CompletedProcess:
    args = []
    for name, (label, data) in files.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        args.append(f"{label}={path}")
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving_spread.py"), *args, *extra],
                          capture_output=True, text=True)


def test_per_setting_means_ranges_and_ratio(tmp_path):
    out = tmp_path / "spread.json"
    r = run(tmp_path, {"a1": ("small", serving(1.6, 1.28, 2.0)), "b1": ("default", serving(1.8, 1.8, 2.0)),
                       "a2": ("small", serving(1.6, 1.6, 2.0)), "b2": ("default", serving(1.8, 1.5, 2.0))},
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert [row["setting"] for row in result["runs"]] == ["small", "default", "small", "default"]
    # the step costs AL x ms with the draft / ms alone target steps: 2.0 x 1.28 / 1.6
    assert result["runs"][0]["step_in_target_steps"] == pytest.approx(1.6)
    small, default = result["by_setting"]["small"], result["by_setting"]["default"]
    assert small["runs"] == default["runs"] == 2
    assert small["speedup"] == {"mean": pytest.approx((1.25 + 1.0) / 2), "min": 1.0, "max": 1.25}
    assert default["speedup"]["mean"] == pytest.approx((1.0 + 1.2) / 2)
    assert small["speedup_vs_first"] == 1.0
    assert default["speedup_vs_first"] == pytest.approx(1.1 / 1.125, abs=1e-4)
    assert "| small | 2 |" in r.stdout and "0.978x" in r.stdout


def test_a_file_without_the_k_is_named(tmp_path):
    r = run(tmp_path, {"a": ("small", serving(1.6, 1.3, 2.0, k=2))})
    assert r.returncode != 0 and "no concurrency-1 point for K=3" in r.stderr


def test_a_bad_argument_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving_spread.py"), str(tmp_path / "x.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "give LABEL=serving.json" in r.stderr
