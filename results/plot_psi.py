"""psi(t) over the calibration iterations of `densegrpo.py --calibrate` (Algorithm 1).

    python results/plot_psi.py results/toy_psi.json --out results/toy_psi.png

Reads the psi JSON that --calibrate writes (its "history": psi after every iteration) and draws one line per
calibration iteration against the sampling step (left), and each step's psi against the iteration (right).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("psi_json")
    parser.add_argument("--out", required=True, help="the PNG to write")
    a = parser.parse_args()
    saved = json.load(open(a.psi_json))
    history = saved["history"]
    start = saved["args"]["noise_level"]
    T, n = len(history[0]), len(history)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cmap = plt.get_cmap("viridis")
    left.plot(range(T), [start] * T, color="grey", ls="--", label="start")
    for k, psi in enumerate(history):
        left.plot(range(T), psi, color=cmap(k / max(n - 1, 1)), label=f"iteration {k + 1}" if k in (0, n - 1) else None)
    left.set(xlabel="sampling step i (0 = the noisiest)", ylabel="psi(t)", title="psi per step, one line per iteration")
    left.legend(fontsize=8)
    for t in range(T):
        right.plot(range(n + 1), [start] + [h[t] for h in history], color=plt.get_cmap("plasma")(t / max(T - 1, 1)),
                   label=f"step {t}" if t in (0, T // 2, T - 1) else None)
    right.set(xlabel="calibration iteration", ylabel="psi(t)", title="each step's psi over the iterations")
    right.legend(fontsize=8)
    rule = saved["args"].get("calibration_rule", "pooled")
    fig.suptitle(f"Algorithm 1, rule '{rule}': eps1 {saved['args']['eps1']}, eps2 {saved['args']['eps2']}, "
                 f"{saved['args']['prompts_per_iteration']} prompts x {saved['args']['group_size']} per iteration")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    ups = [sum(h > s for h, s in zip(history[-1], [start] * T)), sum(h < s for h, s in zip(history[-1], [start] * T))]
    print(f"after {n} iterations: psi rose at {ups[0]} steps and fell at {ups[1]} of {T}; "
          f"range {min(history[-1]):.2f}..{max(history[-1]):.2f}")


if __name__ == "__main__":
    main()
