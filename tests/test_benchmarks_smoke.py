"""The benchmarks run end to end (tiny budgets): the faithfulness tables, scaling, the harness."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def benchmarks_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def test_faithfulness_tables_for_text_and_images(benchmarks_on_path, capsys):
    pytest.importorskip("shap")
    import faithfulness

    results = faithfulness.main(["--smoke", "--tasks", "planted", "shape", "--paired", "AttnLRP"])
    text, image = results
    assert {"token F1", "AUPRC", "comprehensiveness", "sufficiency", "flipped", "× fwd+bwd"} <= set(text["methods"]["Grad-SAM"])
    assert "pointing game" in image["methods"]["Transformer Attribution"]
    assert len(text["methods"]) == 30 and {
        "Grad-SAM (key axis)", "AttnLRP", "ALTI", "Value Zeroing", "DecompX", "DecompX (sensitivity)", "AttnLRP, greedy (8 removals)",
        "Knockout Gradient", "Knockout Gradient + AttnLRP", "AttnLRP at presence 0.1", "AttnLRP at presence 0.05",
        "AttnLRP at presence 0.05, calibrated (8 ablations)", "AttnLRP at presence 0.05, in half contexts (8)",
    } <= set(text["methods"])
    for result in results:
        for name, row in result["methods"].items():
            assert 0 <= row["AUPRC"] <= 1, name
            assert row["ms / example"] > 0 and math.isfinite(row["× fwd+bwd"])
    printed = capsys.readouterr().out
    assert "| SHAP Partition (40 evals) |" in printed and "python benchmarks/faithfulness.py --smoke" in printed
    paired = text["paired"]["AttnLRP"]
    assert "AttnLRP" not in paired and len(paired) == 29
    assert list(paired["Grad-SAM"]) == ["token F1", "comprehensiveness", "sufficiency", "LDS"]
    for metric in paired["Grad-SAM"]:
        mine, theirs = torch.tensor(text["each"]["AttnLRP"][metric]), torch.tensor(text["each"]["Grad-SAM"][metric])
        difference = (mine - theirs)[~(mine - theirs).isnan()]
        assert paired["Grad-SAM"][metric]["mean"] == pytest.approx(difference.mean().item())
        assert paired["Grad-SAM"][metric]["standard error"] == pytest.approx(difference.std().item() / len(difference) ** 0.5)
        assert text["methods"]["AttnLRP"][metric] == pytest.approx(mine.nanmean().item())
    assert "AttnLRP minus each method on the same examples" in printed and "| Grad-SAM | " in printed
    with pytest.raises(SystemExit):
        faithfulness.main(["--smoke", "--tasks", "planted", "--methods", "Saliency", "--paired", "AttnLRP"])
    assert "--paired 'AttnLRP' is not among the methods run: Saliency." in capsys.readouterr().err


def test_calibrated_text_gives_each_budgets_lds_and_its_paired_difference_to_contextcite(benchmarks_on_path, capsys):
    import calibrated_text

    result = calibrated_text.main(["--smoke", "--forwards", "1", "4"])
    assert result["reference"] == "ContextCite, 4" and list(result["rows"]) == [
        "AttnLRP at presence 0.05", "calibrated, 1", "ContextCite, 1", "calibrated, 4", "ContextCite, 4", "in half contexts, 4",
    ]  # half contexts come in complementary pairs: none for an odd budget
    assert list(result["seconds"]) == ["AttnLRP at presence 0.05", *(name for name in result["rows"] if ", " in name)]
    reference, presence = (torch.tensor(result["each"][name]) for name in ("ContextCite, 4", "AttnLRP at presence 0.05"))
    for name, row in result["rows"].items():
        values = torch.tensor(result["each"][name])
        assert row["defined on"] == int((~values.isnan()).sum())
        assert row["forwards"] == (int(name.split(", ")[1]) if ", " in name else 1)
        for against, key in ((reference, "difference"), (presence, "minus the presence")):
            difference = (values - against)[~(values - against).isnan()]
            if len(difference):
                assert row[key] == pytest.approx(difference.mean().item()) and row["LDS"] == pytest.approx(values.nanmean().item())
    assert result["rows"]["ContextCite, 4"]["difference"] == 0
    assert "| calibrated, 4 | 4 |" in capsys.readouterr().out


def test_calibrated_text_averages_each_sentences_lds_over_the_draws(benchmarks_on_path):
    import calibrated_text

    result = calibrated_text.main(["--smoke", "--forwards", "4", "--draws", "1", "2"])
    assert result["reference"] == "ContextCite, 4, mean over draws" and list(result["rows"]) == [
        "AttnLRP at presence 0.05", *(f"{name}, 4, {draw}" for name in ("calibrated", "ContextCite", "in half contexts")
                                      for draw in ("draw 1", "draw 2", "mean over draws")),
    ]
    for name in ("calibrated", "ContextCite", "in half contexts"):
        draws = torch.tensor([result["each"][f"{name}, 4, draw {seed}"] for seed in (1, 2)])
        assert not torch.equal(*draws.nan_to_num(2.0))  # other ablations, other scores (NaN: LDS undefined)
        torch.testing.assert_close(torch.tensor(result["each"][f"{name}, 4, mean over draws"]), draws.nanmean(0))


def test_scaling_reports_time_and_memory_ratios(benchmarks_on_path, tmp_path, capsys, monkeypatch):
    import scaling

    from captum_attention.maps import streaming

    for table in ("FUSED_DEVICES", "FUSED_KERNEL_DEVICES"):  # --reduction sets them for the process
        monkeypatch.setattr(streaming, table, dict(getattr(streaming, table)))
    saved = tmp_path / "scaling.json"
    arguments = ["--lengths", "32", "16", "--batches", "1", "2", "--batch-length", "16", "--eager-max", "16", "--here"]
    results = scaling.main(["--model", "llama", "--reduction", "eager", "--json", str(saved), *arguments])
    assert not streaming.FUSED_DEVICES["cpu"] and not streaming.FUSED_KERNEL_DEVICES["cpu"]
    assert [(r["batch"], r["length"]) for r in results] == [(1, 16), (1, 32), (2, 16)], "the cheapest first"
    capsys.readouterr()
    scaling.main(["--tables", str(saved)])  # the saved rows, printed again
    printed = capsys.readouterr().out
    assert "llama (float32) on CPU" in printed and "eager block reduction" in printed and "| 2 | 16 |" in printed
    for result in results:
        runs = result["runs"]
        for name in scaling.STREAMED:
            assert runs[name]["ms"] > 0 and runs[name]["MiB"] >= 0
        assert ("GradSAM (eager)" in runs) == (result["length"] <= 16)
    assert "| 1 | 32 |" in scaling.table(results)
    # one run in a fresh subprocess, as the script measures on CPU by default
    options = scaling.parse(["--model", "bert", "--lengths", "16"])
    assert scaling.measure_in_subprocess(options, "GradSAM", 1, 16)["MiB"] >= 0


def test_pytest_benchmark_harness_smoke():
    pytest.importorskip("pytest_benchmark")
    env = {**os.environ, "CAPTUM_ATTENTION_BENCH_SMOKE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable", str(BENCHMARKS / "bench_overhead.py")],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "14 passed" in out.stdout  # the sdpa and eager baselines and each registered method in both modes


@pytest.mark.parametrize("model", ["llama", "gpt-oss"])
def test_the_key_bias_and_the_block_reduction_are_timed_in_turns_on_the_same_scores(benchmarks_on_path, tmp_path, model):
    """On the Llama (sdpa) and on gpt-oss (sinks, computed explicitly): every run timed,
    both paths' scores the same (the benchmark checks them), the switch put back."""
    import key_bias_in_turns

    from captum_attention.capture import kernel

    saved = tmp_path / "turns.json"
    (row,) = key_bias_in_turns.main(["--model", model, "--lengths", "48", "--repeats", "1", "--json", str(saved)])
    expected = {"forward+backward (sdpa)", *(f"{name}{suffix}" for name in ("KnockoutGradient", "KnockoutLRP") for suffix in ("", key_bias_in_turns.BLOCKS))}
    assert set(row["seconds"]) == expected and row["ratios"]["forward+backward (sdpa)"] == 1.0
    assert json.loads(saved.read_text())["results"][0]["length"] == 48
    assert key_bias_in_turns.probes.key_bias_applies is kernel.key_bias_applies


def test_the_device_checks_run_dry_on_the_cpu(benchmarks_on_path, capsys):
    """``gpu_run.sh``'s agreement checks with the CPU in the card's place: each runs to its
    verdict (a method a family does not support is named as refused), so that a card's
    few minutes go to measuring, not to a script's error. Streaming against eager on the
    CPU within 1e-5; the same device and mode, exactly."""
    import gpu_check

    assert gpu_check.main(("cpu", "cpu")) <= 1e-5
    checks = (gpu_check.family_agreement, gpu_check.answer_agreement, gpu_check.context_mixing_agreement,
              gpu_check.seq2seq_answer_agreement, gpu_check.architecture_agreement)
    assert [check(("cpu", "cpu")) for check in checks] == [0.0] * len(checks)
    printed = capsys.readouterr().out
    assert printed.count("PASS") == 1 + len(checks) and "FAIL" not in printed
    assert "| nn.MultiheadAttention | AttnLRP | refused: AttnLRP's rules cover" in printed
    assert "attention_permutation median TVD: max |cuda-cpu| = 0.00e+00" in printed


def test_the_widened_heads_are_timed_per_backend_and_refusals_named(benchmarks_on_path, capsys):
    """The device script's question, run on the CPU: sdpa with heads of 64, 65 and 72."""
    import gpu_check

    gpu_check.widened_heads("cpu", length=16)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith(("| bfloat16", "| float32"))]
    assert [row[1] for row in rows] == ["64", "65", "72"] * 2
    assert all(float(row[-1].rstrip(" |")) > 0 for row in rows)  # the math backend takes every shape
    assert any("refused" in row for row in rows), "CUDA's backends refuse a CPU tensor"


def test_deletions_batched_by_length_cost_more_forwards_for_the_same_numbers(benchmarks_on_path, capsys):
    import length_batches

    rows = length_batches.main(["--smoke"])  # it checks that both ways give the same numbers
    assert [row["metric"] for row in rows] == ["comprehensiveness", "LDS (32 halves)", "leave-one-out", "LDS (64 ablations)", "top-k drop"]
    assert all(row["length_forwards"] > row["padded_forwards"] for row in rows)
    assert "time ratio" in capsys.readouterr().out


def test_a_vision_language_answers_metrics_are_timed_both_ways_with_the_same_values(benchmarks_on_path, capsys):
    import vlm_context_metrics

    rows = vlm_context_metrics.main(["--tower-layers", "1", "--image-size", "56", "--ablations", "4", "--repeats", "1"])
    assert list(rows) == ["forward", "LDS (4 ablations)", "top-k drop (k = 1, 3, 5)"]  # it checks that both give the same values
    assert all(row["encoded_once_s"] > 0 and row["tower_per_prompt_s"] > 0 for row in rows.values())
    assert "| LDS (4 ablations) |" in capsys.readouterr().out


def test_flow_cost_reports_both_times(benchmarks_on_path, capsys):
    import flow_cost

    results = flow_cost.main(["--smoke", "--lengths", "8", "12", "--repeats", "1"])
    assert set(results) == {8, 12} and all(flow > 0 and rollout > 0 for flow, rollout in results.values())
    assert "ratio" in capsys.readouterr().out


def test_cold_start_compares_the_first_call_with_a_warm_one(tmp_path):
    result = tmp_path / "cold.json"
    subprocess.run(
        [sys.executable, str(BENCHMARKS / "cold_start.py"), "--length", "128",
         "--processes", "1", "--methods", "grad_sam", "--json", str(result)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    (row,) = json.loads(result.read_text())
    assert row["cold_s"] > 0 and row["warm_s"] > 0 and row["cold_compiling_at_once_s"] > 0


def test_vlm_pointing_scores_every_method_and_captums_peers(benchmarks_on_path, tmp_path, capsys):
    import vlm_pointing

    saved = tmp_path / "pointing.json"
    vlm_pointing.main(["--examples", "6", "--ig-steps", "1", "4", "--methods", "rollout", "attn_lrp", "--json", str(saved)])
    results = json.loads(saved.read_text())
    names = set(results["methods"])
    assert names == {
        "Attention Rollout", "AttnLRP", "Attention Rollout → vision tower", "AttnLRP → pixels (grey reference)",
        "AttnLRP → pixels (reference 0)", vlm_pointing.FEATURE_ABLATION,
        *(vlm_pointing.integrated_gradients_name(steps) for steps in (1, 4)),
    }
    for row in results["methods"].values():
        assert 0 <= row["pointing"] <= 1 and row["ms per example"] > 0 and math.isfinite(row["top-4 drop"])
    assert "| Attention Rollout → vision tower |" in capsys.readouterr().out


def test_caption_pointing_scores_every_method_with_the_patch_metrics(benchmarks_on_path, tmp_path, capsys):
    import caption_pointing

    saved = tmp_path / "caption.json"
    caption_pointing.main(["--examples", "4", "--ig-steps", "2", "--train-size", "64", "--confidence", "0", "--json", str(saved)])
    results = json.loads(saved.read_text())
    assert [row["method"] for row in results["rows"]] == [
        "grad_sam", "rollout", "transformer_attribution", "raw", "attn_lrp", caption_pointing.INTEGRATED_GRADIENTS]
    for row in results["rows"]:
        assert 0 <= row["pointing"] <= 1 and row["ms per example"] > 0 and math.isfinite(row["top-4 drop"])
    assert "| attn_lrp |" in capsys.readouterr().out


def test_needle_points_where_the_needle_decides_and_compares_on_the_peers_contexts(benchmarks_on_path):
    """On an untrained needle model (the benchmark's own is trained for minutes): pointing
    over the contexts the needle decides, the values per context, and the LDS of each
    method on the contexts the peers ran on."""
    import needle

    from captum_attention.demo.needle import _new_model, needle_example

    model = _new_model(0).eval()
    generator = torch.Generator().manual_seed(0)
    examples = [needle_example(48, generator) for _ in range(3)]
    ours = needle.evaluate(model, needle.our_method(model, "attn_lrp"), examples)
    peer = needle.evaluate(model, needle.context_cite(model, 8), examples[:2])
    each = ours["each"]
    assert len(each["lds"]) == ours["examples"] == 3 and len(peer["each"]["lds"]) == 2
    assert each["decides"] == [needle.needle_decides(model, e) for e in examples]
    decided = [points for points, decides in zip(each["points"], each["decides"]) if decides]
    assert ours["decisive"] == len(decided)
    assert ours["pointing_decisive"] == (sum(decided) / len(decided) if decided else 0.0)
    given = needle.evaluate(model, needle.our_method(model, "attn_lrp"), examples[:2], each["decides"])
    assert given["each"]["decides"] == each["decides"][:2] and given["each"]["lds"] == each["lds"][:2]
    printed = needle.table([{"length": 48, "accuracy": 1.0, "methods": {"attn_lrp": ours, "context_cite": peer}}])
    lds_on_shared = [value for value in each["lds"][:2] if value == value]
    assert f"| 48 | 2 | attn_lrp | {sum(lds_on_shared) / max(len(lds_on_shared), 1):.2f} |" in printed
    assert f"| 48 | 2 | context_cite | {peer['lds']:.2f} |" in printed
    for prior, shares in (("attn_lrp", False), ("knockout_lrp", False), ("knockout_gradient", True)):
        estimated = needle.evaluate(model, needle.estimated(model, 1, prior, shares), examples[:1])
        assert estimated["examples"] == 1 and len(estimated["each"]["lds"]) == 1
    halves = needle.in_half_contexts(model, 2)(examples[0])
    assert halves.shape == examples[0].input_ids.shape and bool(halves[examples[0].segments < 0].eq(0).all())


def test_recall_estimates_give_every_methods_lds_and_leave_one_out_is_its_own(benchmarks_on_path):
    """On an untrained recall model: one sequence's LDS for each method, in [-1, 1] (NaN
    where a method's scores are constant)."""
    import recall_estimates

    from captum_attention.demo.recall import RecallTraining, _new_model, recall_batch

    model = _new_model(0).eval()
    batch = recall_batch(1, RecallTraining(), seed=0)
    ids, answer = batch.input_ids[:, : int(batch.answer_positions[0, 0])], batch.answers[:, :1]
    found = recall_estimates.sequence_lds(model, ids, answer)
    assert list(found) == ["AttnLRP", "KnockoutGradient", "KnockoutLRP", "estimates, 1 exact", "estimates, 2 exact",
                           "leave-one-out (every pair deleted)", "estimates, 1 exact, by share", "estimates, 2 exact, by share",
                           "AttnLRP in 8 half contexts"]
    assert all(-1.0 <= value <= 1.0 for value in found.values() if value == value)


def test_the_lds_ceiling_scores_a_least_squares_fit_and_feature_ablation_on_the_same_ablations(benchmarks_on_path):
    """The fit recovers an additive outcome's weights; on an untrained needle model, both
    scorings' LDS on one context lie in [-1, 1]."""
    import lds_ceiling

    kept = torch.rand(40, 6, generator=torch.Generator().manual_seed(0)) < 0.5
    weights = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0, -0.25], dtype=torch.float64)
    fitted = lds_ceiling.least_squares_weights(kept, 0.7 + kept.double() @ weights)
    torch.testing.assert_close(fitted, weights)

    from captum_attention.demo.needle import _new_model, needle_example

    model = _new_model(0).eval()
    found = lds_ceiling.context_lds(model, needle_example(48, torch.Generator().manual_seed(0)), ablations=16)
    assert list(found) == ["least squares", "Feature Ablation"]
    assert all(-1.0 <= value <= 1.0 for value in found.values() if value == value)


def test_the_ablation_peers_recover_a_model_additive_in_its_tokens(benchmarks_on_path):
    """On logits whose log-odds are the sum of per-token weights, ContextCite's surrogate
    finds the weights (up to its Lasso's shrinkage) and leave-one-out the exact drops."""
    pytest.importorskip("sklearn")
    import explainers
    import tasks

    weights = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, -0.5, 0.25, 2.0, -1.0, 0.75])

    class Additive(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            log_odds = (weights[input_ids] * attention_mask).sum(dim=1)
            return SimpleNamespace(logits=torch.stack([torch.zeros_like(log_odds), log_odds], dim=1))

    cls, sep, pad = tasks.CLS, tasks.SEP, tasks.PAD
    ids = torch.tensor([[cls, 4, 5, 6, 7, 8, 9, sep], [cls, 7, 4, 9, sep, pad, pad, pad]])
    mask = (ids != pad).long()
    keep = (ids == cls) | (ids == sep)
    task = tasks.Task("additive", Additive(), ids, mask, torch.ones(2, dtype=torch.long), ~keep & (mask == 1), keep)
    target = torch.ones(2, dtype=torch.long)
    removable = (mask == 1) & ~keep
    expected = weights[ids].masked_fill(~removable, 0.0)
    torch.testing.assert_close(explainers.context_cite(task, target), expected, atol=0.05, rtol=0.0)
    total = expected.sum(dim=1, keepdim=True)
    drops = (torch.sigmoid(total) - torch.sigmoid(total - expected)).masked_fill(~removable, 0.0)
    torch.testing.assert_close(explainers.leave_one_out_deletion(task, target), drops, atol=1e-6, rtol=0.0)


def test_value_zeroing_precision_gives_each_ways_cost_and_error(benchmarks_on_path, capsys):
    import value_zeroing_precision

    (row,) = value_zeroing_precision.main(["--lengths", "24", "--repeats", "1", "--device", "cpu"])
    copies, as_is = row["float32 copies"], row["bfloat16 re-runs"]
    assert copies["error / scale"] < as_is["error / scale"] / 3  # the float32 copies are the precise way
    assert copies["× fwd+bwd"] > 1 and as_is["× fwd+bwd"] > 1 and row["forward+backward ms"] > 0
    assert "| 24 | " in capsys.readouterr().out
