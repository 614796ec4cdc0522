"""The benchmarks run end to end (tiny budgets): the faithfulness tables, scaling, the harness."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def benchmarks_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def test_faithfulness_tables_for_text_and_images(benchmarks_on_path, capsys):
    pytest.importorskip("shap")
    import faithfulness

    results = faithfulness.main(["--smoke", "--tasks", "planted", "shape"])
    text, image = results
    assert {"token F1", "AUPRC", "comprehensiveness", "sufficiency", "flipped", "× fwd+bwd"} <= set(text["methods"]["Grad-SAM"])
    assert "pointing game" in image["methods"]["Transformer Attribution"]
    assert len(text["methods"]) == 9
    for result in results:
        for name, row in result["methods"].items():
            assert 0 <= row["AUPRC"] <= 1, name
            assert row["ms / example"] > 0 and math.isfinite(row["× fwd+bwd"])
    printed = capsys.readouterr().out
    assert "| SHAP Partition (40 evals) |" in printed and "python benchmarks/faithfulness.py --smoke" in printed


def test_scaling_reports_time_and_memory_ratios(benchmarks_on_path):
    import scaling

    results = scaling.main(
        ["--lengths", "16", "32", "--batches", "1", "2", "--batch-length", "16", "--repeats", "1", "--no-memory"]
    )
    assert [(r["batch"], r["length"]) for r in results] == [(1, 16), (1, 32), (2, 16)]
    for result in results:
        for name in scaling.BASELINE:
            assert result["runs"][name]["× time"] > 0
    # memory: one call in this process (the script measures each in a fresh subprocess)
    runs = scaling.workloads(1, 64, "cpu")
    assert scaling.peak_bytes(runs["GradSAM"], "cpu") >= 0


def test_pytest_benchmark_harness_smoke():
    pytest.importorskip("pytest_benchmark")
    env = {**os.environ, "CAPTUM_ATTENTION_BENCH_SMOKE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable", str(BENCHMARKS / "bench_overhead.py")],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 passed" in out.stdout
