"""dgpo.py: its rollout schedule and sampler against diffusers' DPMSolverMultistepScheduler, one update's gradient
against the official loss written out here, the EMA reference's law, the NFE against planned_nfe on tiny random Flux
and SD3 pipelines, and its argument checks."""
import os

import pytest
import torch

import common
import dgpo
from helpers import check_args, crashed_copy, read_metrics, run_in_process, run_script, tiny_flags
from test_math import M, S, exact_velocity

TINY = dict(trunc_steps=2, train_timesteps=2)  # 4 sampling steps in the tiny runs
PERTURB = 0.3  # how far the gradient test moves the EMA reference (its clip then detaches 6 of 8 errors)


@pytest.mark.parametrize("steps", [4, 10, 16, 40])
def test_the_rollout_is_diffusers_dpm_solver_on_sanas_flow_sigmas(steps):
    """train_sd3_dgpo.py:557-559 swaps in DPMSolverMultistepScheduler (Sana's: flow sigmas, flow prediction, as
    diffusers' Sana conversion makes it; flow_shift 3); the pipeline evaluates the model at the scheduler's int64
    timesteps and steps with scheduler.step (sd3_pipeline_with_logprob.py:142-202). Same grid, same latents."""
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
    scheduler.set_timesteps(steps)
    sigmas, model_sigmas = common.dpm_schedule(steps, shift=3.0)
    assert torch.equal(sigmas, scheduler.sigmas) and torch.equal(model_sigmas, scheduler.timesteps / 1000)
    assert scheduler.timesteps.dtype == torch.int64 and (model_sigmas < sigmas[:-1]).all()  # truncated
    x = torch.randn(512, 4, generator=torch.Generator().manual_seed(0))
    theirs = x.clone()
    for t in scheduler.timesteps:
        theirs = scheduler.step(exact_velocity(theirs, float(t) / 1000, M, S), t, theirs, return_dict=False)[0]
    calls = []
    ours = common.dpm_solver(lambda z, s: calls.append(s) or exact_velocity(z, float(s), M, S), x, sigmas, model_sigmas)
    assert (ours - theirs).abs().max() < 5e-6 and len(calls) == steps  # measured 2e-6
    assert abs(ours.mean() - M) < 0.01  # (its std reaches S slowly: 0.40 at 10 steps, 0.50 at 40, for 0.5)


def test_defaults_are_the_official_pickscore_config():
    """config/dgpo.py pickscore_sd3_4gpu (:140-180) on compressibility (:6-45) and config/base.py; LoRA r 64 / alpha 128
    (train:611-614), eval EMA 0.9 every 8 steps (train:627), the EMA reference's 0.3 (train:629, 1176)."""
    a = dgpo.Args()
    assert (a.num_steps, a.guidance, a.resolution, a.group_size, a.prompts_per_iteration) == (10, 4.5, 512, 24, 8)
    assert (a.flow_shift, a.train_timesteps, a.trunc_steps, a.beta_dpo, a.clip_range, a.beta) == (
        3.0, 4, 6, 10.0, 5e-2, 1e-3)
    assert (a.switch_ema_ref, a.ema_reference, a.global_std, a.adv_clip, a.adv_eps) == (200, False, True, 5.0, 1e-4)
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm, a.lora_rank, a.lora_alpha) == (3e-4, 1e-4, 1.0, 64, 128)
    assert (a.ema_decay, a.ema_every, a.eval_every, a.save_every, a.updates_per_iteration) == (0.9, 8, 60, 60, 1)
    # per image T + 3 M = 22 (the reference's and the EMA reference's forwards with the policy's)
    assert dgpo.planned_nfe(a) == {"rollout": 240, "train": 96, "reference": 96, "ema_ref": 96}
    assert dgpo.planned_nfe(dgpo.Args(ema_reference=True, beta=0.0))["reference"] == 0
    dgpo.check_args(a, world=1)
    dgpo.check_args(a, world=4)  # the official 4 GPUs: 2 groups each


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_planned_nfe_is_measured_and_the_run_ends_with_its_summary(tiny, tmp_path, kind):
    out = run_script("dgpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, **TINY)).stdout
    run, m = read_metrics(tmp_path)
    assert "iteration 0 -> 2, change +- paired standard error" in out and "training reward" in out
    plan = dgpo.planned_nfe(dgpo.Args(num_steps=4, group_size=4, **TINY))
    assert plan == {"rollout": 16, "train": 8, "reference": 8, "ema_ref": 8}
    for it in (1, 2):
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == plan["rollout"]
        assert m[it]["perf/nfe_per_iteration"] == 2 * sum(plan.values())  # 2 prompts
        assert m[it]["train/kept_fraction"] == 1.0 and 0 < m[it]["train/dpo_weight"] < 1
    assert m[1]["train/ratio_mean"] == 1.0 and m[1]["train/kl"] == 0.0  # the first step: all three models agree
    assert m[2]["train/kl"] > 0
    state = torch.load(os.path.join(run, "checkpoints", "iter_2", "state.pt"), weights_only=True)
    assert state["extra"]["ema_ref"].keys() == state["trainable"].keys()


def test_the_ema_reference_as_the_dpo_reference_needs_no_base_model(tiny, tmp_path):
    """--ema-reference --beta 0 (use_ema_ref, train:1122-1124): no reference forward (planned_nfe); the margin against
    the EMA reference is 0 while it equals the weights (d = 0 after the first step): every weight sigmoid(0)."""
    run_script("dgpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, ema_reference=True, beta=0.0,
                                     eval_every=0, **TINY))
    _, m = read_metrics(tmp_path)
    plan = dgpo.planned_nfe(dgpo.Args(num_steps=4, group_size=4, ema_reference=True, beta=0.0, **TINY))
    assert plan["reference"] == 0
    for it in (1, 2):
        assert m[it]["perf/nfe_per_iteration"] == 2 * sum(plan.values())
        assert m[it]["train/dpo_weight"] == 0.5 and m[it]["train/kl"] == 0.0


def test_an_update_is_the_official_loss_and_the_ema_reference_follows_its_law(tiny, tmp_path, monkeypatch):
    """Two iterations of two optimizer steps each on a tiny SD3 (LoRA, CFG 4.5 in the rollout): the fourth step's
    gradient equals the official loss's written out here (train_sd3_dgpo.py:1097-1167, compute_group_dgpo_loss_allreduce
    :162-193) at that step's weights, EMA reference (moved away by the test, so that the clip acts on some errors) and
    terms; the EMA reference is d ema_ref + (1 - d) w after step s, d = min(0.3, 0.001 (s - 1)) (train:1175-1177), and
    the second iteration rolls out with it (switch_ema_ref 1: 2 steps done, train:799-800); one noise per group and
    step (train:76-108), M distinct timesteps of the scheduler's first trunc_steps + 1 (train:1062-1064); the eval EMA
    every ema_every steps."""
    seen = {"terms": [], "policy_forwards": [], "steps": [], "rollout_weights": [], "scores": []}
    beta, beta_dpo, clip_range, lr = 0.1, 30.0, 0.05, 0.05

    def keep(name):  # records what a function of the file returns
        def wrap(real):
            def spy(*a, **k):
                out = real(*a, **k)
                seen[name].append(out)
                return out
            return spy
        return wrap

    def ema_update_spy(real):
        def spy(ema, *a, **k):  # the EMA reference's update (the eval EMA's is rundir's, not this namespace's)
            real(ema, *a, **k)
            seen.setdefault("ema_law", []).append([e.clone() for e in ema])
            if len(seen["ema_law"]) == 3:  # moved away from the weights, so that the fourth step's clip acts
                g = torch.Generator().manual_seed(0)
                for e in ema:
                    e.add_(PERTURB * torch.randn(e.shape, generator=g))
        return spy

    def rollout_spy(real):
        def spy(*a, **k):  # the weights the rollout samples with (the EMA reference swapped in, or the policy)
            seen["rollout_weights"].append({n: p.detach().clone() for n, p in seen["run"].params.items()})
            out = real(*a, **k)
            seen["x0"] = out
            return out
        return spy

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
                seen.setdefault("ema_refs", []).append([e.clone() for e in run.copies["ema_ref"]])
                if len(seen["steps"]) == 4:
                    seen["file_gradient"] = {n: p.grad.clone() for n, p in run.params.items()}
                    seen["official"] = official_gradient(run, 3)
                return real_step(terms)
            run.optimizer_step = optimizer_step
            return run
        return spy

    def official_gradient(run, u):
        """The gradient of the official loss, accumulated over the step's terms (grad_accum = batches x M, :537)."""
        pipe, x0, params = run.pipe, seen["x0"], run.params
        (c,) = {tuple(t[1].tolist()) for t in seen["terms"][u]}  # this step's micro-batch: one group of 4
        c = torch.tensor(c)
        r = seen["scores"][-1]["jpeg"].double()  # PerPromptStatTracker, global std (stat_tracking.py:25-31)
        adv = ((r.view(2, 4) - r.view(2, 4).mean(1, keepdim=True)) / (r.std(unbiased=False) + 1e-4)).view(-1)
        adv = adv.clamp(-5, 5)[c]  # train:1127-1131
        terms = [(x_t, t, emb) for step, x_t, t, emb in seen["policy_forwards"] if step == u]
        assert len(terms) == 2 and all("neg_embeds" not in emb for _, _, emb in terms)  # conditional (:312-320)
        loss, clipped = 0.0, []
        for x_t, t, emb in terms:
            forward = lambda: common.velocity(pipe.transformer, "sd3", x_t, t, emb, guidance=1.0).double()  # noqa
            target = (x_t - x0[c]).double() / t  # noise - x0 (:1106-1107)
            now = {n: p.detach().clone() for n, p in params.items()}
            with torch.no_grad():
                pipe.transformer.disable_adapters()  # the reference: LoRA off (:1111-1115)
                v_ref = forward()
                pipe.transformer.enable_adapters()
                for p, e in zip(params.values(), run.copies["ema_ref"]):  # ema_ref copied in (:1116-1119)
                    p.copy_(e)
                v_old = forward()
                for n, p in params.items():
                    p.copy_(now[n])
            v = forward()
            dsm = (target - v).square().reshape(4, -1).mean(dim=1)
            old_dsm = (target - v_old).square().reshape(4, -1).mean(dim=1)
            ratio = torch.exp(-dsm + old_dsm)
            should_clip = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
            clipped.append(should_clip)
            dsm = torch.where(should_clip, dsm.detach(), dsm)
            ref_dsm = (target - v_ref).square().reshape(4, -1).mean(dim=1)
            per_sample = adv * beta_dpo * (dsm.detach() - ref_dsm) / 4
            sums = torch.zeros(1, dtype=per_sample.dtype).scatter_add_(0, torch.zeros(4, dtype=torch.long), per_sample)
            dgpo_loss = (torch.sigmoid(sums)[torch.zeros(4, dtype=torch.long)].detach() * adv * dsm).mean()
            kl = (v - v_ref).square().reshape(4, -1).mean(dim=1).mean()
            loss = loss + (dgpo_loss + beta * kl) / len(terms)  # accelerator.backward: / grad_accum
        seen["clipped"] = torch.cat(clipped)
        return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    flags = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path, **TINY, updates_per_iteration=2, eval_every=0,
                       beta=beta, beta_dpo=beta_dpo, clip_range=clip_range, learning_rate=lr, switch_ema_ref=1,
                       ema_every=2)
    run_in_process("dgpo.py", flags, monkeypatch, wrap={
        "start_run": start_run_spy, "dpm_solver": rollout_spy, "score": keep("scores"),
        "micro_batches": keep("terms"), "velocity": velocity_spy, "ema_update": ema_update_spy})

    assert len(seen["steps"]) == 4 and 0 < seen["clipped"].sum() < len(seen["clipped"])  # the clip acts on some
    file, official = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in (seen["file_gradient"], seen["official"]))
    assert (file - official).norm() / official.norm() < 1e-5, (file - official).norm() / official.norm()
    # the terms: one noise per group and step, M = 2 distinct timesteps of the first trunc_steps + 1 = 3 (int / 1000)
    _, model_sigmas = common.dpm_schedule(4, shift=3.0)
    x0 = seen["x0"]
    for u in range(4):
        forwards = [(x_t, t) for step, x_t, t, _ in seen["policy_forwards"] if step == u]
        assert len({t for _, t in forwards}) == 2 and {t for _, t in forwards} <= set(model_sigmas[:3].tolist())
    for x_t, t in [(x_t, t) for step, x_t, t, _ in seen["policy_forwards"] if step == 3]:
        eps = (x_t - (1 - t) * x0[4:]) / t  # the second group's
        assert (eps - eps[:1]).abs().max() < 1e-4 and eps.std() > 0.5
    # the EMA reference: d = min(0.3, 0.001 (s - 1)) after step s; the rollouts: the policy, then (2 > 1 steps) it
    ema_ref = [e.clone() for e in seen["ema_refs"][0]]  # the initial weights
    for s in range(1, 4):  # (the third is perturbed afterwards)
        d = min(0.3, 0.001 * (s - 1))
        ema_ref = [d * e + (1 - d) * seen["steps"][s][n] for e, n in zip(ema_ref, seen["run"].params)]
        for e, got in zip(ema_ref, seen["ema_law"][s - 1]):
            torch.testing.assert_close(got, e, rtol=1e-6, atol=1e-7)
    names = list(seen["run"].params)
    assert all(torch.equal(seen["rollout_weights"][0][n], seen["steps"][0][n]) for n in names)
    assert all(torch.equal(seen["rollout_weights"][1][n], seen["ema_refs"][2][k]) for k, n in enumerate(names))
    assert not all(torch.equal(seen["rollout_weights"][1][n], seen["steps"][2][n]) for n in names)
    run, m = read_metrics(tmp_path)
    assert m[2]["train/clipfrac"] > 0 and m[2]["train/updates"] == 2
    # the eval EMA every 2 steps, after steps 1 and 3: decay min((1 + s) / (10 + s), 0.9)
    state = torch.load(os.path.join(run, "checkpoints", "iter_2", "state.pt"), weights_only=True)
    for n, now in state["trainable"].items():
        ema = 2 / 11 * seen["steps"][0][n] + 9 / 11 * seen["steps"][1][n]
        torch.testing.assert_close(state["ema"][n], 4 / 13 * ema + 9 / 13 * seen["steps"][3][n])


@pytest.mark.parametrize("over,message", [
    ({"trunc_steps": 10}, r"--trunc-steps 10 is not allowed; use 0..9 \(sampling steps\)"),
    ({"train_timesteps": 8}, r"--train-timesteps 8 is not allowed with --trunc-steps 6; use 1..7 \(distinct steps\)"),
    ({"micro_batch": 12}, r"--micro-batch 12 is not allowed; use a multiple of --group-size 24 \(a group's DPO margin "
                          r"needs its errors in one forward\)"),
    ({"beta_dpo": 0.0}, "--beta-dpo 0.0 is not allowed; use a value in \\(0, 1e5\\]"),
    ({"flow_shift": -1.0}, "--flow-shift -1.0 is not allowed; use a value in \\[0\\.01, 100\\]"),
    ({"trunc_steps": -1}, "--trunc-steps -1 is not allowed; use a value in \\[0, 1000\\]"),
    ({"switch_ema_ref": -2}, "--switch-ema-ref -2 is not allowed; use a value in \\[0, 1e9\\]"),
    ({"updates_per_iteration": 9}, r"--updates-per-iteration 9 is not allowed; use 1..8 \(mini-batches per "
                                   r"iteration\)"),
])
def test_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(dgpo, **over)


@pytest.mark.slow
def test_sharded_runs_resume_exactly_with_the_ema_reference(tiny, tmp_path):
    """FSDP2 full fine-tuning on 2 processes, the rollouts by the EMA reference from the second iteration on: the EMA
    reference (DTensor shards) is saved in the DCP checkpoint and a resumed run's third iteration equals an
    uninterrupted run's."""
    flags = dict(full_finetune=True, no_ema=True, prompts_per_iteration=4, eval_every=0, learning_rate=1e-3,
                 switch_ema_ref=0, **TINY)
    run_script("dgpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "full", num_iterations=3, **flags), nproc=2)
    part = crashed_copy(tmp_path / "full", tmp_path / "part", after=2)
    run_script("dgpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "part", num_iterations=3, resume=part,
                                     **flags), nproc=2)
    assert os.path.isdir(os.path.join(part, "checkpoints", "iter_3"))  # iteration 3 trained again
    _, a = read_metrics(tmp_path / "full")
    _, b = read_metrics(tmp_path / "part")
    assert a[3]["train/ratio_mean"] != 1 and a[3]["train/kl"] > 0
    for k in [k for k in a[3] if not k.startswith("perf/") or "nfe" in k]:
        assert a[3][k] == pytest.approx(b[3][k], rel=1e-6, abs=1e-12), k


@pytest.mark.slow
def test_lora_on_two_processes_trains_whole_groups_per_rank(tiny, tmp_path):
    """DDP LoRA on 2 processes: each rank trains its own whole groups, the NFE is planned_nfe over both ranks'
    prompts, the EMA reference is checkpointed."""
    run_script("dgpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, prompts_per_iteration=4, **TINY), nproc=2)
    run, m = read_metrics(tmp_path)
    plan = dgpo.planned_nfe(dgpo.Args(num_steps=4, group_size=4, **TINY))
    for it in (1, 2):
        assert m[it]["perf/nfe_per_iteration"] == 4 * sum(plan.values())
        assert 0 < m[it]["train/dpo_weight"] < 1 and m[it]["train/grad_norm"] > 0
    assert m[2]["train/kl"] > 0
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_2", "state.pt"))
