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
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402
from compare import A, B, CONFIGS, FIRST_SEEDS, ROOT, S, at, curves, judge, load, stats  # noqa: E402

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
    ("GRPO-Guard over-optimises less than Flow-GRPO (its paper): a smaller fall", "flow_grpo_guard", "flow_grpo_kl0",
     "fall", -1),
    ("Flow-DPPO drifts less from the base than Flow-GRPO (its paper): a smaller KL at the end", "flow_dppo",
     "flow_grpo", "kl_end", -1),
    ("A larger KL coefficient peaks higher (Flow-GRPO, KL 0.4 against 0.04)", "flow_grpo_kl4", "flow_grpo", "peak", 1),
    ("A larger KL coefficient peaks later (Flow-GRPO, KL 0.4 against 0.04; NFE of each seed's own peak)",
     "flow_grpo_kl4", "flow_grpo", "own_peak_nfe", 1),
]
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
        entries = json.load(open(os.path.join(out, "scores.json")))["entries"]
    kl = {str(i): [round(x, 6) for x in e["scores"]["kl_to_base"]] for (i, _), e in zip(ckpts, entries)}
    return {"kl": {"0": [0.0] * pairs, **kl}}


def hacking_curves(run):
    """compare.curves (gold = its "train", the mean of the two exact rewards) with the proxy's mean and the KL."""
    out = curves(run)
    for p in out:
        p["proxy"] = p["toy_proxy"]
        p["kl"] = stats(run.get("kl", {}).get(str(p["iteration"]), [math.nan]))[0]
    return out


def measures(xs, *, peak_of=None) -> list[dict]:
    """Each run's numbers at its config's peak, the evaluation where the gold reward's mean change over the seeds is
    highest (one evaluation for all seeds: a maximum per seed would pick each seed's luckiest evaluation): the gold
    change there and at the end, the fall between them, the NFE of the peak, the NFE of the seed's own highest
    evaluation, and the proxy's change and the KL at the end. peak_of: other runs whose mean picks the peak (then
    the choice of the evaluation owes nothing to these runs' noise)."""
    def gold_changes(runs):
        return [[p["train"] - x[0]["train"] for p in x] for x in runs]
    gold, chooser = gold_changes(xs), gold_changes(peak_of or xs)
    k = max(range(min(map(len, gold + chooser))), key=lambda i: stats([g[i] for g in chooser])[0])
    return [{"peak": g[k], "peak_nfe": x[k]["nfe"], "end": g[-1], "fall": g[k] - g[-1],
             "own_peak_nfe": x[max(range(len(g)), key=g.__getitem__)]["nfe"],
             "proxy_end": x[-1]["proxy"] - x[0]["proxy"], "kl_end": x[-1]["kl"]} for x, g in zip(xs, gold)]


def mean_se(xs, digits=4, sign="+"):
    m, sd, n = stats(xs)
    se = f" +- {sd / math.sqrt(n):{sign.replace('+', '')}.{digits}f}" if n > 1 else ""
    return f"{m:{sign}.{digits}f}{se}"


def figure(cv, path):
    """Per method two panels, gold against proxy and gold against the KL to the base: the seeds' mean changes at
    every evaluation (the first: the base model, at 0), the peak ringed, Flow-GRPO without KL in grey beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_curve(c, key):
        points = [p["iteration"] for p in cv[c][0]]
        return [stats([at(x, "iteration", i, key) - x[0][key] * (key != "kl") for x in cv[c]])[0] for i in points]

    names = [n for n in HACKING if "proxy_" + n in cv]
    rows = math.ceil(len(names) / 3)
    fig, axes = plt.subplots(rows, 6, figsize=(22, 3.3 * rows), squeeze=False)
    ref = "proxy_flow_grpo_kl0"
    for j, name in enumerate(names):
        c = "proxy_" + name
        gold = mean_curve(c, "train")
        for ax, key, xlabel in ((axes[j // 3, 2 * (j % 3)], "proxy", "proxy change"),
                                (axes[j // 3, 2 * (j % 3) + 1], "kl", "KL to the base (nats)")):
            if ref in cv and c != ref:
                ax.plot(mean_curve(ref, key), mean_curve(ref, "train"), color="0.7", lw=1, label=HACKING[ref[6:]][2])
            xs = mean_curve(c, key)
            ax.plot(xs, gold, marker="o", ms=3, color="C0", label=f"{HACKING[name][2]} (n = {len(cv[c])})")
            k = max(range(len(gold)), key=gold.__getitem__)
            ax.plot(xs[k], gold[k], "o", ms=9, mfc="none", color="C3")
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("gold change", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(plt.MaxNLocator(4))
            ax.grid(alpha=0.3)
        axes[j // 3, 2 * (j % 3)].set_title(HACKING[name][2], fontsize=9, loc="left")
    for ax in axes.flat[2 * len(names):]:
        ax.axis("off")
    fig.suptitle("Gold against proxy and against the KL to the base: the mean over seeds at every evaluation "
                 "(ringed: the peak; grey: Flow-GRPO without KL)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summarize(a) -> list[str]:
    runs = load(a)
    cv = {c: [hacking_curves(r) for r in rs] for c, rs in runs.items()}
    ms = {c: measures(xs) for c, xs in cv.items()}
    lines = ["## Reward hacking: every method on a learned proxy of the training reward", "",
             "Each row: mean +- SE over seeds of the changes from the base model of the gold reward (the exact "
             "training reward) at the evaluation where their mean is highest (the peak) and at the end, the fall "
             "between them, the NFE of the peak (in brackets: of each seed's own highest evaluation), and the proxy's "
             "change and the KL to the base model (nats, evaluate.py --kl-to-base) at the end.", "",
             "| method | config | seeds | gold at the peak | NFE of the peak (each seed's own) | gold at the end | fall "
             "| proxy at the end | KL to the base at the end |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (_, _, label) in HACKING.items():
        c = "proxy_" + name
        if c not in ms:
            continue
        m = {k: [r[k] for r in ms[c]] for k in ms[c][0]}
        nfe = f"{stats(m['peak_nfe'])[0]:,.0f} ({mean_se(m['own_peak_nfe'], 0, sign=',')})"
        lines.append(f"| {label} | {c} | {len(ms[c])} | {mean_se(m['peak'])} | {nfe} | {mean_se(m['end'])} | "
                     f"{mean_se(m['fall'])} | {mean_se(m['proxy_end'])} | {mean_se(m['kl_end'], 1, sign='')} |")
    lines += ["", "| claim (a vs b; b = 0: a alone) | seeds | a | b | difference (a - b) | verdict |",
              "|---|---|---|---|---|---|"]
    for claim, x, y, key, sign in CLAIMS:
        x, y = "proxy_" + x, y and "proxy_" + y
        if x not in cv or (y and y not in cv):
            continue
        subsets = [(ms, "")]
        if max(len(cv[c]) for c in (x, y) if c) > FIRST_SEEDS:  # and what the first seeds said
            subsets.append(({c: measures(cv[c][:FIRST_SEEDS]) for c in (x, y) if c}, f", first {FIRST_SEEDS} seeds"))
        if key in ("peak", "fall") and min(len(cv[c]) for c in (x, y) if c) > FIRST_SEEDS:  # a peak chosen blind
            subsets.append(({c: measures(cv[c][FIRST_SEEDS:], peak_of=cv[c][:FIRST_SEEDS]) for c in (x, y) if c},
                            f", the later seeds at the peak of the first {FIRST_SEEDS}"))
        for m, note in subsets:
            (ma, sa, na), (mb, sb, nb) = (stats([r[key] for r in m[c]]) if c else (0.0, 0.0, 2) for c in (x, y))
            se = math.hypot(sa / math.sqrt(na), sb / math.sqrt(nb)) if na > 1 and nb > 1 else float("nan")
            f = ",.0f" if key.endswith("nfe") else "+.1f" if key.startswith("kl") else "+.4f"
            lines.append(f"| {claim} ({x} vs {y or 0}{note}) | {na}{f', {nb}' if y else ''} | {ma:{f}} | {mb:{f}} | "
                         f"{ma - mb:{f.replace(',', '+,')}} +- {se:{f.lstrip('+')}} | "
                         f"**{judge(sign * (ma - mb), se, 'better', mb)}** |")
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
