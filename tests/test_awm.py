"""awm.py: closed-form checks of its math (SA-Solver, the surrogate log-prob, the timestep strata), its NFE
against planned_nfe on tiny random Flux and SD3 pipelines, and its argument checks."""
import os

import pytest
import torch

import awm
import common
from awm import awm_log_prob, stratified_indices
from common import sa_solver, shifted_sigmas
from g2rpo import ode_step
from helpers import check_args, crashed_copy, read_metrics, run_in_process, run_script, tiny_flags
from test_math import M, S, exact_velocity


def transported(solve, sigmas):
    """The law N(b, a^2) an affine sampler (exact velocity of N(M, S^2) data) makes of N(0, 1): from x = 0, 1."""
    out = solve(lambda x, t: exact_velocity(x, float(t), M, S), torch.tensor([0.0, 1.0]), sigmas)
    return out[0].item(), (out[1] - out[0]).item()


def euler(v, x, sigmas):
    for i in range(len(sigmas) - 1):
        x = ode_step(v(x, sigmas[i]), x, sigmas[i], sigmas[i + 1])
    return x


@pytest.mark.parametrize("steps", [8, 14, 40])
def test_sa_solver_transports_noise_to_the_data_law_better_than_euler(steps):
    """Deterministic SA-Solver (AWM's grid: t_0 = 1 - 1e-3, t_-2 halved) on the shift-3 schedule: N(0, 1) -> N(M, S^2)
    with a smaller error than Euler's at equal steps (14 steps: |std - S| 2e-4, Euler 0.096), one NFE per step."""
    sigmas = shifted_sigmas(steps, shift=3.0)
    b, a = transported(sa_solver, sigmas)
    be, ae = transported(euler, sigmas)
    assert abs(b - M) < 2e-3 and abs(a - S) < {8: 0.08, 14: 2e-3, 40: 0.02}[steps]  # measured 0.073, 2e-4, 0.014
    assert abs(b - M) + abs(a - S) < abs(be - M) + abs(ae - S)
    calls = []
    sa_solver(lambda x, t: calls.append(float(t)) or x, torch.zeros(1), sigmas)
    assert len(calls) == steps and calls[0] == pytest.approx(1 - 1e-3)  # the last step calls no model


def test_stochastic_sa_solver_approaches_the_data_law():
    """tau = noise_level on 0.3 <= t <= 0.9: the mean is kept; the std converges to S with the steps (the official
    sampler's behaviour too: 0.577 at 14 steps with tau 0.4, 0.521 at 200)."""
    x = torch.randn(40_000, 4, generator=torch.Generator().manual_seed(0))
    v = lambda x, t: exact_velocity(x, float(t), M, S)  # noqa: E731
    stds = []
    for steps in (14, 200):
        out = sa_solver(v, x, shifted_sigmas(steps, shift=3.0), noise_level=0.4, generator=torch.Generator().manual_seed(1))
        assert abs(out.mean() - M) < 0.01
        stds.append(out.std().item())
    assert abs(stds[1] - S) < abs(stds[0] - S) < 0.1


def test_surrogate_log_prob_is_the_official_expression():
    """compute_log_prob_awm (train_sd3_awm.py:240-251), written out: mse in float64, t the timestep."""
    g = torch.Generator().manual_seed(0)
    mse, t = torch.rand(64, generator=g, dtype=torch.float64) * 2, torch.rand(64, generator=g, dtype=torch.float64)
    p = 0.25
    tiny = torch.pow(torch.tensor(1e-10, dtype=torch.float64), p)
    official = {"Uniform": -mse, "t": -mse * t, "t**2": -mse * t**2, "huber": -(torch.sqrt(mse + 1e-10) - 1e-5) * t,
                "ghuber": -(torch.pow(mse + 1e-10, p) - tiny) * t / p}
    v = torch.randn(64, 2, 3, 3, generator=g, dtype=torch.float64)
    target = v - mse.sqrt().view(-1, 1, 1, 1)  # mean (v - target)^2 = mse
    for weighting, expected in official.items():
        torch.testing.assert_close(awm_log_prob(v, target, t, weighting=weighting, power=p), expected, rtol=1e-12,
                                   atol=1e-15)
    v.requires_grad_(True)  # ghuber's gradient: -t (mse + 1e-10)^(p - 1) d mse / d v
    awm_log_prob(v, target, t, weighting="ghuber", power=p).sum().backward()
    d_mse = 2 * (v - target).detach() / v[0].numel()
    torch.testing.assert_close(v.grad, (-t * (mse + 1e-10) ** (p - 1)).view(-1, 1, 1, 1) * d_mse)


@pytest.mark.parametrize("kind,strata", [
    ("discrete", [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),
    ("discrete_wo_init", [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),  # linspace(1, 12, 7).long() = 1, 2, 4, ...
    ("discrete_with_init", [{0}, {1, 2}, {3, 4}, {5, 6}, {7, 8}, {9, 10, 11}]),  # 0, then linspace(1, 12, 6).long()
])
def test_timestep_strata_are_the_official_boundaries(kind, strata):
    """14 steps, timestep_fraction 0.9 (int(12.6) = 12 trainable steps), 6 timesteps: each column draws uniformly
    from its stratum (train_sd3_awm.py:1169-1203)."""
    idx = stratified_indices(12, 6, 4000, kind=kind, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (4000, 6)
    assert [set(idx[:, j].tolist()) for j in range(6)] == strata
    for j, s in enumerate(strata):
        counts = torch.bincount(idx[:, j], minlength=12)[sorted(s)].float()
        assert (counts / 4000 - 1 / len(s)).abs().max() < 0.04  # uniform within the stratum


def test_defaults_are_the_official_pickscore_config():
    """dgx_awm.py pickscore_sd3_no_cfg_1node (on 8 GPUs) and base_awm.py."""
    a = awm.Args()
    assert (a.num_steps, a.eval_steps, a.guidance, a.resolution, a.group_size, a.prompts_per_iteration) == (
        14, 40, 1.0, 512, 24, 24)
    assert (a.noise_level, a.train_timesteps, a.time_type, a.timestep_fraction) == (0.0, 6, "discrete", 0.9)
    assert (a.beta, a.ema_beta, a.weighting, a.ghuber_power, a.clip_range, a.advantage_max, a.adv_clip) == (
        1e-4, 1.0, "ghuber", 0.25, 1.0, 1.0, 5.0)
    assert (a.kl_ema_decay, a.kl_ema_decay_type, a.ema_decay, a.ema_every, a.updates_per_iteration) == (
        0.3, "linear", 0.99, 1, 1)
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm, a.lora_rank, a.lora_alpha, a.global_std) == (
        3e-4, 1e-4, 1.0, 32, 64, True)
    assert awm.planned_nfe(a) == {"rollout": 24 * 14, "train": 24 * 6, "reference": 24 * 6, "ema": 24 * 6, "old": 0}
    # two steps: the second half of the 576 samples needs its old log-probs, 6 forwards each (12 samples a prompt)
    assert awm.planned_nfe(awm.Args(updates_per_iteration=2))["old"] == 6 * 12


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_planned_nfe_is_measured_and_the_run_ends_with_its_summary(tiny, tmp_path, kind):
    flags = dict(train_timesteps=3, time_type="discrete", ema_every=1)  # 4 steps: int(3.6) = 3 trainable
    out = run_script("awm.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, **flags)).stdout
    run, m = read_metrics(tmp_path)
    assert "iteration 0 -> 2, change +- paired standard error" in out and "training reward" in out
    args = awm.Args(num_steps=4, group_size=4, train_timesteps=3)
    plan = awm.planned_nfe(args)
    assert plan == {"rollout": 16, "train": 12, "reference": 12, "ema": 12, "old": 0}
    for it in (1, 2):
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == plan["rollout"]
        assert m[it]["perf/nfe_per_iteration"] == 2 * sum(plan.values())  # 2 prompts
        assert m[it]["train/first_ratio_max_dev"] == 0.0 and m[it]["train/clipfrac"] == 0.0
        assert m[it]["train/kept_fraction"] == 1.0
    assert m[2]["train/kl"] > 0 and m[2]["train/ema_kl"] > 0  # the policy has moved from both
    state = torch.load(os.path.join(run, "checkpoints", "iter_2", "state.pt"), weights_only=True)
    assert state["extra"]["kl_ema"].keys() == state["trainable"].keys()
    # after 2 steps: kl_ema = d2 (d1 w0 + (1 - d1) w1) + (1 - d2) w2 with d = 0.001 s; it is no copy of the weights
    assert any(not torch.equal(state["extra"]["kl_ema"][k], state["trainable"][k]) for k in state["trainable"])


def test_several_steps_per_iteration_train_what_the_official_code_trains(tiny, tmp_path, monkeypatch):
    """One iteration of two optimizer steps on a tiny SD3 (LoRA, both KLs): the second step's gradient equals the
    official one written out here (train_sd3_awm.py: the later mini-batches' old log-probs computed before the first
    step, :1227-1238; the first's the same forward's, :1282-1284; the exp_first PPO loss and the KLs, :1286-1354), the
    eval EMA steps once per iteration (:1391-1392), and the NFE is planned_nfe's."""
    seen = {"terms": [], "policy_forwards": [], "steps": []}
    beta, ema_beta, lr = 1e-3, 1e-2, 1.0  # a large step: the ratio moves away from 1

    def keep(name, many=False):  # records what a function of the file returns
        def wrap(real):
            def spy(*a, **k):
                out = real(*a, **k)
                seen[name].append(out) if many else seen.__setitem__(name, out)
                return out
            return spy
        return wrap

    def velocity_spy(real):
        def spy(transformer, kind, x, sigma, emb, *, guidance, detach_uncond=False):
            if torch.is_grad_enabled():  # the policy's forwards: the terms a step trains on
                seen["policy_forwards"].append((len(seen["steps"]), x.detach().clone(), float(sigma), emb))
            return real(transformer, kind, x, sigma, emb, guidance=guidance, detach_uncond=detach_uncond)
        return spy

    def start_run_spy(real):
        def spy(*a, **k):
            run = seen["run"] = real(*a, **k)
            real_step = run.optimizer_step

            def optimizer_step(terms):
                seen["steps"].append({n: p.detach().clone() for n, p in run.params.items()})
                if len(seen["steps"]) == 2:
                    seen["file_gradient"] = {n: p.grad.clone() for n, p in run.params.items()}
                    nfe = common.NFE["count"]
                    seen["official_gradient"] = official_gradient(run.params, 1)
                    seen["nfe_here"] = common.NFE["count"] - nfe  # the test's forwards, not the file's
                return real_step(terms)
            run.optimizer_step = optimizer_step
            return run
        return spy

    def official_gradient(params, u):
        """The second step's gradient of train_sd3_awm.py's loss at the weights after the first step."""
        pipe, x0, real_velocity = seen["run"].pipe, seen["x0"], common.velocity
        c = seen["terms"][u][0][1]  # one micro-batch of 4 samples a mini-batch
        adv = (seen["advantages"].reshape(-1)[c].clamp(-5, 5) / 5 * 1.0).double()  # advantage_max 1 (:1293-1299)
        terms = [(x_t, t, emb) for step, x_t, t, emb in seen["policy_forwards"] if step == u]
        now = {n: p.detach().clone() for n, p in params.items()}

        def log_prob(v, x_t, t):  # compute_log_prob_awm: ghuber, p = 0.25 (:237-251); eps - x0 = (x_t - x0) / t
            mse = ((v.double() - ((x_t - x0[c]) / t).double()) ** 2).mean(dim=(1, 2, 3))
            return -((mse + 1e-10) ** 0.25 - 1e-10**0.25) * t / 0.25

        with torch.no_grad():  # old log-probs and the KL-EMA (still the initial weights): before the first step
            for n, p in params.items():
                p.copy_(seen["steps"][0][n])
            v_old = [real_velocity(pipe.transformer, "sd3", x_t, t, emb, guidance=1.0) for x_t, t, emb in terms]
            for n, p in params.items():
                p.copy_(now[n])
            pipe.transformer.disable_adapters()  # the reference: LoRA off (:1272-1275)
            v_ref = [real_velocity(pipe.transformer, "sd3", x_t, t, emb, guidance=1.0) for x_t, t, emb in terms]
            pipe.transformer.enable_adapters()
        v = [real_velocity(pipe.transformer, "sd3", x_t, t, emb, guidance=1.0) for x_t, t, emb in terms]
        log_probs = torch.stack([log_prob(v_k, x_t, t) for v_k, (x_t, t, _) in zip(v, terms)])  # [T, B]
        old = torch.stack([log_prob(v_k, x_t, t) for v_k, (x_t, t, _) in zip(v_old, terms)])
        ratio = torch.exp(log_probs.view(-1) - old.view(-1).detach())  # exp_first (:1305-1307)
        A = adv.unsqueeze(0).repeat(len(terms), 1).view(-1)
        policy_loss = torch.mean(torch.maximum(-A * ratio, -A * torch.clamp(ratio, 1.0 - 1.0, 1.0 + 1.0)))
        kl = torch.stack([((a.double() - b.double()) ** 2).mean(dim=(1, 2, 3)) for a, b in zip(v, v_ref)]).mean()
        ema_kl = torch.stack([((a.double() - b.double()) ** 2).mean(dim=(1, 2, 3)) for a, b in zip(v, v_old)]).mean()
        loss = policy_loss + beta * kl + ema_beta * ema_kl
        seen["official_ratio"] = ratio.detach()
        return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    flags = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path, guidance=1.0, num_iterations=1, eval_every=0,
                       updates_per_iteration=2, train_timesteps=3, beta=beta, ema_beta=ema_beta,
                       learning_rate=lr, ema_every=1)
    run_in_process("awm.py", flags, monkeypatch, wrap={
        "start_run": start_run_spy, "sa_solver": keep("x0"), "combined_advantages": keep("advantages"),
        "micro_batches": keep("terms", many=True), "velocity": velocity_spy})

    assert len(seen["steps"]) == 2 and not (seen["official_ratio"] == 1).all()
    file, official = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in (seen["file_gradient"],
                                                                               seen["official_gradient"]))
    assert (file - official).norm() / official.norm() < 1e-5  # measured 1e-7; the ratio taken as 1: 2e-2
    run, m = read_metrics(tmp_path)
    # the logged ratio: 1 in the first mini-batch (12 terms), the official ratio in the second (12 terms)
    ratio = seen["official_ratio"]
    assert m[1]["train/ratio_mean"] == pytest.approx((12 + ratio.sum().item()) / 24, rel=1e-9, abs=0)
    assert m[1]["train/ratio_mean"] != 1 and m[1]["train/first_ratio_max_dev"] == 0.0
    plan = awm.planned_nfe(awm.Args(num_steps=4, group_size=4, prompts_per_iteration=2, train_timesteps=3,
                                    updates_per_iteration=2, beta=beta, ema_beta=ema_beta))
    assert plan["old"] == 3 * 4 / 2 and m[1]["perf/nfe_per_iteration"] - seen["nfe_here"] == 2 * sum(plan.values())
    # the eval EMA stepped once, after 2 steps: decay min((1 + 2) / (10 + 2), 0.99) = 0.25 from the initial weights
    state = torch.load(os.path.join(run, "checkpoints", "iter_1", "state.pt"), weights_only=True)
    for n, w in state["trainable"].items():
        torch.testing.assert_close(state["ema"][n], 0.25 * seen["steps"][0][n] + 0.75 * w)


@pytest.mark.parametrize("over,message", [
    ({"train_timesteps": 13}, r"--train-timesteps 13 is not allowed with --time-type discrete; use 1..12 \(one per "
                              r"trainable step\)"),
    ({"train_timesteps": 12, "time_type": "discrete_wo_init"},
     r"--train-timesteps 12 is not allowed with --time-type discrete_wo_init; use 1..11 \(one per trainable step\)"),
    ({"ghuber_power": 0.0}, "--ghuber-power 0.0 is not allowed; use a value in \\(0, 10\\]"),
    ({"kl_ema_decay": 1.5}, r"--kl-ema-decay 1.5 is not allowed; use a value in \[0, 1\]"),
    ({"ema_beta": -1.0}, "--ema-beta -1.0 is not allowed; use a value in \\[0, 1e6\\]"),
    ({"advantage_max": 0.0}, "--advantage-max 0.0 is not allowed; use a value in \\(0, 1e6\\]"),
    ({"train_timesteps": 0}, "--train-timesteps 0 is not allowed; use a value in \\[1, 1000\\]"),
    ({"timestep_fraction": 0.05}, "--timestep-fraction 0.05 trains no step of 14; raise it"),
    ({"updates_per_iteration": 49}, r"--updates-per-iteration 49 is not allowed; use 1..48 \(mini-batches per "
                                    r"iteration\)"),
])
def test_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(awm, **over)


def test_an_unknown_weighting_is_refused_on_the_command_line(tmp_path):
    proc = run_script("awm.py", ["--model", str(tmp_path / "none"), "--weighting", "l2"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--weighting" in proc.stderr


@pytest.mark.slow
def test_sharded_runs_resume_exactly_with_the_kl_ema(tiny, tmp_path):
    """FSDP2 full fine-tuning on 2 processes: the KL-EMA (DTensor shards) is saved in the DCP checkpoint and a resumed
    run's third iteration equals an uninterrupted run's."""
    flags = dict(full_finetune=True, no_ema=True, prompts_per_iteration=4, eval_every=0, train_timesteps=2,
                 learning_rate=1e-3)
    run_script("awm.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "full", num_iterations=3, **flags), nproc=2)
    part = crashed_copy(tmp_path / "full", tmp_path / "part", after=2)
    run_script("awm.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "part", num_iterations=3, resume=part,
                                    **flags), nproc=2)
    assert os.path.isdir(os.path.join(part, "checkpoints", "iter_3"))  # iteration 3 trained again
    _, a = read_metrics(tmp_path / "full")
    _, b = read_metrics(tmp_path / "part")
    assert a[3]["train/ema_kl"] > 0
    for k in [k for k in a[3] if not k.startswith("perf/") or "nfe" in k]:
        assert a[3][k] == pytest.approx(b[3][k], rel=1e-6, abs=1e-12), k
