"""flow_dppo.py: its defaults against UniRL's SD3.5-M recipe, one update against the official loss written out
(UniRL unirl/algorithms/flowdppo.py on unirl/sde/kernels.py), its schedule and SDE steps, a toy iteration's NFE
against planned_nfe, and its argument checks."""
import dataclasses
import math
import os

import numpy as np
import pytest
import torch

import common
import flow_dppo
from helpers import check_args, read_metrics, run_in_process, run_script, tiny_flags


def test_defaults_are_the_official_sd35_pickscore_recipe():
    """examples/diffusion/sd3_flowdppo.yaml (8 GPUs) and unirl/algorithms/flowdppo.py's defaults."""
    a = flow_dppo.Args()
    assert (a.model, a.resolution, a.num_steps, a.guidance, a.group_size, a.prompts_per_iteration) == (
        "sd3.5-medium", 512, 10, 1.0, 16, 48)  # recipe:33, 137-142, 20
    assert a.max_sequence_length == 256  # SD3TextEmbedStage (unirl/models/sd3/text_embed.py:44)
    assert (a.noise_level, a.timestep_fraction, a.sde_steps, a.kl_threshold, a.beta) == (0.7, 0.5, 3, 1e-5, 0.0)
    assert (a.global_std, a.adv_eps, a.updates_per_iteration, a.micro_batch) == (True, 1e-8, 2, 8)
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm, a.lora_rank, a.lora_alpha, a.full_finetune) == (
        3e-4, 0.0, 1.0, 32, 64, False)  # recipe:63-89, 122
    assert a.rewards == ("pickscore",) and not a.ema  # recipe:96-106, 13-16
    assert flow_dppo.planned_nfe(a) == {"rollout": 16 * 10, "train": 16 * 3, "reference": 0}


def official_sde_indices(iteration, num_steps, fraction, sde_steps):
    """AllSDEScheduler.get_sde_indices (unirl/utils/scheduler_utils.py:98-124), timestep_fraction [0, fraction]."""
    pool = list(range(int(num_steps * 0.0), int(num_steps * fraction)))
    rng = np.random.default_rng(int(iteration))
    return sorted(set(int(i) for i in rng.choice(pool, size=sde_steps, replace=False)))


def official_sigmas(num_steps, shift):
    """get_sigma_schedule's static branch (unirl/sde/runtime.py:92-96)."""
    t = torch.linspace(1.0, 0.0, num_steps + 1)
    return (shift * t) / (1 + (shift - 1) * t)


def official_replay(v, x, x_next, sigma, sigma_next, eta, sigma_max):
    """FlowSDEStrategy.step + compute_log_prob (kernels.py:193-236) through StepStrategy.denoise and _finalize_logp
    (:60-99, 163-177) for a replayed transition: (log_prob [B], prev_sample_mean)."""
    v, x, x_next = v.float(), x.float(), x_next.float()
    sigma, sigma_next = sigma.float().view(1, 1, 1, 1), sigma_next.float().view(1, 1, 1, 1)
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = (x * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    std_var = std_dev_t * torch.sqrt(-dt)
    log_prob = (-((x_next.detach() - prev_sample_mean) ** 2) / (2 * std_var**2) - torch.log(std_var)
                - 0.5 * math.log(2 * math.pi))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean


def official_sigma_t(sigmas, steps, eta):
    """FlowDPPO._compute_sigma_t (flowdppo.py:342-368): [1, S', 1, 1, 1]."""
    idx = torch.tensor(steps, dtype=torch.long)
    s, s_next = sigmas[idx], sigmas[idx + 1]
    std_dev_t = torch.sqrt(s / (1.0 - torch.clamp(s, max=0.99))) * eta
    return (std_dev_t * torch.sqrt(-(s_next - s))).reshape(1, -1, 1, 1, 1)


def official_loss(new_logp, old_logp, new_means, old_means, advantages, sigma_t, tau):
    """_flowdppo_kl_adv_loss (flowdppo.py:54-138) reduced as compute_loss_and_backward does (:319): [B, S'] terms."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.detach()
    unclipped_loss = -adv * ratio
    kl_per_sample = ((new_means - old_means) ** 2 / (2 * sigma_t**2)).mean(dim=tuple(range(2, new_means.ndim)))
    kl_mask = kl_per_sample < tau
    rm_mask = ((~kl_mask) & (ratio > 1.0) & (adv > 0)) | ((~kl_mask) & (ratio < 1.0) & (adv < 0))
    loss = torch.where((~rm_mask).detach(), unclipped_loss, torch.zeros((), dtype=unclipped_loss.dtype)).mean()
    return loss, rm_mask, kl_per_sample


def test_update_is_the_official_one(tiny, tmp_path, monkeypatch):
    """One iteration of two optimizer steps on a tiny SD3 (LoRA, CFG 1 as the recipe): the file's SDE steps are
    AllSDEScheduler's, its schedule UniRL's static shift, and the second step's gradient (ratios away from 1, some
    terms masked, some not) and both steps' losses equal UniRL's written out here from the run's samples,
    advantages and mini-batches alone: the old log-probs and means replayed at the pre-update weights
    (prepare_segment, flowdppo.py:219-266), the loss a mean over the mini-batch's (sample, SDE step) terms."""
    seen = {"rollout": [], "terms": [], "steps": []}
    T, fraction, S, tau, lr, eta = 6, 0.5, 2, 1e-4, 0.5, 0.7

    def keep_rollout(real):
        def spy(transformer, kind, x, sigma, emb, *, rows, chunks, guidance):
            seen["rollout"].append(x.clone())
            seen["emb"], seen["rows"] = emb, rows
            return real(transformer, kind, x, sigma, emb, rows=rows, chunks=chunks, guidance=guidance)
        return spy

    def keep(name, many=False):
        def wrap(real):
            def spy(*a, **k):
                out = real(*a, **k)
                seen[name].append(out) if many else seen.__setitem__(name, out)
                return out
            return spy
        return wrap

    def keep_sigmas(real):  # the training schedule, as the file's sde_step receives it
        def spy(v, x, sigmas, i, noise_level, **k):
            seen["sigmas"] = sigmas
            return real(v, x, sigmas, i, noise_level, **k)
        return spy

    def start_run_spy(real):
        def spy(*a, **k):
            run = seen["run"] = real(*a, **k)
            real_step = run.optimizer_step

            def optimizer_step(terms):
                seen["steps"].append({n: p.detach().clone() for n, p in run.params.items()})
                u = len(seen["steps"]) - 1
                if u == 1:
                    seen["file_gradient"] = {n: p.grad.clone() for n, p in run.params.items()}
                nfe = common.NFE["count"]
                seen.setdefault("official", []).append(official(run, u, gradient=u == 1))
                common.NFE["count"] = nfe
                return real_step(terms)
            run.optimizer_step = optimizer_step
            return run
        return spy

    def official(run, u, gradient):
        x, params, sigmas = seen["rollout"], run.params, official_sigmas(T, 3.0)
        c = seen["terms"][u][0][1]  # one micro-batch of 4 samples a mini-batch
        assert all(torch.equal(c, c_k) for _, c_k, _ in seen["terms"][u])
        steps = sorted({j for j, _, _ in seen["terms"][u]})
        adv = seen["advantages"].reshape(-1)[c].float().view(-1, 1).expand(-1, len(steps))  # [B, S'], not clipped
        emb = common.select(seen["emb"], seen["rows"][c])
        now = {n: p.detach().clone() for n, p in params.items()}

        def replay():  # the SDE steps' log-probs [B, S'] and means [B, S', C, H, W] at the weights now
            out = [official_replay(common.velocity(run.transformer, "sd3", x[j][c], sigmas[j], emb, guidance=1.0),
                                   x[j][c], x[j + 1][c], sigmas[j], sigmas[j + 1], eta, sigmas[1].float())
                   for j in steps]
            return torch.stack([lp for lp, _ in out], 1), torch.stack([m for _, m in out], 1)

        with torch.no_grad():  # prepare_segment: the anchor at the weights before the iteration's first step
            for n, p in params.items():
                p.copy_(seen["steps"][0][n])
            old_logp, old_means = replay()
            for n, p in params.items():
                p.copy_(now[n])
        with torch.set_grad_enabled(gradient):
            new_logp, new_means = replay()
            loss, masked, kl = official_loss(new_logp, old_logp, new_means, old_means, adv,
                                             official_sigma_t(sigmas, steps, eta), tau)
        if gradient:
            seen["official_gradient"] = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        return float(loss.detach()), masked, kl

    flags = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path, guidance=1.0, num_steps=T, timestep_fraction=fraction,
                       sde_steps=S, num_iterations=1, eval_every=0, updates_per_iteration=2, kl_threshold=tau,
                       learning_rate=lr, noise_level=eta)
    run_in_process("flow_dppo.py", flags, monkeypatch, wrap={
        "start_run": start_run_spy, "velocities": keep_rollout, "combined_advantages": keep("advantages"),
        "micro_batches": keep("terms", many=True), "sde_step": keep_sigmas})

    assert torch.equal(seen["sigmas"], official_sigmas(T, 3.0))  # not the pipeline's: SD3's shift is static
    steps = official_sde_indices(0, T, fraction, S)
    assert [sorted({j for j, _, _ in t}) for t in seen["terms"]] == [steps, steps] and len(seen["steps"]) == 2
    (loss0, masked0, kl0), (loss1, masked1, kl1) = seen["official"]
    assert not masked0.any() and kl0.abs().max() < 1e-12  # on-policy: KL 0, nothing masked
    assert masked1.any() and not masked1.all()  # after a step: some terms past tau moving with A, not all
    flat = lambda g: torch.cat([g[n].flatten() for n in sorted(g)])  # noqa: E731
    file, official_grad = flat(seen["file_gradient"]), flat(seen["official_gradient"])
    error = ((file - official_grad).norm() / official_grad.norm()).item()
    print(f"relative gradient error {error:.1e}; masked {masked1.float().mean():.2f}, KL {kl1.flatten().tolist()}")
    assert error < 1e-5
    _, m = read_metrics(tmp_path)
    assert m[1]["train/policy_loss"] == pytest.approx((loss0 + loss1) / 2, rel=1e-5, abs=1e-7)
    assert m[1]["train/masked_fraction"] == pytest.approx(masked1.float().mean().item() / 2)
    assert m[1]["train/kl_old"] == pytest.approx(kl1.mean().item() / 2, rel=1e-4)
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6


def test_one_toy_iteration_measures_the_planned_nfe(tmp_path):
    """--model toy (its TOY preset, 2 prompts in 2 mini-batches): the rollout and all transformer evaluations are
    planned_nfe's."""
    run_script("flow_dppo.py", ["--model", "toy", "--num-iterations", "1", "--prompts-per-iteration", "2",
                                "--micro-batch", "12",
                                "--eval-every", "0", "--save-every", "0", "--log-images-every", "0",
                                "--output-dir", str(tmp_path)])
    _, m = read_metrics(tmp_path)
    args = dataclasses.replace(flow_dppo.Args(), **flow_dppo.TOY)
    plan = flow_dppo.planned_nfe(args)
    assert plan["rollout"] == args.group_size * args.num_steps and plan["train"] == args.group_size * args.sde_steps
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] == plan["rollout"]
    busy = round(2 * (1 - m[1]["reward/zero_std_fraction"]))  # groups with a reward spread train
    assert m[1]["perf/nfe_per_iteration"] == 2 * plan["rollout"] + busy * (plan["train"] + plan["reference"])
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6 and m[1]["train/updates"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("full", [False, True], ids=["lora-ddp", "full-fsdp2"])
def test_torchrun_two_processes(tiny, tmp_path, full):
    """2 processes (DDP LoRA, FSDP2 full fine-tuning): on-policy first mini-batch, the KL to the rollout policy
    measured in the second, the planned NFE, a checkpoint."""
    extra = {"full_finetune": True, "no_ema": True, "learning_rate": 1e-3} if full else {}
    run_script("flow_dppo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, prompts_per_iteration=4,
                                          timestep_fraction=0.75, sde_steps=2, **extra), nproc=2)
    run, m = read_metrics(tmp_path)
    for it in (1, 2):
        assert m[it]["train/first_ratio_max_dev"] <= 1e-6 and m[it]["train/kl_old"] > 0
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == 4 * 4
    assert os.path.isdir(os.path.join(run, "checkpoints", "iter_2"))


@pytest.mark.parametrize("over,message", [
    ({"sde_steps": 6}, r"--sde-steps 6 is not allowed; use 1..5 \(int\(T \* timestep fraction\)\)"),
    ({"sde_steps": 0}, r"--sde-steps 0 is not allowed; use 1..5 \(int\(T \* timestep fraction\)\)"),
    ({"timestep_fraction": 0.05}, "--timestep-fraction 0.05 trains no step of 10; raise it"),
    ({"kl_threshold": -1e-5}, "--kl-threshold -1e-05 is not allowed; use a value in \\[0, 1e6\\]"),
    ({"kl_threshold": float("nan")}, "--kl-threshold nan is not allowed; use a value in \\[0, 1e6\\]"),
    ({"noise_level": 0.0}, r"--noise-level 0.0 is not allowed; use a value > 0"),
    ({"updates_per_iteration": 97}, r"--updates-per-iteration 97 is not allowed; use 1..96 \(mini-batches per "
                                    r"iteration\)"),
])
def test_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(flow_dppo, **over)


def test_help_documents_the_new_arguments():
    import re

    out = " ".join(re.sub("[│╭╮╰╯─]", " ", run_script("flow_dppo.py", ["--help"]).stdout).split())
    for flag, doc in [("--sde-steps", "drawn without replacement"), ("--kl-threshold", "KL to the rollout policy"),
                      ("--timestep-fraction", "SDE steps are drawn from")]:
        assert flag in out and doc in out, flag
    assert "--clip-range" not in out and "--credit" not in out and "--adv-clip" not in out
