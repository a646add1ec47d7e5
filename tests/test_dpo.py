"""dpo.py: its defaults against Flow-GRPO's config/dpo.py, its pairs against the official stat tracker, its noise levels
against the official scheduler, an update against the official loss written out (scripts/train_sd3_dpo.py), the
reference that samples and moves (OnlineDPO), NFE against planned_nfe, two processes and the argument checks."""
import os
import re

import pytest
import torch

import common
import dpo
from dpo import dpo_pairs, logit_normal_sigmas
from helpers import check_args, read_metrics, run_in_process, run_script, tiny_flags


def test_defaults_are_the_official_pickscore_sd3_config():
    """config/dpo.py pickscore_sd3 on config/base.py (8 GPUs x 24 images, one prompt each), train_sd3_dpo.py."""
    a = dpo.Args()
    assert (a.num_steps, a.eval_steps, a.guidance, a.resolution, a.group_size, a.prompts_per_iteration) == (
        40, 40, 4.5, 512, 24, 8)
    assert (a.noise_level, a.timestep_fraction, a.beta_dpo, a.ref_update_step, a.rollout_model) == (
        0.7, 0.99, 100.0, 10_000_000, "reference")
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm, a.lora_rank, a.lora_alpha, a.updates_per_iteration) == (
        3e-4, 1e-4, 1.0, 32, 64, 1)
    assert (a.ema, a.ema_decay, a.ema_every, a.eval_every, a.save_every, a.flow_shift) == (True, 0.9, 8, 60, 60, 3.0)
    assert a.rewards == ("pickscore",) and a.max_sequence_length == 128
    # per prompt: 24 x 40 rollout forwards, one pair of 2 images x int(40 x 0.99) = 39 terms, and the reference's
    assert dpo.planned_nfe(a) == {"rollout": 960, "train": 78, "reference": 78}


def official_pairs(rewards):
    """PerPromptStatTracker.update(type='dpo') (flow_grpo/stat_tracking.py:38-52) on one group, then the winner and
    the loser of train_sd3_dpo.py:756-823 (+1 first, -1 second)."""
    prompt_advantages = torch.tensor(rewards)
    max_idx, min_idx = torch.argmax(prompt_advantages), torch.argmin(prompt_advantages)
    if max_idx == min_idx:
        min_idx, max_idx = 0, 1
    result = torch.zeros_like(prompt_advantages).float()
    result[max_idx], result[min_idx] = 1.0, -1.0
    return int(torch.where(result == 1)[0]), int(torch.where(result == -1)[0])


def test_pairs_are_the_official_stat_trackers():
    """Each group's first maximum over its first minimum; a group of equal rewards pairs image 1 over image 0. The file
    ranks the group-normalised rewards (combined_advantages), a monotone map of the rewards within each group."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, 6, generator=g, dtype=torch.float64)
    rewards[:8] = rewards[:8].mul(4).round() / 4  # ties
    rewards[8:12] = 0.5  # flat groups
    advantages = dpo.combined_advantages({"r": rewards}, {"r": 1.0}, mode="rewards", eps=1e-4, global_std=True)
    for preference in (rewards, advantages):
        winner, loser = dpo_pairs(preference)
        assert [(int(w), int(lo)) for w, lo in zip(winner, loser)] == [official_pairs(r.tolist()) for r in rewards]


@pytest.mark.parametrize("shift", [3.0, 1.0])
def test_noise_levels_are_the_official_schedulers(shift):
    """train_sd3_dpo.py:882-894: u = sigmoid(N(0, 1)) (diffusers' compute_density_for_timestep_sampling, logit_normal),
    the training timestep scheduler.timesteps[int(1000 u)] of a fresh FlowMatchEulerDiscreteScheduler and its sigma
    (get_sigmas); the model sees sigma 1000 (the timestep) either way."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    sigmas = logit_normal_sigmas(4096, shift=shift, generator=torch.Generator().manual_seed(1))
    u = torch.sigmoid(torch.randn(4096, generator=torch.Generator().manual_seed(1)))
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    official = scheduler.sigmas[[(scheduler.timesteps == t).nonzero().item() for t in timesteps]]
    assert torch.equal(sigmas, official) and torch.equal(sigmas * 1000, timesteps)
    assert 0 < sigmas.min() and sigmas.max() <= 1 and abs(float(sigmas.median()) - shift * 0.5 / (1 + (shift - 1) * 0.5)) < 0.02


def test_an_update_is_the_official_loss_and_the_reference_samples_and_moves(tiny, tmp_path, monkeypatch):
    """Two iterations of two optimizer steps on a tiny SD3 (LoRA, CFG 4.5 in the rollout, --ref-update-step 2): the
    rollouts sample with the reference (train_sd3_dpo.py:619), the initial weights, then after 2 steps a copy of the
    policy (copy_learner_to_ref, :615-616); each group's pair is the official one; the winner and the loser share each
    term's noise and noise level (:876-895); each step's loss and the second's gradient (the policy moved away from the
    reference) are the official lines written out (:898-931: conditional forwards, the errors against noise - x0,
    -logsigmoid(-beta/2 (w_diff - l_diff)), a mean over the pairs and the step's terms)."""
    seen = {"steps": [], "forwards": [], "rollout_weights": [], "scores": [], "pairs": [], "x0": [], "official": []}
    beta_dpo, lr = 30.0, 0.05

    def velocities_spy(real):
        def spy(*a, **k):  # the weights the rollout samples with, once per iteration
            if len(seen["rollout_weights"]) == len(seen["scores"]):
                seen["rollout_weights"].append([p.detach().clone() for p in seen["run"].params.values()])
            return real(*a, **k)
        return spy

    def velocity_spy(real):
        def spy(transformer, kind, x, sigma, emb, *, guidance, **kw):
            if torch.is_grad_enabled():  # the policy's forwards: the terms a step trains on
                seen["forwards"].append((len(seen["steps"]), x.detach().clone(), sigma.clone(), emb, guidance))
            return real(transformer, kind, x, sigma, emb, guidance=guidance, **kw)
        return spy

    def keep(name):
        def wrap(real):
            def spy(*a, **k):
                out = real(*a, **k)
                seen[name].append(out if name != "x0" else a[1])
                return out
            return spy
        return wrap

    def sigmas_spy(real):
        def spy(n, *, shift, generator):
            out = real(n, shift=shift, generator=generator)
            if "noise" not in seen:  # the first iteration's noise: the generator's next draw (n_train, P, C, H, W)
                g = torch.Generator().set_state(generator.get_state())
                seen["noise"] = torch.randn(2, 2, *seen["x0"][0].shape[1:], generator=g)
            return out
        return spy

    def start_run_spy(real):
        def spy(*a, **k):
            run = seen["run"] = real(*a, **k)
            real_step = run.optimizer_step

            def optimizer_step(terms):
                seen["steps"].append({n: p.detach().clone() for n, p in run.params.items()})
                seen.setdefault("refs", []).append([r.clone() for r in run.copies["ref"]])
                u = len(seen["steps"]) - 1
                if u < 2:
                    loss, gradient = official(run, u)
                    seen["official"].append(loss)
                    if u == 1:
                        seen["file_gradient"] = {n: p.grad.clone() for n, p in run.params.items()}
                        seen["official_gradient"] = gradient
                return real_step(terms)
            run.optimizer_step = optimizer_step
            return run
        return spy

    def official(run, u):
        """Step u's official loss and its gradient at the weights now; the reference: its copy swapped in."""
        params, x0 = run.params, torch.cat(seen["x0"][:4])  # the first iteration's samples (4 chunks of 2)
        winner, loser = (torch.arange(2) * 4 + i for i in seen["pairs"][0])
        losses = []
        for _, x_t, sigma, emb, guidance in [f for f in seen["forwards"] if f[0] == u]:
            assert x_t.shape[0] == 2 and "neg_embeds" not in emb and guidance == 4.5  # one pair, conditional
            t = sigma.view(-1, 1, 1, 1)
            # the term's pair and noise: the file's draws after the noise levels (:876-878, the same for both)
            (model_input, noise), = [(x0[torch.stack([w, lo])], eps.expand(2, *eps.shape))
                                     for eps in seen["noise"].flatten(0, 1) for w, lo in zip(winner, loser)
                                     if torch.allclose(x_t, (1 - t) * x0[torch.stack([w, lo])] + t * eps, atol=1e-6)]
            assert sigma[0] == sigma[1]
            target = noise - model_input
            forward = lambda: common.velocity(run.pipe.transformer, "sd3", x_t, sigma, emb, guidance=4.5)  # noqa
            now = {name: p.detach().clone() for name, p in params.items()}
            with torch.no_grad():
                for p, r in zip(params.values(), run.copies["ref"]):
                    p.copy_(r)
                model_pred_ref = forward()
                for name, p in params.items():
                    p.copy_(now[name])
            model_pred = forward()
            theta_mse = ((model_pred.double() - target.double()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
            ref_mse = ((model_pred_ref.double() - target.double()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
            model_w_err, model_l_err, ref_w_err, ref_l_err = theta_mse[:1], theta_mse[1:], ref_mse[:1], ref_mse[1:]
            w_diff, l_diff = model_w_err - ref_w_err, model_l_err - ref_l_err
            inside_term = -0.5 * beta_dpo * (w_diff - l_diff)
            losses.append(torch.mean(-torch.nn.functional.logsigmoid(inside_term)))
        loss = sum(losses) / len(losses)  # accelerator.backward: / gradient_accumulation_steps
        return loss.item(), dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    flags = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path, guidance=4.5, eval_every=0, timestep_fraction=0.5,
                       updates_per_iteration=2, micro_batch=2, beta_dpo=beta_dpo, learning_rate=lr, ref_update_step=2)
    run_in_process("dpo.py", flags, monkeypatch, wrap={
        "start_run": start_run_spy, "velocities": velocities_spy, "velocity": velocity_spy, "score": keep("scores"),
        "dpo_pairs": keep("pairs"), "decode": keep("x0"), "logit_normal_sigmas": sigmas_spy})

    assert len(seen["steps"]) == 4 and len(seen["forwards"]) == 4 * 2  # 2 terms a step: int(4 x 0.5) per pair
    for scores, (winner, loser) in zip(seen["scores"], seen["pairs"]):  # the official pairs of the run's rewards
        assert [(int(w), int(lo)) for w, lo in zip(winner, loser)] == [
            official_pairs(r.tolist()) for r in scores["jpeg"].double().view(2, 4)]
    file, official_gradient = (torch.cat([g[n].flatten() for n in sorted(g)])
                               for g in (seen["file_gradient"], seen["official_gradient"]))
    assert (file - official_gradient).norm() / official_gradient.norm() < 1e-5  # measured 0: the same float32 forwards
    run, m = read_metrics(tmp_path)
    assert m[1]["train/policy_loss"] == pytest.approx(sum(seen["official"]) / 2, rel=1e-10)
    assert m[1]["train/policy_loss"] != pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-6)  # it moved
    # the rollouts: the initial weights (the reference), then the reference copied from the policy after 2 steps
    initial, after_two = [p for p in seen["steps"][0].values()], [p for p in seen["refs"][2]]
    assert all(torch.equal(a, b) for a, b in zip(seen["rollout_weights"][0], initial))
    assert all(torch.equal(a, b) for a, b in zip(seen["refs"][1], initial))  # the reference froze for 2 steps
    assert all(torch.equal(a, b) for a, b in zip(seen["rollout_weights"][1], after_two))
    assert not all(torch.equal(a, b) for a, b in zip(after_two, initial))
    assert m[1]["train/kept_fraction"] == m[2]["train/kept_fraction"] == 2 / 4


@pytest.mark.parametrize("kind,rollout", [("flux", "reference"), ("sd3", "policy")])
def test_planned_nfe_is_measured_and_the_run_ends_with_its_summary(tiny, tmp_path, kind, rollout):
    out = run_script("dpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, timestep_fraction=0.75,
                                          rollout_model=rollout)).stdout
    run, m = read_metrics(tmp_path)
    assert "iteration 0 -> 2, change +- paired standard error" in out and "training reward" in out
    plan = dpo.planned_nfe(dpo.Args(num_steps=4, group_size=4, timestep_fraction=0.75))
    assert plan == {"rollout": 16, "train": 6, "reference": 6}
    for it in (1, 2):
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == plan["rollout"]
        assert m[it]["perf/nfe_per_iteration"] == 2 * sum(plan.values())  # 2 prompts
        assert 0 <= m[it]["train/implicit_acc"] <= 1 and m[it]["train/updates"] == 1
    state = torch.load(os.path.join(run, "checkpoints", "iter_2", "state.pt"), weights_only=True)
    assert state["extra"]["ref"].keys() == state["trainable"].keys()  # the reference is saved with the run
    assert any(not torch.equal(state["extra"]["ref"][k], state["trainable"][k]) for k in state["trainable"]
               if "lora_B" in k)  # the policy moved, the reference did not


@pytest.mark.slow
def test_torchrun_two_processes(tiny, tmp_path):
    """2 processes, FSDP2 full fine-tuning (the reference that samples and moves: swapped-in shards): every rank
    trains its own prompts' pairs, the NFE is planned_nfe's, a checkpoint (the loss on 1 and 2 processes, LoRA and
    FSDP2: tests/test_memory.py, tests/dist_grad.py)."""
    run_script("dpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, prompts_per_iteration=4,
                                    timestep_fraction=0.5, ref_update_step=1, full_finetune=True, no_ema=True,
                                    learning_rate=1e-3), nproc=2)
    run, m = read_metrics(tmp_path)
    plan = dpo.planned_nfe(dpo.Args(num_steps=4, group_size=4, timestep_fraction=0.5))
    for it in (1, 2):
        assert m[it]["perf/nfe_per_iteration"] == 4 * sum(plan.values()) and m[it]["train/updates"] == 1
    state = os.path.join(run, "checkpoints", "iter_2")
    assert os.path.isdir(state)


@pytest.mark.parametrize("over,message", [
    ({"beta_dpo": 0.0}, re.escape("--beta-dpo 0.0 is not allowed; use a value in (0, 1e5]")),
    ({"ref_update_step": 0}, re.escape("--ref-update-step 0 is not allowed; use a value in [1, 1e9]")),
    ({"flow_shift": 0.0}, re.escape("--flow-shift 0.0 is not allowed; use a value in [0.01, 100]")),
    ({"micro_batch": 1}, r"--micro-batch 1 is not allowed; use a value >= 2 \(a pair's two images\)"),
    ({"timestep_fraction": 0.01}, "--timestep-fraction 0.01 trains no step of 40; raise it"),
    ({"updates_per_iteration": 3}, r"--updates-per-iteration 3 is not allowed; use 1..2 \(mini-batches per "
                                   r"iteration\)"),  # 8 pairs, 6 a forward
])
def test_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(dpo, **over)
