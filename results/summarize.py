"""Summarise training runs: evaluation curves with paired standard errors against the base model.

    python results/summarize.py RUN_DIR [RUN_DIR ...] --out results/NAME

Reads each run's metrics.jsonl and eval_<iteration>.json (every held-out prompt/seed pair's reward, written by the
algorithm files), and writes NAME.png (evaluation rewards and training rewards against iterations and wall time) and
NAME.md (a table: every evaluation of every run, the change from iteration 0 with its paired standard error).
"""
import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_run(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = {}
    for name in os.listdir(run_dir):
        if name.startswith("eval_") and name.endswith(".json"):
            evals[int(name[5:-5])] = json.load(open(os.path.join(run_dir, name)))
    return rows, dict(sorted(evals.items()))


def paired(base, now):
    """Mean change and its paired standard error over evaluation pairs."""
    d = [b - a for a, b in zip(base, now)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else float("nan")
    return mean, sd / math.sqrt(n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True, help="output path without extension")
    parser.add_argument("--labels", nargs="*", help="one label per run (default: the run directory names)")
    a = parser.parse_args()
    labels = a.labels or [os.path.basename(r.rstrip("/")) for r in a.runs]
    runs = {label: load_run(r) for label, r in zip(labels, a.runs)}
    metrics = sorted({k for _, ev in runs.values() for e in ev.values() for k in e})
    train_keys = sorted({k for rows, _ in runs.values() for r in rows for k in r
                         if k.startswith("reward/") and k.endswith("_mean")})

    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(4.2 * (len(metrics) + 1), 3.6), squeeze=False)
    lines = ["| run | iteration | wall s | " + " | ".join(f"{m} (change +- paired SE)" for m in metrics) + " |",
             "|---|---|---|" + "---|" * len(metrics)]
    for label, (rows, evals) in runs.items():
        wall, t = {0: 0.0}, 0.0
        for r in rows:
            t += r.get("perf/seconds_per_iteration", 0.0)
            wall[r["iteration"]] = t
        base = evals.get(0)
        for j, m in enumerate(metrics):
            its = [i for i in evals if m in evals[i]]
            means = [sum(evals[i][m]) / len(evals[i][m]) for i in its]
            ses = [paired(base[m], evals[i][m])[1] if base else 0.0 for i in its]
            axes[0, j].errorbar(its, means, yerr=ses, capsize=3, marker="o", label=label)
            axes[0, j].set(title=f"eval: {m}", xlabel="iteration", ylabel="mean over held-out pairs")
        for k in train_keys:
            pts = [(r["iteration"], r[k]) for r in rows if k in r]
            smooth = [sum(p[1] for p in pts[max(0, i - 9):i + 1]) / len(pts[max(0, i - 9):i + 1]) for i in range(len(pts))]
            axes[0, -1].plot([p[0] for p in pts], smooth, label=f"{label}: {k[7:-5]}")
        axes[0, -1].set(title="training batches (10-iteration mean)", xlabel="iteration", ylabel="reward")
        for i, e in evals.items():
            cells = []
            for m in metrics:
                mean = sum(e[m]) / len(e[m])
                if base and i != 0:
                    d, se = paired(base[m], e[m])
                    cells.append(f"{mean:.4f} ({d:+.4f} +- {se:.4f}, {d / se if se else float('nan'):+.1f} SE)")
                else:
                    cells.append(f"{mean:.4f}")
            lines.append(f"| {label} | {i} | {wall.get(i, float('nan')):.0f} | " + " | ".join(cells) + " |")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out + ".png", dpi=110)
    n = len(next(iter(next(iter(runs.values()))[1].values()))[metrics[0]]) if metrics else 0
    lines += ["", "Rewards of the training batches (SDE samples for Flow-GRPO; fresh prompts every iteration), mean over "
              "the first and the last 10 iterations:", "", "| run | reward | iterations 1-10 | last 10 |", "|---|---|---|---|"]
    for label, (rows, _) in runs.items():
        for k in train_keys:
            vals = [r[k] for r in rows if k in r]
            if vals:
                lines.append(f"| {label} | {k[7:-5]} | {sum(vals[:10]) / len(vals[:10]):.4f} | "
                             f"{sum(vals[-10:]) / len(vals[-10:]):.4f} |")
    with open(a.out + ".md", "w") as f:
        f.write(f"Evaluation on {n} fixed held-out prompt/seed pairs (ODE sampling); change against iteration 0 with "
                f"its paired standard error.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
