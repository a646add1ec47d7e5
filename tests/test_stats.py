"""results/stats.py, the procedure behind every interval of results/: Student's t in closed form, the stretch for few
seeds, the intervals' coverage and their ends where a statistic is only bounded, the verdicts; and the committed
tables rebuilt from raw/, with one interval recomputed here by hand from the raw runs."""
import glob
import re
import json
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "results"))
import stats  # noqa: E402


@pytest.mark.parametrize("df, q975", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_the_t_quantile_is_the_table_value(df, q975):
    """Student's t 97.5% quantiles as the tables give them (and the CDF is symmetric, 1/2 at 0)."""
    assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert stats.t_cdf(0.0, df) == 0.5 and stats.t_cdf(-1.3, df) == pytest.approx(1 - stats.t_cdf(1.3, df))
    # df = 1 is Cauchy: P(T <= 1) = 3/4; df = 2: P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2))
    assert stats.t_cdf(1.0, 1) == pytest.approx(0.75) and stats.t_cdf(1.5, 2) == pytest.approx(0.5 + 1.5 / (2 * 4.25 ** 0.5))


def test_the_stretch_for_few_seeds():
    """sqrt(n / (n - 1)) t_{n-1}(0.975) / 1.96: 9.17 for 2 seeds, 1.58 for 5, 1.22 for 10, towards 1 for many."""
    for n, c in ((2, 9.168), (3, 2.689), (5, 1.584), (10, 1.217)):
        assert stats.stretch(n) == pytest.approx(c, abs=1e-3)
    assert 1 < stats.stretch(1000) < 1.002


def test_a_mean_of_normal_seeds_gets_the_t_interval_and_its_coverage():
    """Seeds drawn from N(0, 1) and no pair noise: the interval of the mean is about mean +- t_{n-1} s / sqrt(n) (the
    t interval), and over 300 repetitions it holds the true mean about 95% of the time, for 5 seeds and 10."""
    rng = np.random.default_rng(1)
    for n in (5, 10):
        hits, ratio = 0, []
        for rep in range(300):
            x = rng.normal(size=n)
            draws = stats.over_seeds(np.repeat(x[:, None], stats.RESAMPLES, 1), f"coverage/{rep}")
            lo, hi = stats.interval(draws, seeds=n)
            hits += lo <= 0 <= hi
            ratio.append((hi - lo) / (2 * stats.t_quantile(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n)))
        assert 0.91 <= hits / 300 <= 0.985, (n, hits)
        assert 0.9 < np.median(ratio) < 1.1, (n, np.median(ratio))


def test_pairs_and_seeds_are_resampled_the_same_wherever_asked():
    """One draw of the pairs for every run and config (a difference stays paired), the seeds' draw from the config
    alone; each resample's pair weights sum to 1."""
    w = stats.pair_weights(16)
    assert w.shape == (stats.RESAMPLES, 16) and np.allclose(w.sum(1), 1) and w is stats.pair_weights(16)
    assert np.array_equal(stats.seed_draws("awm", 5), stats.seed_draws("awm", 5))
    assert not np.array_equal(stats.seed_draws("awm", 5), stats.seed_draws("dgpo", 5))
    x, w = np.arange(256.0), stats.pair_weights(256)
    assert np.allclose(stats.on_pairs(x), w @ x)  # a measure on the first 64 pairs: their weights renormalised
    assert np.allclose(stats.on_pairs(x[:64], first=64, pairs=256), (w[:, :64] @ x[:64]) / w[:, :64].sum(1))
    # the same scores in two configs: their difference is 0 on every resample, so its interval is [0, 0]
    same = np.tile(x[:16], (3, 1))
    d = stats.over_seeds(stats.on_pairs(same), "a") - stats.over_seeds(stats.on_pairs(same), "b")
    assert stats.interval(d, seeds=3) == (0.0, 0.0)


def test_an_interval_keeps_every_resample_and_its_bounds():
    """A statistic bounded in some resamples (a curve that never reaches a target): the lower end from the least
    values, the upper from the greatest; infinite ones in a tail give an infinite end, never NaN; on the log scale
    0 is a lower end of 0."""
    v = np.linspace(1.0, 2.0, stats.RESAMPLES)
    lo, hi = stats.interval(v, seeds=10)
    m, q1, q2 = np.quantile(v, [0.5, 0.025, 0.975], method="inverted_cdf")
    assert lo == pytest.approx(m - stats.stretch(10) * (m - q1)) and hi == pytest.approx(m + stats.stretch(10) * (q2 - m))
    upper = v.copy()
    upper[-300:] = np.inf  # 3% of the resamples never reach: the upper end is unbounded
    assert stats.interval(v, seeds=10, upper=upper) == (lo, math.inf)
    least = v.copy()
    least[:300] = 0.0  # ... and on the log scale their least value, 0, is the lower end
    lo, hi = stats.interval(least, seeds=10, upper=upper, log=True)
    assert lo == 0.0 and hi == math.inf
    ratio = np.exp(np.random.default_rng(0).normal(0, 0.1, stats.RESAMPLES))
    lo, hi = stats.interval(ratio, seeds=10, log=True)  # a ratio: stretched on the log scale
    assert (math.log(lo), math.log(hi)) == pytest.approx(stats.interval(np.log(ratio), seeds=10))


def test_verdicts_follow_the_stated_rules():
    assert stats.verdict(0.001, 0.03) == "supported" and stats.verdict(-0.03, -0.001) == "not supported"
    assert stats.verdict(-0.001, 0.03) == "unresolved" and stats.verdict(math.nan, math.nan) == "unresolved"
    assert stats.verdict(-0.02, 0.01, kind="comparable", margin=0.025) == "supported"
    assert stats.verdict(-0.02, 0.03, kind="comparable", margin=0.025) == "unresolved"
    assert stats.verdict(0.03, 0.05, kind="comparable", margin=0.025) == "not supported"
    assert stats.fmt(-0.00001, -0.1, math.inf) == "+0.0000 [-0.1000, inf]"


def test_the_hacking_table_rebuilds_from_raw_and_one_interval_by_hand(tmp_path):
    """results/hacking.py --summary-only on the committed raw/ writes the committed hacking.md; DGPO's over-rating
    at the end is recomputed here from its raw runs, with the documented resampling written out: the pairs drawn
    by numpy's PCG64 from crc32('pairs/256'), the seeds from crc32('seeds/<config>/<n>'), the 2.5th and 97.5th
    percentiles (order statistics) stretched from the median by sqrt(n / (n - 1)) t_{n-1}(0.975) / 1.96."""
    os.symlink(os.path.join(ROOT, "results", "hacking", "raw"), tmp_path / "raw")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "results", "hacking.py"), "--summary-only", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "hacking.md").read_text()
    assert table == open(os.path.join(ROOT, "results", "hacking", "hacking.md")).read()

    over = []  # each seed's over-rating of every pair at its last evaluation: (proxy - gold) now - at iteration 0
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "hacking", "raw", "proxy_dgpo__seed*.json"))):
        evals = json.load(open(path))["evals"]
        first, last = evals["0"], evals[str(max(map(int, evals)))]
        def score(e):  # the proxy minus gold, (a + b) / 2
            return np.array(e["toy_proxy"]) - (np.array(e["toy_color_position"]) + np.array(e["toy_shape_count"])) / 2
        over.append(score(last) - score(first))
    over = np.array(over)
    n, pairs, resamples = *over.shape, 10_000
    weights = np.random.default_rng(zlib.crc32(b"pairs/256")).multinomial(pairs, [1 / pairs] * pairs, size=resamples)
    per_seed = over @ (weights / pairs).T  # [seeds, resamples]
    picks = np.random.default_rng(zlib.crc32(f"seeds/proxy_dgpo/{n}".encode())).integers(n, size=(resamples, n))
    means = np.array([per_seed[picks[r], r].mean() for r in range(resamples)])
    c = math.sqrt(n / (n - 1)) * 2.7764451051977987 / 1.959963984540054  # t_4(0.975) / z(0.975)
    s = np.sort(means)
    median, q1, q2 = s[resamples // 2 - 1], s[math.ceil(0.025 * resamples) - 1], s[math.ceil(0.975 * resamples) - 1]
    expect = f"{over.mean():+.4f} [{median - c * (median - q1):+.4f}, {median + c * (q2 - median):+.4f}]"
    (row,) = [r for r in table.splitlines() if r.startswith("| DGPO | proxy_dgpo | 5 |")]
    assert row.split(" | ")[3] == expect, (row, expect)


@pytest.mark.slow
def test_the_comparison_tables_rebuild_from_raw(tmp_path):
    """results/compare.py --summary-only on the committed raw/ and equal/raw/ writes the committed headline.md and
    tables.md, byte for byte."""
    out = tmp_path / "compare"
    (out / "equal").mkdir(parents=True)
    os.symlink(os.path.join(ROOT, "results", "compare", "raw"), out / "raw")
    os.symlink(os.path.join(ROOT, "results", "compare", "equal", "raw"), out / "equal" / "raw")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "results", "compare.py"), "--summary-only", "--out",
                           str(out)], capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("headline.md", "tables.md"):
        assert (out / name).read_text() == open(os.path.join(ROOT, "results", "compare", name)).read(), name


@pytest.mark.parametrize("world", ["video", "edit"])
def test_the_world_tables_rebuild_from_raw(tmp_path, world):
    """results/compare.py --video (--edit) --summary-only on the committed video/raw/ (edit/raw/) writes the committed
    video.md (edit.md), byte for byte."""
    os.symlink(os.path.join(ROOT, "results", "compare", world, "raw"), tmp_path / "raw")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "results", "compare.py"), f"--{world}", "--summary-only",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / f"{world}.md").read_text() == open(os.path.join(ROOT, "results", "compare", world,
                                                                        f"{world}.md")).read()


def test_the_docs_variance_decomposition_rebuilds_from_raw():
    """docs/results.md's three SEs of Flow-GRPO's change at the end of its 10 equal-compute seeds: the two-way
    analysis of variance of the per-pair changes (seeds x pairs, crossed), the pigeonhole bootstrap's SD, and the SE
    over seeds with the pairs held fixed."""
    y = []
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "compare", "equal", "raw", "flow_grpo__seed[0-9].json"))):
        evals = json.load(open(path))["evals"]
        gold = lambda e: (np.array(e["toy_color_position"]) + np.array(e["toy_shape_count"])) / 2  # noqa: E731
        y.append(gold(evals[str(max(map(int, evals)))]) - gold(evals["0"]))
    y = np.array(y)
    n, p = y.shape
    seeds, pairs, grand = y.mean(1), y.mean(0), y.mean()
    ms_seeds = p * ((seeds - grand) ** 2).sum() / (n - 1)
    ms_pairs = n * ((pairs - grand) ** 2).sum() / (p - 1)
    ms_rest = ((y - seeds[:, None] - pairs[None] + grand) ** 2).sum() / ((n - 1) * (p - 1))
    anova = math.sqrt((ms_seeds - ms_rest) / p / n + (ms_pairs - ms_rest) / n / p + ms_rest / (n * p))
    boot = stats.over_seeds(stats.on_pairs(y), "flow_grpo").std(ddof=1)
    fixed = seeds.std(ddof=1) / math.sqrt(n)
    docs = " ".join(open(os.path.join(ROOT, "docs", "results.md")).read().split())
    assert (f"gives an SE of {anova:.4f}, the pigeonhole bootstrap an SD of {boot:.4f}, while the SE over seeds with "
            f"the pairs held fixed, which the earlier tables used, is {fixed:.4f}") in docs


def test_every_interval_the_docs_quote_is_in_a_rebuilt_table():
    """Each 'value [low, high]' of README.md and docs/results.md (a change, a difference, a KL, a speed-up) is one of
    the tables that results/compare.py and results/hacking.py rebuild from raw/: no interval of their own."""
    tables = "".join(open(os.path.join(ROOT, "results", *p)).read() for p in
                     (("compare", "headline.md"), ("compare", "tables.md"), ("hacking", "hacking.md"),
                      ("compare", "video", "video.md")))
    number = r"[+-]?[\d,]*\.?\d+x?"
    for page in ("README.md", os.path.join("docs", "results.md"), os.path.join("docs", "video.md")):
        text = " ".join(open(os.path.join(ROOT, page)).read().split())
        quoted = re.findall(rf"{number} \[{number}, {number}\]", text)
        assert len(quoted) >= 4 and [q for q in quoted if q not in tables] == [], (page, quoted)
