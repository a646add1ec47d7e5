"""Reward hacking on the toy world: every method trained on a learned proxy of the training reward, measured
against the exact rewards that the proxy imitates (the gold standard), as Gao et al. (2022, "Scaling laws for reward
model overoptimization") measured it for language models.

    python results/hacking.py                  # run every missing (config, seed), then write results/hacking/
    python results/hacking.py --summary-only   # rebuild the table and the figure from results/hacking/raw/

Each run is a config of results/compare.py (its file's TOY preset and flags) trained on toy_proxy alone (toy/proxy.py,
made by toy/make_proxy.py) for the same NFE, evaluated every --eval-every iterations on the 256 held-out pairs by the
proxy and the exact rewards (gold: the mean of toy_color_position and toy_shape_count, the reward the proxy learned);
before a finished run's checkpoints are pruned, evaluate.py --kl-to-base gives each one's KL to the base model on the
first --kl-pairs pairs. The runs are results/compare.py's (run_all: resumable, one thread each, --workers at a time).
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402
import stats as st  # noqa: E402
from compare import A, B, CONFIGS, FIRST_SEEDS, ROOT, S, at, curves, load  # noqa: E402

PROXY = ["--rewards", "toy_proxy", "--eval-rewards", A, B, S, "--keep-checkpoints", "0"]
HACKING = {  # name: (results/compare.py's config, flags on top of it, label); seeds: SEEDS
    "flow_grpo_kl0": ("flow_grpo", ["--beta", "0"], "Flow-GRPO, no KL"),
    "flow_grpo": ("flow_grpo", [], "Flow-GRPO, KL 0.04 (its preset)"),
    "flow_grpo_kl4": ("flow_grpo", ["--beta", "0.4"], "Flow-GRPO, KL 0.4"),
    "flow_grpo_guard": ("flow_grpo_guard", [], "Flow-GRPO + GRPO-Guard (no KL)"),
    "dense_calibrated": ("dense_calibrated", [], "DenseGRPO"),
    "diffusion_nft": ("diffusion_nft", [], "DiffusionNFT"),
    "awm": ("awm", [], "AWM"),
    "dgpo": ("dgpo", [], "DGPO"),
    "flow_dppo": ("flow_dppo", [], "Flow-DPPO"),
    "dpo": ("dpo", [], "Online Diffusion-DPO"),
    "crd": ("crd", [], "CRD"),
    "dancegrpo": ("dancegrpo", [], "DanceGRPO"),
    "mixgrpo": ("mixgrpo", [], "MixGRPO"),
    "g2rpo_L123": ("g2rpo_L123", [], "G2RPO, Lambda {1, 2, 3}"),
}
# 5 seeds each; 10 for the rows of the over-optimisation claims, which 5 left unresolved (the first 5 are judged too)
SEEDS = {name: 10 if name == "flow_grpo_kl0" else 5 for name in HACKING}
CLAIMS = [  # (what a paper or the KL's role says, a, b (None: 0), measure, +1: a above b supports it / -1: below)
    ("Without KL, gold first rises: its peak above the base model", "flow_grpo_kl0", None, "peak", 1),
    ("Over-optimisation: without KL, gold then falls from its peak", "flow_grpo_kl0", None, "fall", 1),
    ("Without KL, the proxy ends above the base model", "flow_grpo_kl0", None, "proxy_end", 1),
    ("Without KL, the proxy over-rates the images at the end: its gain above gold's", "flow_grpo_kl0", None,
     "over_end", 1),
    ("GRPO-Guard over-optimises less than Flow-GRPO (its paper): a smaller fall", "flow_grpo_guard", "flow_grpo_kl0",
     "fall", -1),
    ("Flow-DPPO drifts less from the base than Flow-GRPO (its paper): a smaller KL at the end", "flow_dppo",
     "flow_grpo", "kl_end", -1),
    ("CRD hacks its reward less than DiffusionNFT (its paper): the proxy over-rates its images less at the end",
     "crd", "diffusion_nft", "over_end", -1),
    ("A larger KL coefficient peaks higher (Flow-GRPO, KL 0.4 against 0.04)", "flow_grpo_kl4", "flow_grpo", "peak", 1),
    ("A larger KL coefficient peaks later (Flow-GRPO, KL 0.4 against 0.04; NFE of the peak)", "flow_grpo_kl4",
     "flow_grpo", "peak_nfe", 1),
]
REFERENCES = ["flow_grpo", "flow_grpo_kl0"]  # every row's over-rating at the end against these: less, or not?
PROXY_LEVELS = [0.005, 0.01, 0.015, 0.02]  # matched proxy gain
KL_LEVELS = [5, 10, 20, 40, 80, 160]  # matched drift (nats)
for name, (base, flags, _) in HACKING.items():  # registered as results/compare.py configs of their own
    CONFIGS["proxy_" + name] = (CONFIGS[base][0], CONFIGS[base][1] + flags + PROXY, SEEDS[name])


def kl_of_checkpoints(run, *, pairs: int) -> dict:
    """{"kl": {iteration: every pair's KL to the base model}} of a run's checkpoints (evaluate.py --kl-to-base on
    the first `pairs` evaluation pairs: pair k, k < pairs, is the run's own pair k)."""
    ckpts = sorted((int(d[5:]), os.path.join(run, "checkpoints", d)) for d in os.listdir(os.path.join(run, "checkpoints"))
                   if d.startswith("iter_") and not d.endswith(".tmp"))
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", "toy", "--no-base", "--kl-to-base",
               "--metrics", S, "--num-prompts", str(pairs), "--seeds-per-prompt", "1", "--out", out,
               "--checkpoints", *[path for _, path in ckpts]]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"evaluate.py --kl-to-base failed on {run}: {proc.stderr[-2000:]}")
        entries = compare.read_json(os.path.join(out, "scores.json"))["entries"]
    kl = {str(i): [round(x, 6) for x in e["scores"]["kl_to_base"]] for (i, _), e in zip(ckpts, entries)}
    return {"kl": {"0": [0.0] * pairs, **kl}}


def hacking_curves(run):
    """compare.curves (gold = its "train", the mean of the two exact rewards) with the proxy's mean, the KL (the
    mean over its pairs) and, under "pairs", the over-rating of every pair (the proxy minus gold) and its KL."""
    out = curves(run)
    for p in out:
        kl = np.asarray(run.get("kl", {}).get(str(p["iteration"]), [math.nan]), dtype=np.float64)
        p["proxy"], p["kl"], p["pairs"]["kl"] = p["toy_proxy"], float(kl.mean()), kl
        p["pairs"]["over"] = p["pairs"]["toy_proxy"] - p["pairs"]["train"]
    return out


def per_run(gold, proxy, kl, nfe) -> dict:
    """Each run's measures [runs, R] from its changes from iteration 0 [runs, evaluations, R] of gold and the proxy
    on R weightings of the pairs (their plain mean, or results/stats.py's resamples), its KL and its NFE [runs,
    evaluations]. The peak is chosen out of sample: run i's peak is the evaluation where the mean gold change of
    the other runs is highest, so that no run's own noise picks the evaluation it is read at."""
    n = len(gold)
    others = gold.sum(0, keepdims=True) - gold  # the other runs' sum, [runs, evaluations, R]
    k = others.argmax(1)  # [runs, R]
    peak = np.take_along_axis(gold, k[:, None, :], 1)[:, 0]
    missing = np.full_like(peak, np.nan) if n < 2 else None  # one seed: no other seed to choose its peak
    return {"peak": peak if missing is None else missing, "end": gold[:, -1],
            "fall": peak - gold[:, -1] if missing is None else missing,
            "peak_nfe": np.take_along_axis(nfe, k, 1) if missing is None else missing,
            "proxy_end": proxy[:, -1], "over_end": proxy[:, -1] - gold[:, -1], "kl_end": kl[:, -1]}


def changes(xs, metric):
    """[runs, evaluations, pairs]: every run's change of a metric's score on each pair since iteration 0 (KL: the
    value itself), at the evaluations every run has."""
    e = min(map(len, xs))
    return np.stack([[p["pairs"][metric] - (0 if metric == "kl" else x[0]["pairs"][metric]) for p in x[:e]]
                     for x in xs])


def measures(xs, *, config) -> dict:
    """{measure: (value, its resamples, seeds)} of a config's runs: the out-of-sample peak of gold, gold there and
    at the end, the fall between them, the NFE of the peak, the proxy's change, the over-rating and the KL at the
    end (per_run), as means over seeds and pairs, with results/stats.py's resamples."""
    gold, proxy, kl = changes(xs, "train"), changes(xs, "toy_proxy"), changes(xs, "kl")
    nfe = np.array([[p["nfe"] for p in x[:gold.shape[1]]] for x in xs])
    pairs = gold.shape[2]
    point = per_run(gold.mean(2, keepdims=True), proxy.mean(2, keepdims=True), kl.mean(2, keepdims=True),
                    nfe)
    draws = per_run(st.on_pairs(gold), st.on_pairs(proxy), st.on_pairs(kl, first=kl.shape[2], pairs=pairs), nfe)
    return {k: (float(point[k].mean()), st.over_seeds(draws[k], config), len(xs)) for k in point}


def matched(xs, *, config, axis: str, level: float):
    """The over-rating (proxy minus gold change) where the mean curve over seeds of `axis` (toy_proxy: its
    change; kl) first reaches `level`, linear between evaluations: (value or None, least and greatest resamples:
    a resample whose curve never reaches the level counts as anything)."""
    over, x = changes(xs, "over"), changes(xs, axis)
    pairs = over.shape[2]
    ox = st.on_pairs(x, first=x.shape[2], pairs=pairs) if axis == "kl" else st.on_pairs(x)
    Y, X = (st.over_seeds(np.moveaxis(v, 2, 1), config) for v in (st.on_pairs(over), ox))
    y, xm = over.mean((0, 2))[None], x.mean((0, 2))[None]
    v, V = at_level(xm, y, level)[0], at_level(X, Y, level)
    return (None if math.isnan(v) else float(v)), np.where(np.isnan(V), -np.inf, V), np.where(np.isnan(V), np.inf, V)


def at_level(X, Y, level):
    """[R]: Y where each curve X[r] first reaches level (linear between evaluations), NaN where it never does."""
    return compare.first_reach(Y, X, level, slack=0.0)


def cell(m, *, digits=4, sign="+"):
    """'+0.0123 [+0.0045, +0.0201]' of a (value, resamples, seeds) measure."""
    value, draws, n = m
    if n < 2 or not math.isfinite(value):
        return "-" if not math.isfinite(value) else f"{value:{sign}.{digits}f}"
    return st.fmt(value, *st.interval(draws, seeds=n), digits=digits, sign=sign)


def level_cell(xs, *, config, axis, level):
    v, least, most = matched(xs, config=config, axis=axis, level=level)
    if v is None:
        return "not reached"
    lo, hi = st.interval(least, seeds=len(xs), upper=most)
    return st.fmt(v, lo, hi).replace("-inf", "?").replace("inf", "?")


def figure(cv, path):
    """Per method two panels, gold against proxy and gold against the KL to the base: the seeds' mean changes at
    every evaluation (the first: the base model, at 0), Flow-GRPO without KL in grey beside; on the first, the
    diagonal where gold gains what the proxy gains (the over-rating is the distance to its right of it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_curve(c, key):
        points = [p["iteration"] for p in cv[c][0]]
        return [compare.stats([at(x, "iteration", i, key) - x[0][key] * (key != "kl") for x in cv[c]])[0]
                for i in points]

    names = [n for n in HACKING if "proxy_" + n in cv]
    rows = math.ceil(len(names) / 3)
    fig, axes = plt.subplots(rows, 6, figsize=(22, 3.3 * rows), squeeze=False)
    ref = "proxy_flow_grpo_kl0"
    for j, name in enumerate(names):
        c = "proxy_" + name
        gold = mean_curve(c, "train")
        for ax, key, xlabel in ((axes[j // 3, 2 * (j % 3)], "proxy", "proxy change"),
                                (axes[j // 3, 2 * (j % 3) + 1], "kl", "KL to the base (see docs/results.md)")):
            if ref in cv and c != ref:
                ax.plot(mean_curve(ref, key), mean_curve(ref, "train"), color="0.7", lw=1, label=HACKING[ref[6:]][2])
            xs = mean_curve(c, key)
            ax.plot(xs, gold, marker="o", ms=3, color="C0", label=f"{HACKING[name][2]} (n = {len(cv[c])})")
            if key == "proxy":
                lim = max(max(xs), max(gold))
                ax.plot([0, lim], [0, lim], color="C3", ls=":", lw=0.8)
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("gold change", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(plt.MaxNLocator(4))
            ax.grid(alpha=0.3)
        axes[j // 3, 2 * (j % 3)].set_title(HACKING[name][2], fontsize=9, loc="left")
    for ax in axes.flat[2 * len(names):]:
        ax.axis("off")
    fig.suptitle("Gold against proxy and against the KL to the base: the mean over seeds at every evaluation (dotted: "
                 "gold = proxy, the over-rating is the distance to its right; grey: Flow-GRPO without KL)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summarize(a) -> list[str]:
    runs = load(a)
    waiting = [c for c, rs in runs.items() if len(rs) < 2]  # an interval, a peak out of sample: 2 seeds
    runs = {c: rs for c, rs in runs.items() if c not in waiting}
    cv = {c: [hacking_curves(r) for r in rs] for c, rs in runs.items()}
    ms = {c: measures(xs, config=c) for c, xs in cv.items()}
    lines = ["## Reward hacking: every method on a learned proxy of the training reward", "",
             *([f"Not yet in the tables (one finished seed; a row needs two): {', '.join(sorted(waiting))}.",
                ""] if waiting else []),
             "Each row: changes from the base model, the mean over seeds and the evaluation pairs [its 95% interval: "
             "results/stats.py, the seeds and the pairs resampled, a t quantile for the number of seeds]. The "
             "over-rating is the proxy's change minus the gold reward's (the exact training reward's) at the end: how "
             "much more the proxy credits the trained model than it earned. The peak is chosen out of sample: each "
             "seed is read at the evaluation where the other seeds' mean gold change is highest (leave one seed out; "
             "its NFE: the mean over seeds), the fall is from there to the end. KL to the base at the end: "
             "evaluate.py --kl-to-base on the first 64 pairs (docs/results.md: what it is and is not).", "",
             "| method | config | seeds | over-rating at the end | proxy at the end | gold at the end | gold at the peak "
             "(out of sample) | NFE of the peak | fall from the peak | KL to the base at the end |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, (_, _, label) in HACKING.items():
        c = "proxy_" + name
        if c not in ms:
            continue
        m = ms[c]
        lines.append(f"| {label} | {c} | {len(cv[c])} | {cell(m['over_end'])} | {cell(m['proxy_end'])} | "
                     f"{cell(m['end'])} | {cell(m['peak'])} | {m['peak_nfe'][0]:,.0f} | {cell(m['fall'])} | "
                     f"{cell(m['kl_end'], digits=1, sign='')} |")
    lines += ["", "Over-rating at matched proxy gain and at matched drift: where the mean curve over seeds first reaches "
              "the proxy change or the KL to the base of the column (linear between evaluations; 'not reached': "
              "the mean curve never does; '?' as an interval's end: more than 2.5% of the resamples never do).", "",
              "| method | " + " | ".join(f"proxy {v:+.3f}" for v in PROXY_LEVELS) + " | "
              + " | ".join(f"KL {v}" for v in KL_LEVELS) + " |", "|---|" + "---|" * (len(PROXY_LEVELS) + len(KL_LEVELS))]
    for name, (_, _, label) in HACKING.items():
        c = "proxy_" + name
        if c in cv:
            lines.append(f"| {label} | " + " | ".join(
                [level_cell(cv[c], config=c, axis="toy_proxy", level=v) for v in PROXY_LEVELS]
                + [level_cell(cv[c], config=c, axis="kl", level=v) for v in KL_LEVELS]) + " |")
    refs = [r for r in REFERENCES if "proxy_" + r in ms]
    lines += ["", "Over-rating at the end against Flow-GRPO's: the difference [its interval], 'less' when it lies "
              "below 0, 'more' when above, else unresolved.", "",
              "| method | seeds | " + " | ".join(f"minus {HACKING[r][2]} | verdict" for r in refs) + " |",
              "|---|---|" + "---|---|" * len(refs)]
    for name, (_, _, label) in HACKING.items():
        c = "proxy_" + name
        if c not in ms:
            continue
        cells = []
        for r in refs:
            if r == name:
                cells += ["-", "-"]
                continue
            (va, da, na), (vb, db, nb) = ms[c]["over_end"], ms["proxy_" + r]["over_end"]
            lo, hi = st.interval(da - db, seeds=min(na, nb))
            v = st.verdict(lo, hi)
            cells += [st.fmt(va - vb, lo, hi), {"supported": "more", "not supported": "less"}.get(v, v)]
        lines.append(f"| {label} | {len(cv[c])} | " + " | ".join(cells) + " |")
    lines += ["", "| claim (a vs b; b = 0: a alone) | seeds | a | b | difference (a - b) [interval] | verdict |",
              "|---|---|---|---|---|---|"]
    for claim, x, y, key, sign in CLAIMS:
        x, y = "proxy_" + x, y and "proxy_" + y
        if x not in cv or (y and y not in cv):
            continue
        subsets = [(ms, "")]
        if max(len(cv[c]) for c in (x, y) if c) > FIRST_SEEDS:  # and what the first seeds said
            subsets.append(({c: measures(cv[c][:FIRST_SEEDS], config=c) for c in (x, y) if c},
                            f", first {FIRST_SEEDS} seeds"))
        for m, note in subsets:
            (va, da, na) = m[x][key]
            (vb, db, nb) = m[y][key] if y else (0.0, np.zeros(st.RESAMPLES), na)
            lo, hi = st.interval(da - db, seeds=min(na, nb)) if min(na, nb) > 1 else (math.nan, math.nan)
            f = ",.0f" if key.endswith("nfe") else "+.1f" if key.startswith("kl") else "+.4f"
            g = f.replace(",", "+,")
            lines.append(f"| {claim} ({x} vs {y or 0}{note}) | {na}{f', {nb}' if y else ''} | {va:{f}} | {vb:{f}} | "
                         f"{va - vb:{g}} [{lo:{g}}, {hi:{g}}] | "
                         f"**{st.verdict(*sorted((sign * lo, sign * hi)))}** |")
    figure(cv, os.path.join(a.out, "hacking.png"))
    with open(os.path.join(a.out, "hacking.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(HACKING), choices=list(HACKING), metavar="CONFIG")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 .. the config's SEEDS - 1")
    p.add_argument("--workers", type=int, default=2, help="runs side by side, one thread each")
    p.add_argument("--budget-nfe", type=float, default=60 * 3072, help="NFE per run (default: 60 Flow-GRPO iterations)")
    p.add_argument("--iterations", type=int, default=0, help="if > 0: this many iterations for every config")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-num", type=int, default=256)
    p.add_argument("--kl-pairs", type=int, default=64, help="the evaluation pairs the KL to the base is taken on")
    p.add_argument("--extra", default="", help="flags appended to every run (e.g. smaller groups for a smoke test)")
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "hacking"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "hacking"))
    p.add_argument("--summary-only", action="store_true")
    a = p.parse_args()
    a = argparse.Namespace(**vars(a), configs_given=a.configs, equal=False, min_iterations=10,
                           measure=lambda run: kl_of_checkpoints(run, pairs=a.kl_pairs))
    a.configs = ["proxy_" + c for c in a.configs_given]
    if not a.summary_only:
        compare.run_all(a)
    os.makedirs(a.out, exist_ok=True)
    print("\n".join(summarize(a)))


if __name__ == "__main__":
    main()
