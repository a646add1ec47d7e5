"""results/hacking.py: the peak and the fall from the raw runs (synthetic curves)."""
import json
import os
import random
import re
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "results"))
import hacking  # noqa: E402


def curve(gold, proxy, kl, nfe_per_eval=100):
    return [{"iteration": 10 * i, "nfe": nfe_per_eval * i, "train": g, "proxy": p, "kl": k}
            for i, (g, p, k) in enumerate(zip(gold, proxy, kl))]


def test_the_peak_is_one_evaluation_for_all_seeds():
    """The peak is the evaluation where the seeds' mean gold change is highest, not each seed's own best: a seed
    whose best evaluation is elsewhere is read at the common one; the fall is the peak minus the end, per seed."""
    xs = [curve([0.5, 0.6, 0.55, 0.45], [0.5, 0.6, 0.7, 0.8], [0, 1, 2, 3]),
          curve([0.4, 0.46, 0.50, 0.38], [0.4, 0.5, 0.6, 0.7], [0, 2, 4, 6])]
    m = hacking.measures(xs)  # mean changes: +0.08 at evaluation 1, +0.075 at evaluation 2
    assert [r["peak"] for r in m] == pytest.approx([0.1, 0.06]) and [r["peak_nfe"] for r in m] == [100, 100]
    assert [r["fall"] for r in m] == pytest.approx([0.15, 0.08]) and [r["end"] for r in m] == pytest.approx([-0.05, -0.02])
    assert [r["proxy_end"] for r in m] == pytest.approx([0.3, 0.3]) and [r["kl_end"] for r in m] == [3, 6]
    assert [r["own_peak_nfe"] for r in m] == [100, 200]  # each seed's own highest evaluation
    # the second seed alone peaks at evaluation 2 (+0.10); read at the first seed's peak, evaluation 1, it is +0.06
    assert hacking.measures(xs[1:])[0]["peak"] == pytest.approx(0.1)
    blind = hacking.measures(xs[1:], peak_of=xs[:1])[0]
    assert (blind["peak"], blind["fall"], blind["peak_nfe"]) == pytest.approx((0.06, 0.08, 100))


def fake_run(config, seed, gold, proxy, kl, pairs=4):
    """A raw run as results/compare.collect writes it: gold[i], proxy[i], kl[i] at iteration 5 i (every pair)."""
    rng = random.Random(seed)
    jitter = [rng.uniform(-0.01, 0.01) for _ in range(pairs)]
    evals = {str(5 * i): {hacking.A: [g + j for j in jitter], hacking.B: [g - j for j in jitter], hacking.S: [0.5] * pairs,
                          "toy_proxy": [p] * pairs} for i, (g, p) in enumerate(zip(gold, proxy))}
    return {"config": config, "seed": seed, "script": "flow_grpo.py", "settings": {}, "machines": [],
            "metrics": [{"iteration": i, "perf/nfe_per_iteration": 100.0} for i in range(1, 5 * len(gold) - 4)],
            "evals": evals, "kl": {str(5 * i): [k] * pairs for i, k in enumerate(kl)}}


def test_summary_judges_the_fall_and_rebuilds_exactly(tmp_path):
    """--summary-only on raw runs: Flow-GRPO without KL (7 seeds) rises then falls (each seed by 0.06-0.18:
    supported; also on seeds 5 and 6 read at the peak of seeds 0-4), GRPO-Guard falls less (supported), KL 0.4 peaks
    later than 0.04 (supported), and a second rebuild writes the same table and figure, byte for byte."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for s in range(7):
        d = 0.01 * s
        runs = {"proxy_flow_grpo_kl0": ([0.5, 0.53 + d, 0.49, 0.47 - d], [0.5, 0.55, 0.6, 0.65 + d], [0, 1, 2, 3 + s]),
                "proxy_flow_grpo_guard": ([0.5, 0.52, 0.52 - d / 2, 0.51], [0.5, 0.52, 0.54, 0.56], [0, 1, 1, 2]),
                "proxy_flow_grpo": ([0.5, 0.52, 0.51, 0.5], [0.5] * 4, [0, 1, 1, 1]),
                "proxy_flow_grpo_kl4": ([0.5, 0.51, 0.53, 0.52 + 0.02 * (s == 4)], [0.5] * 4, [0, 1, 1, 1])}
        for c, curves in runs.items():
            if s >= 5 and c != "proxy_flow_grpo_kl0":
                continue
            (raw / f"{c}__seed{s}.json").write_text(json.dumps(fake_run(c, s, *curves)))
    cmd = [sys.executable, os.path.join(ROOT, "results", "hacking.py"), "--summary-only", "--out", str(tmp_path),
           "--configs", "flow_grpo_kl0", "flow_grpo_guard", "flow_grpo", "flow_grpo_kl4"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    table = (tmp_path / "hacking.md").read_text()
    # kl0: the seeds' mean is highest at evaluation 1 (+0.06); the falls there are 0.06 + 0.02 s, mean 0.12
    assert "| Flow-GRPO, no KL | proxy_flow_grpo_kl0 | 7 | +0.0600 +- 0.0082 | 500 (500 +- 0) | -0.0600 +- 0.0082 | " \
           "+0.1200 +- 0.0163 | +0.1800 +- 0.0082 | 6.0 +- 0.8 |" in table
    # seeds 5 and 6 at evaluation 1, where the mean of seeds 0-4 is highest: falls 0.16 and 0.18
    assert "(proxy_flow_grpo_kl0 vs 0, the later seeds at the peak of the first 5) | 2 | +0.1700 | +0.0000 | " \
           "+0.1700 +- 0.0100 | **supported** |" in table
    verdicts = dict(re.findall(r"\| ([^|]+) \(proxy_\S+ vs \S+\) \|.*\*\*(.+)\*\* \|", table))
    assert verdicts["Over-optimisation: without KL, gold then falls from its peak"] == "supported"
    assert verdicts["Without KL, the proxy ends above the base model"] == "supported"
    assert verdicts["GRPO-Guard over-optimises less than Flow-GRPO (its paper): a smaller fall"] == "supported"
    # each seed's own highest evaluation: KL 0.4 at NFE 1,000 (seed 4: 1,500), KL 0.04 at 500
    assert "(proxy_flow_grpo_kl4 vs proxy_flow_grpo) | 5, 5 | 1,100 | 500 | +600 +- 100 | **supported** |" in table
    made = {f: (tmp_path / f).read_bytes() for f in ("hacking.md", "hacking.png")}
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    assert {f: (tmp_path / f).read_bytes() for f in made} == made


def test_the_docs_copy_the_hacking_table():
    """docs/results.md's reward-hacking rows are results/hacking/hacking.md's, line for line."""
    made = os.path.join(ROOT, "results", "hacking", "hacking.md")
    rows = [r.rstrip("\n") for r in open(made) if r.startswith("| ") and not r.startswith("|---")]
    docs = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert len(rows) >= 3 and [r for r in rows if r not in docs] == []
    # the README's which-method answer quotes the table's gold changes (four decimals), not numbers of its own
    readme = open(os.path.join(ROOT, "README.md")).read()
    start = readme.index("hack their reward least")
    quoted = re.findall(r"[+-]0\.\d{4}", readme[start:readme.index("\n- ", start)])
    table = "\n".join(rows)
    assert len(quoted) >= 6 and [q for q in quoted if q not in table] == [], quoted
