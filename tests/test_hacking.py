"""results/hacking.py: the out-of-sample peak, the fall and the over-rating from the raw runs (synthetic curves)."""
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "results"))
import hacking  # noqa: E402


def test_each_seed_is_read_at_the_peak_of_the_other_seeds():
    """Leave one seed out: seed i is read at the evaluation where the other seeds' mean gold change is highest, never
    at its own luckiest one; the fall is from there to its end, the over-rating its proxy change minus its gold
    change at the end."""
    gold = np.array([[0.0, 0.10, 0.05, -0.05], [0.0, 0.04, 0.10, -0.02], [0.0, 0.06, 0.04, 0.0]])[:, :, None]
    proxy = np.array([[0.0, 0.1, 0.2, 0.3]] * 3)[:, :, None]
    kl = np.array([[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0], [0.0, 1.0, 1.0, 1.0]])[:, :, None]
    nfe = np.array([[0.0, 100.0, 200.0, 300.0]] * 3)
    m = hacking.per_run(gold, proxy, kl, nfe)
    # the others' mean is highest for seed 0 at evaluation 2 (0.07), for seed 1 at 1 (0.08), for seed 2 at 2 (0.075)
    assert m["peak"][:, 0] == pytest.approx([0.05, 0.04, 0.04]) and m["peak_nfe"][:, 0].tolist() == [200, 100, 200]
    assert m["fall"][:, 0] == pytest.approx([0.10, 0.06, 0.04]) and m["end"][:, 0] == pytest.approx([-0.05, -0.02, 0])
    assert m["over_end"][:, 0] == pytest.approx([0.35, 0.32, 0.30]) and m["kl_end"][:, 0].tolist() == [3, 6, 1]
    assert np.isnan(hacking.per_run(gold[:1], proxy[:1], kl[:1], nfe[:1])["peak"]).all()  # one seed: no others


def test_the_over_rating_where_a_curve_first_reaches_a_level():
    X = np.array([[0.0, 0.01, 0.02, 0.015], [0.0, 0.004, 0.006, 0.008]])
    Y = np.array([[0.0, -0.01, 0.005, 0.02], [0.0, 0.0, 0.0, 0.0]])
    out = hacking.at_level(X, Y, 0.015)  # first reached halfway between evaluations 1 and 2; never on the second
    assert out[0] == pytest.approx(-0.0025) and np.isnan(out[1])


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
    """--summary-only on raw runs: Flow-GRPO without KL (7 seeds) rises then falls (each seed by 0.06-0.18, read at
    the peak of the other seeds: supported) while the proxy over-rates it, GRPO-Guard falls less (supported), KL 0.4
    peaks later than 0.04 (supported), a row of one seed waits for its second, and a second rebuild writes the
    same table and figure, byte for byte."""
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
    # a row with one finished seed has no interval yet: named, not tabled
    one = fake_run("proxy_dpo", 0, [0.5] * 4, [0.5] * 4, [0] * 4)
    (raw / "proxy_dpo__seed0.json").write_text(json.dumps(one))
    cmd = [sys.executable, os.path.join(ROOT, "results", "hacking.py"), "--summary-only", "--out", str(tmp_path),
           "--configs", "flow_grpo_kl0", "flow_grpo_guard", "flow_grpo", "flow_grpo_kl4", "dpo"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    table = (tmp_path / "hacking.md").read_text()
    assert "Not yet in the tables (one finished seed; a row needs two): proxy_dpo." in table
    assert "| proxy_dpo |" not in table
    # kl0: every seed's others peak at evaluation 1 (NFE 500), where seed s is at +0.03 + 0.01 s: mean +0.06; it ends
    # at -0.03 - 0.01 s (mean -0.06), a fall of +0.12; the proxy ends at +0.15 + 0.01 s: an over-rating of +0.24
    (row,) = [r for r in table.splitlines() if r.startswith("| Flow-GRPO, no KL | proxy_flow_grpo_kl0 | 7 |")]
    cells = row.split(" | ")
    assert [c.split(" [")[0] for c in cells[3:10]] == ["+0.2400", "+0.1800", "-0.0600", "+0.0600", "500", "+0.1200",
                                                     "6.0"], row
    verdicts = dict(re.findall(r"\| ([^|]+) \(proxy_\S+ vs [^,)]+\) \|.*\*\*(.+)\*\* \|", table))
    assert verdicts["Over-optimisation: without KL, gold then falls from its peak"] == "supported"
    assert verdicts["Without KL, the proxy ends above the base model"] == "supported"
    assert verdicts["Without KL, the proxy over-rates the images at the end: its gain above gold's"] == "supported"
    assert verdicts["GRPO-Guard over-optimises less than Flow-GRPO (its paper): a smaller fall"] == "supported"
    # every seed of KL 0.4 is read at NFE 1,000 (the other seeds' peak), of KL 0.04 at 500
    assert "(proxy_flow_grpo_kl4 vs proxy_flow_grpo) | 5, 5 | 1,000 | 500 | +500 [+500, +500] | **supported** |" in table
    made = {f: (tmp_path / f).read_bytes() for f in ("hacking.md", "hacking.png")}
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    assert {f: (tmp_path / f).read_bytes() for f in made} == made


def test_the_docs_copy_the_hacking_table():
    """docs/results.md's reward-hacking rows are results/hacking/hacking.md's, line for line."""
    made = os.path.join(ROOT, "results", "hacking", "hacking.md")
    rows = [r.rstrip("\n") for r in open(made) if r.startswith("| ") and not r.startswith("|---")]
    docs = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert len(rows) >= 3 and [r for r in rows if r not in docs] == []
    # the README's which-method answer quotes the table's over-ratings (four decimals), not numbers of its own
    readme = open(os.path.join(ROOT, "README.md")).read()
    start = readme.index("measured as over-rating")
    quoted = re.findall(r"[+-]0\.\d{4} \[[+-]0\.\d{4}, [+-]0\.\d{4}\]", readme[start:readme.index("\n- ", start)])
    table = "\n".join(rows)
    assert len(quoted) >= 3 and [q for q in quoted if q not in table] == [], quoted


def test_the_proxy_was_trained_on_every_prompt_the_evaluation_uses():
    """docs/toy_world.md and docs/results.md: the grammar has 480 prompts (one object: 4 colours x 3 shapes x 4
    positions; two: ordered colour pairs x shape pairs x 4 positions, the second opposite), and the proxy's 12,288
    training prompts (toy/make_proxy.py, seed 0) hold every one of them, so the held-out pairs' prompts (and the
    proxy's own held-out samples') are not new to it: only their noise is."""
    sys.path.insert(0, os.path.join(ROOT, "toy"))
    from make_proxy import HELDOUT_PROMPT_SEED, TRAIN_PROMPT_SEED
    from world import COLOURS, POSITIONS, SHAPES, toy_prompts

    grammar = 4 * 3 * 4 + 4 * 3 * 3 * 3 * 4
    assert len(COLOURS) == 4 and len(SHAPES) == 3 and len(POSITIONS) == 4 and grammar == 480
    seen = set(toy_prompts(12288, seed=TRAIN_PROMPT_SEED))
    assert len(seen) == grammar
    assert set(toy_prompts(1024, seed=1)[:256]) <= seen  # the 256 evaluation pairs' prompts (common.load_prompt_set)
    assert set(toy_prompts(1024, seed=HELDOUT_PROMPT_SEED)) <= seen
