"""results/compare.py: the budget plan, the equal-NFE interpolation, and a tiny end-to-end comparison (seconds per run)
that writes raw logs, tables and plots and skips finished runs when run again."""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
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


def test_the_equal_compute_plan_gives_every_file_at_least_60_flow_grpo_iterations_of_nfe():
    a = argparse.Namespace(iterations=0, eval_every=10, min_iterations=10, budget_nfe=compare.EQUAL_SETTINGS["budget_nfe"],
                           configs=list(compare.EQUAL), equal=True, seeds=None)
    iters = compare.plan(a)
    assert compare.EQUAL_SETTINGS["budget_nfe"] == 60 * compare.planned_per_iteration("flow_grpo") == 184_320
    assert iters["flow_grpo"] == 60 and iters["diffusion_nft"] == 50 and iters["awm"] == 60
    for c, n in iters.items():
        nfe = compare.planned_per_iteration(c)
        assert n % 10 == 0 and n * nfe >= 184_320 and (n - 10) * nfe < 184_320, c
    assert {c: len(compare.seeds_of(a, c)) for c in compare.EQUAL} == compare.EQUAL
    assert min(compare.EQUAL.values()) >= 5 and all(compare.EQUAL[c] == 10 for _, x, y, _ in compare.EFFICIENCY
                                                      for c in (x, y))


def run(gain, nfe_per_iteration, *, pairs=8, spread=0.002, base=0.5, iterations=(0, 10, 20)):
    """Evaluations of a synthetic run whose mean change grows linearly to `gain` at the last one; each pair's change
    differs from the mean by a fixed +-spread (summing to 0), so that resampling the pairs moves the mean a little."""
    jitter = np.array([spread * (-1) ** k for k in range(pairs)])
    points = []
    for i in iterations:
        g = gain * i / iterations[-1]
        scores = base + g + jitter * (i > 0)
        points.append({"iteration": i, "nfe": nfe_per_iteration * i, "cpu": nfe_per_iteration * i / 100,
                       "train": float(scores.mean()), compare.S: float(scores.mean()),
                       "pairs": {"train": scores, compare.S: scores}})
    return points


def test_the_nfe_to_reach_a_reward_and_the_speed_up():
    X, Y = np.array([[0.0, 100.0, 200.0]]), np.array([[0.0, 0.01, 0.03]])
    assert compare.first_reach(X, Y, [0.02])[0] == pytest.approx(150.0)
    assert compare.first_reach(X, Y, [0.0])[0] == 0.0 and np.isnan(compare.first_reach(X, Y, [0.031])[0])
    assert compare.value_at(X, Y, 150.0)[0] == pytest.approx(0.02) and np.isnan(compare.value_at(X, Y, 201.0)[0])
    longer = (0, 10, 20, 40)
    cv = {"a": [run(g, 50.0, iterations=longer) for g in (0.06, 0.062, 0.058)],
          "b": [run(g, 100.0) for g in (0.03, 0.032, 0.028)]}
    x, y, _, _ = compare.resampled_curve(cv["b"], "nfe", "train", config="b")
    assert list(x) == [0.0, 1000.0, 2000.0] and y == pytest.approx([0.0, 0.015, 0.03])
    # b reaches its own gain at 2,000 NFE, a (twice b's gain per NFE) at 1,000: a speed-up of 2
    (row,) = compare.speedup_rows(cv, [("a beats b", "a", "b", "better")], 2000.0)[2:]
    cells = row.split(" | ")
    assert cells[2].startswith("2.00x [") and cells[3] == "**supported**", row
    cv["a"] = [run(0.01, 150.0) for _ in range(3)]  # below b's gain all through a longer run: slower
    (row,) = compare.speedup_rows(cv, [("a beats b", "a", "b", "better")], 2000.0)[2:]
    assert "| a never reaches it [0.00x, " in row and "**not supported**" in row, row
    # the resamples of a row depend on its own runs only: another config's rows, before or beside it, change nothing
    cv = {"a": [run(g, 50.0, iterations=longer) for g in (0.06, 0.062, 0.058)],
          "b": [run(g, 100.0) for g in (0.03, 0.032, 0.028)]}
    alone = compare.speedup_rows(cv, [("a beats b", "a", "b", "better")], 2000.0)
    cv["c"] = [run(g, 70.0) for g in (0.02, 0.04)]
    assert compare.speedup_rows(cv, [("c beats b", "c", "b", "better"), ("a beats b", "a", "b", "better")],
                                2000.0)[3:] == alone[2:]


def test_a_reach_cell_never_drops_a_resample():
    """The NFE to reach a target: a resample whose curve misses it counts from the curve's last NFE to infinity, so a
    row that misses it often has an unbounded interval ('not reached' as its upper end), and one that never reaches
    it says so."""
    xs = [run(0.03, 100.0, spread=0.02) for _ in range(5)]  # ends at +0.03 exactly: half the resamples miss +0.03
    target = (0.03, np.full(compare.st.RESAMPLES, 0.03))
    value, least, most = compare.to_reach(xs, "nfe", target, config="x")
    assert value == pytest.approx(2000.0) and 0.2 < np.isinf(most).mean() < 0.8
    assert np.all(least[np.isinf(most)] == 2000.0)  # its last evaluation
    assert compare.reach_cell(value, least, most, seeds=5).endswith(", not reached]")
    value, least, most = compare.to_reach(xs, "nfe", (0.05, np.full(compare.st.RESAMPLES, 0.05)), config="x")
    assert value is None and compare.reach_cell(value, least, most, seeds=5) == "not reached [2,000, not reached]"


def test_cpu_time_counts_in_flow_grpo_iterations_of_the_machine_that_spent_it():
    def run(config, seed, cpu_per_iteration, machines=None):
        rows = [{"iteration": i, "perf/nfe_per_iteration": 100, "perf/cpu_seconds_per_iteration": c}
                for i, c in enumerate(cpu_per_iteration, start=1)]
        return {"config": config, "seed": seed, "metrics": rows, "evals": {}, **({"machines": machines} if machines else {})}

    fast = [{"from_iteration": 0, "id": "fast", "cpu": "x"}]
    units = compare.cpu_units([run("flow_grpo", 0, [16.0, 16.0]), run("flow_grpo", 1, [9.0, 11.0], fast)])
    assert units == {"unrecorded": 16.0, "fast": 10.0}  # runs collected before machines were recorded: one machine
    # a run that started on the unrecorded machine and resumed after iteration 2 on the fast one (at 0.6x of
    # Flow-GRPO's CPU time per iteration on each): 4 iterations of it cost 2.4 Flow-GRPO iterations
    resumed = run("awm", 0, [9.6, 9.6, 6.0, 6.0], [{"from_iteration": 2, "id": "fast", "cpu": "x"}])
    assert [compare.machine_of(resumed, i) for i in (0, 1, 2, 3, 4)] == ["unrecorded"] * 3 + ["fast"] * 2
    assert sum(compare.cpu_of(resumed, r, units) for r in resumed["metrics"]) == pytest.approx(2.4)
    assert sum(compare.cpu_of(resumed, r, None) for r in resumed["metrics"]) == pytest.approx(31.2)  # seconds
    elsewhere = run("awm", 3, [5.0], [{"from_iteration": 0, "id": "new", "cpu": "x"}])
    with pytest.raises(SystemExit, match="awm seed 3 trained on machine new, where no flow_grpo run measured"):
        compare.cpu_of(elsewhere, elsewhere["metrics"][0], units)
    assert compare.machine()["id"] == compare.machine()["id"] != ""


def test_interpolation_between_evaluations():
    curve = [{"nfe": 0.0, "x": 1.0}, {"nfe": 100.0, "x": 2.0}, {"nfe": 300.0, "x": 0.0}]
    assert compare.at(curve, "nfe", 50.0, "x") == pytest.approx(1.5)
    assert compare.at(curve, "nfe", 200.0, "x") == pytest.approx(1.0)
    assert compare.at(curve, "nfe", 300.0, "x") == pytest.approx(0.0)
    assert compare.at(curve, "nfe", 301.0, "x") is None


def test_one_verdict_from_the_two_metrics():
    assert compare.overall(["supported", "unresolved"], "better") == "supported"
    assert compare.overall(["supported", "not supported"], "better") == "unresolved"
    assert compare.overall(["unresolved", "not supported"], "better") == "not supported"
    assert compare.overall(["supported", "unresolved"], "comparable") == "unresolved"
    assert compare.overall(["supported", "supported"], "comparable") == "supported"


def test_claims_are_the_difference_of_changes_with_its_interval():
    """The difference of two configs' mean changes; its interval from the same pairs' resample for both (a constant
    per-pair offset cancels) and each config's own seeds' resample: with the seeds' changes 0.03, 0.05, 0.04 against
    0.01, 0.02, 0.0 (SD 0.01 each) it is about the t interval 0.03 +- t_2 sqrt(2 (0.01^2 / 3))."""
    cv = {"a": [run(g, 10.0, spread=0.0, iterations=(0, 5, 10)) for g in (0.03, 0.05, 0.04)],
          "b": [run(g, 10.0, spread=0.0, iterations=(0, 5, 10)) for g in (0.01, 0.02, 0.0)]}
    d, lo, hi, ref = compare.difference(cv, "a", "b", "iteration", 10, compare.S)
    assert d == pytest.approx(0.03) and ref == pytest.approx(0.01)
    half = compare.st.t_quantile(0.975, 2) * (2 * 0.01 ** 2 / 3) ** 0.5
    assert 0.6 * half < (hi - lo) / 2 < 1.4 * half and lo < d < hi
    d5, _, _, _ = compare.difference(cv, "a", "b", "nfe", 50.0, compare.S)  # halfway: half the changes
    assert d5 == pytest.approx(0.015)
    (row,) = compare.claim_rows(cv, [("a beats b", "a", "b", "better")])[2:]
    assert row.startswith(f"| a beats b (a vs b) | 3, 3 | 10 | +0.0300 [{lo:+.4f}, {hi:+.4f}] |"), row
    assert row.endswith(f"**{'supported' if lo > 0 else 'unresolved'}** |")
    cv["a"] += [run(0.0, 10.0, iterations=(0, 5, 10))] * 3  # six seeds: also judged on the first five
    rows = compare.claim_rows(cv, [("a beats b", "a", "b", "better")])[2:]
    assert len(rows) == 2 and "first 5 seeds" in rows[1] and "| 5, 3 |" in rows[1]


@pytest.mark.slow
def test_tiny_comparison_end_to_end_and_resumable(tmp_path):
    runs, out, tiny = tmp_path / "runs", tmp_path / "out", ["--group-size", "3", "--prompts-per-iteration", "1"]
    # an interrupted run (flow_grpo seed 0 stopped after its checkpoint at iteration 1) and one that died before any
    # and one (flow_grpo seed 1) trained to the end, stopped before compare.py collected it
    for seed, iterations in ((0, 1), (1, 2)):
        pre = subprocess.run([sys.executable, "flow_grpo.py", "--model", "toy", "--seed", str(seed), "--output-dir",
                              str(runs / "flow_grpo" / f"seed{seed}"), "--exp-name", "flow_grpo", "--num-iterations",
                              str(iterations), "--eval-every", "1", "--eval-num", "4", "--save-every", "1",
                              "--log-images-every", "0", *tiny], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))  # one thread, as compare.py runs them
        assert pre.returncode == 0, pre.stderr[-2000:]
    (runs / "dense_n1" / "seed1" / "dead_run").mkdir(parents=True)
    cmd = [sys.executable, os.path.join(ROOT, "results", "compare.py"), "--configs", "flow_grpo", "dense_n1",
           "--seeds", "0", "1", "--iterations", "2", "--eval-every", "1", "--eval-num", "4", "--workers", "2",
           "--extra", " ".join(tiny), "--runs-dir", str(runs), "--out", str(out)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "start flow_grpo seed 0 (resumed)" in first.stdout and "start dense_n1 seed 1\n" in first.stdout
    assert "collect flow_grpo seed 1 (trained to iteration 2)" in first.stdout and "start flow_grpo seed 1" not in first.stdout
    assert not (runs / "dense_n1" / "seed1" / "dead_run").exists()
    for c in ("flow_grpo", "dense_n1"):
        for s in (0, 1):
            raw = json.load(open(out / "raw" / f"{c}__seed{s}.json"))
            assert sorted(raw["evals"]) == ["0", "1", "2"] and len(raw["evals"]["2"]["toy_strict"]) == 4
            assert [r["iteration"] for r in raw["metrics"]] == [0, 1, 2]
            # the machine of each part: the runs' iterations that ran outside compare.py are unrecorded
            outside = {("flow_grpo", 0): 1, ("flow_grpo", 1): 2}.get((c, s), 0)
            assert raw["machines"] == ([{"from_iteration": outside, **compare.machine()}] if outside < 2 else [])
            assert all(r["perf/nfe_per_iteration"] > 0 for r in raw["metrics"][1:])
            (run,) = os.listdir(runs / c / f"seed{s}")
            assert not os.path.exists(runs / c / f"seed{s}" / run / "checkpoints")  # pruned once collected
    tables = open(out / "tables.md").read()
    for heading in ("## Equal iterations (2)", "## Equal NFE", "## Cost", "| flow_grpo | 2 | 2.0 |", "| dense_n1 | 2 | 2.0 |",
                    "| flow_grpo | 48 | 48 |"):  # rollout NFE per prompt = its closed form G T = 3 x 16
        assert heading in tables, heading
    for fig in compare.FIGURES:
        assert os.path.getsize(out / f"{fig}.png") > 10_000
    made = {f: (out / f).read_bytes() for f in os.listdir(out) if f.endswith((".md", ".png"))}
    for f in made:
        os.remove(out / f)
    # nothing left to run: the rerun is a summary alone
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 runs to do" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert {f: (out / f).read_bytes() for f in made} == made  # rebuilt byte for byte from raw/
    # the equal-compute comparison beside it: DiffusionNFT against Flow-GRPO, in the headline first; its Flow-GRPO
    # runs are the ones above (the same settings: a config's raw/ file is all that a comparison needs of a run)
    (out / "equal" / "raw").mkdir(parents=True)
    for s in (0, 1):
        shutil.copy(out / "raw" / f"flow_grpo__seed{s}.json", out / "equal" / "raw")
    equal = [sys.executable, os.path.join(ROOT, "results", "compare.py"), "--equal", "--configs", "flow_grpo",
             "diffusion_nft", "--seeds", "0", "1", "--iterations", "2", "--eval-every", "1", "--eval-num", "4",
             "--extra", " ".join(tiny), "--runs-dir", str(tmp_path / "runs_equal"), "--out", str(out / "equal")]
    done = subprocess.run(equal, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "2 runs to do" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    headline = open(out / "headline.md").read()
    assert headline.startswith("## All methods at equal compute") and "## The papers' tables on the toy" in headline
    for row in ("| Flow-GRPO | flow_grpo | 2 | 2 |", "| DiffusionNFT | diffusion_nft | 2 | 2 |",
                "| DiffusionNFT beats Flow-GRPO (its paper: 3x-25x faster) (diffusion_nft vs flow_grpo) | 2, 2 |",
                "| DiffusionNFT beats Flow-GRPO: speed-up (diffusion_nft vs flow_grpo) | 2, 2 |"):
        assert row in headline, row
    assert all(r["perf/cpu_seconds_per_iteration"] > 0 for r in
               json.load(open(out / "equal" / "raw" / "diffusion_nft__seed1.json"))["metrics"][1:])
    made = {f: p.read_bytes() for f in ("headline.md", "tables.md", "equal/equal_compute.png") for p in [out / f]}
    rebuilt = subprocess.run([*cmd, "--summary-only"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 0 and {f: (out / f).read_bytes() for f in made} == made
    changed = subprocess.run([*cmd[:-4], "--eval-num", "8", *cmd[-4:]], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert changed.returncode == 1 and "was made with" in changed.stderr and "not {" in changed.stderr, changed.stderr


@pytest.mark.slow
def test_a_stopped_comparison_stops_its_runs(tmp_path):
    runs = tmp_path / "runs"
    cmd = [sys.executable, os.path.join(ROOT, "results", "compare.py"), "--configs", "flow_grpo", "--seeds", "0",
           "--iterations", "1000", "--eval-every", "1000", "--eval-num", "4", "--extra",
           "--group-size 2 --prompts-per-iteration 2 --num-steps 4",  # an iteration of 0.2 s idle
           "--runs-dir", str(runs), "--out", str(tmp_path / "out")]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "start flow_grpo seed 0" in "".join(p.stdout.readline() for _ in range(2))
    log, t0 = runs / "flow_grpo" / "seed0.log", time.time()
    while "iterations |" not in (log.read_text() if log.exists() else "") and time.time() - t0 < 300:
        time.sleep(0.5)  # until the run is training (its start takes 5 s idle, far longer on a loaded machine)
    p.send_signal(signal.SIGTERM)
    t0 = time.time()
    _, err = p.communicate(timeout=120)
    logs = "".join(open(f).read()[-2000:] for f in glob.glob(str(runs / "*" / "*.log")))
    assert time.time() - t0 < 50, logs  # the run obeyed its terminate() (it ends its iteration), not the kill()
    assert p.returncode == 1 and "interrupted; run the same command again to resume" in err, err[-2000:]
    left = subprocess.run(["pgrep", "-f", str(runs)], capture_output=True, text=True).stdout.split()
    assert left == [], left  # no run left behind, still training into the run directory


def test_the_docs_copy_the_headline_tables():
    """docs/results.md's tables and claim verdicts are results/compare/headline.md's rows, line for line (its numbers
    come only from the comparison's own output)."""
    readme = open(os.path.join(ROOT, "docs", "results.md")).read()
    rows = [line.rstrip("\n") for line in open(os.path.join(ROOT, "results", "compare", "headline.md"))]
    rows = [r for r in rows if r.startswith("| ") and not r.startswith("|---")]
    hacking = open(os.path.join(ROOT, "results", "hacking", "hacking.md")).read()
    assert len(rows) > 30
    assert [r for r in rows if r not in readme] == []
    # the README's which-method answer quotes the headline's speed-ups and z-scores, not numbers of its own
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Which method"):]
    quoted = re.findall(r"\d+\.\d+x \[\d+\.\d+x, \d+\.\d+x\]|[+-]0\.\d{4} \[[+-]0\.\d{4}, [+-]0\.\d{4}\]",
                        section[:section.index("\n## ", 5)])
    headline = "\n".join(rows)
    assert len(quoted) >= 3 and [q for q in quoted if q not in headline + hacking] == [], quoted
    assert " SE" not in section[:section.index("\n## ", 5)]  # no standard errors of their own
