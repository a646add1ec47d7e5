"""The papers' baselines: dancegrpo.py (per-sample random steps), mixgrpo.py (the sliding ODE-SDE window, Flash's
DPM-Solver++ tail) and Flow-GRPO + CoCA (flow_grpo.py --credit coca): their rules against independent
computations, NFE against the closed forms, the first ratio, resume, 2 processes, bad input."""
import math
import os

import pytest
import torch

import dancegrpo
import flow_grpo
import mixgrpo
from common import coca_credit, shifted_sigmas
from helpers import check_args, read_metrics, run_script, tiny_flags


# ---------------------------------------------------------------- MixGRPO's window
def official_windows(iterations, *, steps, size, stride, interval):
    """MixGRPO's GRPOTrainingStates (fastvideo/utils/grpo_states.py) with --prog_overlap --roll_back, as read:
    the window range(cur, min(cur + size, steps - 2)) is read, then the state advances: after `interval`
    iterations cur += stride, and cur > steps - 2 rolls back to 0."""
    cur, it, last, out = 0, 0, steps - 2, []
    for _ in range(iterations):
        out.append(list(range(cur, min(cur + size, last))))
        it += 1
        if it >= interval:
            it = 0
            cur += stride
        if cur > last:
            cur, it = 0, 0
    return out


def windows(iterations, **over):
    args = mixgrpo.Args(**over)
    return [mixgrpo.window_steps(args, i) for i in range(iterations)]


def test_window_follows_the_official_schedule_over_300_iterations():
    paper = dict(steps=25, size=4, stride=1, interval=25)
    ours = windows(300, num_steps=25, window_size=4, window_stride=1, window_shift_interval=25)
    assert ours == official_windows(300, **paper)
    assert ours[0] == [0, 1, 2, 3] and ours[25] == [1, 2, 3, 4] and ours[299] == [11, 12, 13, 14]
    # Flash* (stride 0): the window stays at the first 4 steps
    assert set(map(tuple, windows(300, num_steps=25, window_stride=0, window_shift_interval=20))) == {(0, 1, 2, 3)}


def test_window_shrinks_and_rolls_back_without_the_official_empty_window():
    """With a short interval the window reaches the end: it shrinks to [20, 21, 22], [21, 22], [22] as the official
    one; at start 23 the official window is empty for a whole interval (its training loop then fails): here the
    window rolls back to 0 instead, so ours is the official sequence without those iterations."""
    official = official_windows(400, steps=25, size=4, stride=1, interval=5)
    nonempty = [w for w in official if w]
    ours = windows(len(nonempty), num_steps=25, window_size=4, window_stride=1, window_shift_interval=5)
    assert [20, 21, 22] in ours and [21, 22] in ours and [22] in ours and [] not in ours
    first_empty = official.index([])
    assert first_empty == 23 * 5 and ours[:first_empty] == official[:first_empty]
    assert ours == nonempty and len(official) - len(nonempty) == 3 * 5  # three cycles, each without its empty one


def test_random_windows_are_full_and_the_same_on_every_rank():
    args = mixgrpo.Args(window_strategy="random")
    starts = [mixgrpo.window_steps(args, i)[0] for i in range(300)]
    assert all(len(mixgrpo.window_steps(args, i)) == 4 for i in range(50))
    assert min(starts) == 0 and max(starts) == 25 - 2 - 4 and len(set(starts)) > 15  # uniform in 0..19
    assert starts == [mixgrpo.window_steps(mixgrpo.Args(window_strategy="random"), i)[0] for i in range(300)]


# ---------------------------------------------------------------- Flash: DPM-Solver++ against the exact ODE
M, S = 1.5, 0.4  # Gaussian data N(M, S^2)


def exact_x0(x, sigma):
    """E[x0 | x_sigma] for data N(M, S^2), x_sigma = (1 - sigma) x0 + sigma eps: the exact data prediction."""
    a = 1 - sigma
    return M + a * S**2 / (a**2 * S**2 + sigma**2) * (x - a * M)


def exact_flow(x, sigma, sigma_next):
    """The probability-flow ODE's exact map from sigma to sigma_next for Gaussian data (affine in x)."""
    def scale(s):
        return math.sqrt((1 - s) ** 2 * S**2 + s**2)
    return (1 - sigma_next) * M + scale(sigma_next) / scale(sigma) * (x - (1 - sigma) * M)


def flash_tail(x, sigmas, order):
    """Run the solver along `sigmas` (ending above 0) with the exact data predictions; order 1 drops the history."""
    x0_prev = None
    for i in range(len(sigmas) - 1):
        x0 = exact_x0(x, sigmas[i])
        prev = sigmas[i - 1] if i else 1.0
        x = mixgrpo.dpm_solver_step(x, x0, x0_prev if order == 2 else None, sigmas[i], prev, sigmas[i + 1])
        x0_prev = x0
    return x


def test_dpm_solver_step_is_second_order_on_the_closed_form():
    """From sigma = 0.8 to 0.05 along n shifted steps, DPM-Solver++ 2M with the exact data prediction tracks the
    exact ODE solution with an error falling ~4x per halving of the step (second order: measured 3.7x, 3.9x),
    against ~2x for the first-order (DDIM) steps; the last step to sigma = 0 lands on the data prediction."""
    x = torch.linspace(-3, 3, 101, dtype=torch.float64)
    errors = {1: [], 2: []}
    for n in (64, 128, 256):
        u = torch.linspace(0.8, 0.05, n + 1, dtype=torch.float64)
        sigmas = (3 * u / (1 + 2 * u)).tolist()
        truth = exact_flow(x, sigmas[0], sigmas[-1])
        for order in (1, 2):
            errors[order].append(float((flash_tail(x, sigmas, order) - truth).abs().max()))
    ratios = {o: [a / b for a, b in zip(e, e[1:])] for o, e in errors.items()}
    assert all(r > 3.5 for r in ratios[2]) and all(1.8 < r < 2.2 for r in ratios[1]), (errors, ratios)
    assert errors[2][-1] < 2e-4 and errors[2][-1] < errors[1][-1] / 50
    x0 = exact_x0(x, 0.05)
    assert torch.equal(mixgrpo.dpm_solver_step(x, x0, None, 0.05, 0.1, 0.0), x0)


def test_flash_points_and_schedule():
    """The official n_post = int(max((T - L) r, 1)) points from sigma_{L+1} to 0 (here at least 2): L = 3, T = 25:
    0.4 -> 8 points (7 solver steps, 11 NFE a sample), Flash* 0.2 -> 4 (7 NFE)."""
    args = mixgrpo.Args(flash=True)
    assert mixgrpo.flash_points(args, 3) == 8 and mixgrpo.flash_points(mixgrpo.Args(flash_compress=0.2), 3) == 4
    assert mixgrpo.flash_points(args, 21) == 2  # official: 1 point, a noisy latent decoded
    assert mixgrpo.planned_nfe(args)["rollout"] == 12 * 11
    assert mixgrpo.planned_nfe(mixgrpo.Args(flash=True, flash_compress=0.2, window_stride=0))["rollout"] == 12 * 7


# ---------------------------------------------------------------- CoCA's credit
def coca_by_hand(advantages, x0_hats, final, window, alpha, group_size, trained):
    """CoCA's formula (scripts/train_coca.py, pipeline_with_logprob_coca.py), one sample at a time in float64."""
    T, N = x0_hats.shape[:2]
    R = torch.zeros(T, N, dtype=torch.float64)
    for n in range(N):
        f = final[n].double().flatten()
        c = [float(torch.dot(x0_hats[k, n].double().flatten(), f) / (x0_hats[k, n].double().norm() * f.norm()))
             for k in range(T)] + [1.0]
        d = c[1:]
        m = [sum(d[j * window:(j + 1) * window]) / window for j in range(T // window)]
        g = [m[0] - c[0]] + [m[j] - m[j - 1] for j in range(1, len(m))]
        w = [g[k // window] / (window * sum(g)) for k in range(T)]
        for k in range(T):
            R[k, n] = float(advantages[n]) * (alpha + (1 - alpha) * sum(w[k:]))
    for start in range(0, N, group_size):
        block = R[:trained, start:start + group_size]
        R[:, start:start + group_size] = (R[:, start:start + group_size] - block.mean()) / (block.std(unbiased=False)
                                                                                             + 1e-6)
    return R


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_coca_credit_equals_a_float64_hand_computation(alpha):
    g = torch.Generator().manual_seed(0)
    T, N, G = 10, 8, 4
    final = torch.randn(N, 4, 4, 4, generator=g)
    x0_hats = final + torch.linspace(2, 0.1, T).view(T, 1, 1, 1, 1) * torch.randn(T, N, 4, 4, 4, generator=g)
    advantages = torch.randn(N, generator=g)
    got = coca_credit(advantages, x0_hats, final, window=5, alpha=alpha, group_size=G, trained=9)
    torch.testing.assert_close(got.double(), coca_by_hand(advantages, x0_hats, final, 5, alpha, G, 9), rtol=1e-5,
                               atol=1e-5)
    # the weights sum to one: before standardisation the first step carries the whole advantage
    raw = coca_credit(advantages, x0_hats, final, window=5, alpha=alpha, group_size=1, trained=1)
    assert raw.shape == (T, N) and torch.isfinite(raw).all()


def test_coca_zero_gain_sum_falls_back_to_uniform_weights():
    """A trajectory whose similarity never changes (CoCA's code divides by zero there) gets uniform weights."""
    final = torch.ones(2, 1, 2, 2)
    x0_hats = final.expand(4, 2, 1, 2, 2).clone()  # c_k = 1 everywhere: every gain is 0
    out = coca_credit(torch.tensor([1.0, -1.0]), x0_hats, final, window=2, alpha=0.0, group_size=2, trained=4)
    s = torch.tensor([1.0, 0.75, 0.5, 0.25]).double()  # the uniform credit to go
    r = torch.stack([s, -s], 1)
    torch.testing.assert_close(out.double(), (r - r.mean()) / (r.std(unbiased=False) + 1e-6), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the files end to end (tiny random pipelines)
CASES = {  # name: (script, flags, rollout NFE per prompt at T = 6, G = 4; trained terms per prompt)
    "dancegrpo": ("dancegrpo.py", dict(no_full_finetune=True, updates_per_iteration=1), 4 * 6, 4 * 3),
    "mixgrpo": ("mixgrpo.py", dict(no_full_finetune=True, updates_per_iteration=1, window_size=2), 4 * 6, 4 * 2),
    "mixgrpo_flash": ("mixgrpo.py", dict(no_full_finetune=True, updates_per_iteration=1, window_size=2, flash=True,
                                         flash_compress=0.5), 4 * (1 + 2), 4 * 2),
    "coca": ("flow_grpo.py", dict(credit="coca", coca_window=3), 4 * 6, 4 * 5),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_tiny_runs(tiny, tmp_path, case, kind):
    """Two iterations: the first update's ratio is exactly 1, the rollout NFE is the closed form (planned_nfe),
    and the training forwards are what the file plans (DanceGRPO: int(5 x 0.6) = 3 random steps per sample;
    MixGRPO: the window's 2 steps; Flash: 2 window steps, then int((6 - 1) x 0.5) = 2 points: 1 solver step)."""
    script, flags, rollout, trained = CASES[case]
    extra = {"guidance": 4.5} if kind == "sd3" else {}
    run_script(script, tiny_flags(tiny[kind], tiny["prompts"], tmp_path, num_steps=6, **flags, **extra))
    _, m = read_metrics(tmp_path)
    for it in (1, 2):
        assert m[it]["train/first_ratio_max_dev"] == 0, m[it]  # exactly: the same micro-batches, the same numerics
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == rollout
    reference = 1 if case == "coca" else 0  # the KL's reference forwards (Flow-GRPO's beta 0.01)
    assert m[1]["perf/nfe_per_iteration"] == 2 * (rollout + trained * (1 + reference))
    assert "eval/jpeg" in m[2]


def test_dancegrpo_trains_random_steps_per_sample(tiny, tmp_path, monkeypatch):
    """Each sample trains its own int((T - 1) 0.6) distinct steps of the first T - 1 (never the last): the training
    forwards of one step hold only the samples that drew it, and they differ between steps."""
    import runpy
    import sys

    import common
    from helpers import ROOT

    rows, real = [], common.velocity

    def spy(transformer, kind, x, sigma, emb, *, guidance, detach_uncond=False):
        if torch.is_grad_enabled():
            rows.append((round(float(sigma), 6), len(x)))
        return real(transformer, kind, x, sigma, emb, guidance=guidance, detach_uncond=detach_uncond)

    monkeypatch.setattr(common, "velocity", spy)
    flags = tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_steps=11, num_iterations=1, eval_every=0,
                       group_size=8, micro_batch=8, no_full_finetune=True, updates_per_iteration=1)
    monkeypatch.setattr(sys, "argv", ["dancegrpo.py", *flags])
    torch.set_num_threads(1)
    runpy.run_path(os.path.join(ROOT, "dancegrpo.py"), run_name="__main__")
    sigmas = [round(float(s), 6) for s in shifted_sigmas(11, shift=3.0)]
    per_step = {}
    for sigma, n in rows:
        per_step[sigmas.index(sigma)] = per_step.get(sigmas.index(sigma), 0) + n
    assert sum(per_step.values()) == 16 * 6  # 2 prompts x 8 samples, int(10 x 0.6) = 6 steps each
    assert 10 not in per_step and len(per_step) > 6  # never the last step; more steps than any sample trains
    assert len(set(per_step.values())) > 1  # samples drew different steps


@pytest.mark.slow
@pytest.mark.parametrize("case,full", [("dancegrpo", False), ("dancegrpo", True), ("mixgrpo_flash", True),
                                       ("coca", False)],
                         ids=["dancegrpo-lora-ddp", "dancegrpo-full-fsdp2", "mixgrpo_flash-full-fsdp2",
                              "coca-lora-ddp"])
# MixGRPO's LoRA path is DanceGRPO's; its FSDP2 path is MixGRPO-Flash's (the same file and update: --flash only
# replaces the ODE steps after the window by fewer solver steps, which test_tiny_runs checks on one process)
def test_torchrun_two_processes(tiny, tmp_path, case, full):
    script, flags, rollout, trained = CASES[case]
    flags = dict(flags, num_steps=6, prompts_per_iteration=4, updates_per_iteration=1)
    flags.pop("no_full_finetune", None)
    flags.update({"full_finetune": True} if full else {"no_full_finetune": True})
    run_script(script, tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, **flags), nproc=2)
    run, m = read_metrics(tmp_path)
    assert m[1]["train/first_ratio_max_dev"] == 0 and "eval/jpeg" in m[2]
    assert m[1]["perf/nfe_rollout_per_prompt"] == rollout  # over both ranks' prompts
    assert os.path.isdir(os.path.join(run, "checkpoints", "iter_2"))


@pytest.mark.parametrize("module,over,message", [
    (dancegrpo, {"timestep_fraction": 0.05}, r"--timestep-fraction 0.05 of --num-steps 16 trains no step"),
    (dancegrpo, {"timestep_fraction": 1.5}, r"--timestep-fraction 1.5 is not allowed; use a value in \(0, 1\]"),
    (mixgrpo, {"window_size": 24}, r"--window-size 24 is not allowed; use 1..23 \(T - 2\)"),
    (mixgrpo, {"window_size": 0}, r"--window-size 0 is not allowed; use a value in \[1, 1000\]"),
    (mixgrpo, {"window_stride": -1}, r"--window-stride -1 is not allowed; use a value in \[0, 1000\]"),
    (mixgrpo, {"window_shift_interval": 0}, r"--window-shift-interval 0 is not allowed; use a value in \[1, 1e9\]"),
    (mixgrpo, {"flash_compress": 0.0}, r"--flash-compress 0.0 is not allowed; use a value in \(0, 1\]"),
    (flow_grpo, {"credit": "coca", "coca_window": 3}, r"--coca-window 3 does not divide --num-steps 10"),
    (flow_grpo, {"credit": "coca", "coca_window": 0}, r"--coca-window 0 is not allowed; use a value in \[1, 1000\]"),
    (dancegrpo, {"beta": 0.01, "noise_level": 0.0}, r"--beta > 0 needs --noise-level > 0"),
    (mixgrpo, {"beta": 0.01, "noise_level": 0.0}, r"--beta > 0 needs --noise-level > 0"),
    (dancegrpo, {"updates_per_iteration": 4}, r"--updates-per-iteration 4 is not allowed; use 1..3 \(mini-batches"),
    (mixgrpo, {"updates_per_iteration": 5}, r"--updates-per-iteration 5 is not allowed; use 1..4 \(mini-batches"),
])
def test_bad_input(module, over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(module, world=32 if module is mixgrpo else 16 if module is dancegrpo else 1, **over)


def test_paper_command_lines_parse():
    """torchrun --nproc_per_node 16 dancegrpo.py; torchrun --nnodes 4 --nproc_per_node 8 mixgrpo.py [--flash];
    flow_grpo.py --credit coca: the papers' settings."""
    import tyro

    mix = tyro.cli(mixgrpo.Args, args=[])
    check_args(mixgrpo, world=32)
    assert (mix.num_steps, mix.shift, mix.group_size, mix.noise_level, mix.window_size, mix.window_stride,
            mix.window_shift_interval) == (25, 3.0, 12, 0.7, 4, 1, 25)
    assert mix.rewards == ("hps", "imagereward", "pickscore") and mix.reward_combine == "advantages"
    assert (mix.adv_eps, mix.clip_range, mix.beta, mix.learning_rate, mix.resolution) == (1e-8, 1e-4, 0.0, 1e-5, 720)
    assert mix.full_finetune and mix.updates_per_iteration == 4 and mix.micro_batch == 3
    flash = tyro.cli(mixgrpo.Args, args=["--flash", "--window-stride", "0", "--flash-compress", "0.2"])
    assert flash.flash and flash.window_stride == 0
    check_args(dancegrpo, world=16)
    coca = tyro.cli(flow_grpo.Args, args=["--credit", "coca"])
    check_args(flow_grpo, world=8, credit="coca")
    assert (coca.coca_window, coca.coca_alpha, coca.num_steps) == (1, 0.0, 10)
