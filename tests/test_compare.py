"""results/compare.py: the budget plan, the equal-NFE interpolation, and a tiny end-to-end comparison (seconds per run)
that writes raw logs, tables and plots and skips finished runs when run again."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "results"))
import compare  # noqa: E402


def test_plan_gives_each_config_the_nfe_budget_in_whole_evaluation_blocks():
    a = argparse.Namespace(iterations=0, eval_every=5, min_iterations=10, budget_nfe=61_440, configs=list(compare.CONFIGS))
    iters = compare.plan(a)
    assert iters["flow_grpo"] == 20 and iters["dense_n1"] == 40 and iters["g2rpo_L123"] == 10
    assert iters["dancegrpo"] == 30 and iters["mixgrpo"] == 35 and iters["mixgrpo_flash"] == 55
    for c, n in iters.items():
        nfe = compare.planned_per_iteration(c)  # from the file's own planned_nfe
        assert n % 5 == 0 and n >= 10 and n * nfe >= 61_440, c
        assert n == 10 or (n - 5) * nfe < 61_440, c  # the smallest such count
    a.iterations = 3
    assert set(compare.plan(a).values()) == {3}


def test_interpolation_between_evaluations():
    curve = [{"nfe": 0.0, "x": 1.0}, {"nfe": 100.0, "x": 2.0}, {"nfe": 300.0, "x": 0.0}]
    assert compare.at(curve, "nfe", 50.0, "x") == pytest.approx(1.5)
    assert compare.at(curve, "nfe", 200.0, "x") == pytest.approx(1.0)
    assert compare.at(curve, "nfe", 300.0, "x") == pytest.approx(0.0)
    assert compare.at(curve, "nfe", 301.0, "x") is None


@pytest.mark.slow
def test_tiny_comparison_end_to_end_and_resumable(tmp_path):
    runs, out, tiny = tmp_path / "runs", tmp_path / "out", ["--group-size", "3", "--prompts-per-iteration", "1"]
    # an interrupted run (flow_grpo seed 0 stopped after its checkpoint at iteration 1) and one that died before any
    pre = subprocess.run([sys.executable, "flow_grpo.py", "--model", "toy", "--seed", "0", "--output-dir",
                          str(runs / "flow_grpo" / "seed0"), "--exp-name", "flow_grpo", "--num-iterations", "1",
                          "--eval-every", "1", "--eval-num", "4", "--save-every", "1", "--log-images-every", "0", *tiny],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert pre.returncode == 0, pre.stderr[-2000:]
    (runs / "dense_n1" / "seed1" / "dead_run").mkdir(parents=True)
    cmd = [sys.executable, os.path.join(ROOT, "results", "compare.py"), "--configs", "flow_grpo", "dense_n1",
           "--seeds", "0", "1", "--iterations", "2", "--eval-every", "1", "--eval-num", "4", "--workers", "2",
           "--extra", " ".join(tiny), "--runs-dir", str(runs), "--out", str(out)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "start flow_grpo seed 0 (resumed)" in first.stdout and "start dense_n1 seed 1\n" in first.stdout
    assert not (runs / "dense_n1" / "seed1" / "dead_run").exists()
    for c in ("flow_grpo", "dense_n1"):
        for s in (0, 1):
            raw = json.load(open(out / "raw" / f"{c}__seed{s}.json"))
            assert sorted(raw["evals"]) == ["0", "1", "2"] and len(raw["evals"]["2"]["toy_strict"]) == 4
            assert [r["iteration"] for r in raw["metrics"]] == [0, 1, 2]
            assert all(r["perf/nfe_per_iteration"] > 0 for r in raw["metrics"][1:])
            (run,) = os.listdir(runs / c / f"seed{s}")
            assert not os.path.exists(runs / c / f"seed{s}" / run / "checkpoints")  # pruned once collected
    tables = open(out / "tables.md").read()
    for heading in ("## Equal iterations (2)", "## Equal NFE", "## Cost", "| flow_grpo | 2 | 2.0 |", "| dense_n1 | 2 | 2.0 |",
                    "| flow_grpo | 48 | 48 |"):  # rollout NFE per prompt = its closed form G T = 3 x 16
        assert heading in tables, heading
    for fig in compare.FIGURES:
        assert os.path.getsize(out / f"{fig}.png") > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 runs to do" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    changed = subprocess.run([*cmd[:-4], "--eval-num", "8", *cmd[-4:]], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert changed.returncode == 1 and "was made with" in changed.stderr and "not {" in changed.stderr, changed.stderr
