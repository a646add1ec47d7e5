"""crd.py: its defaults against Flow-Factory's CRD example, its decays, timesteps and centred loss against the official
expressions written out (Flow-Factory src/flow_factory/trainers/crd.py, utils/noise_schedule.py), an update against
the official loss, the snapshots' laws, NFE against planned_nfe, 1 process = 2 (LoRA and FSDP2), argument checks."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

import common
import crd
from crd import DECAYS, centred_reward_loss, snapshot_decay, stratified_steps
from helpers import check_args, read_metrics, run_in_process, run_script, tiny_flags

OFFICIAL_PRESETS = {  # crd.py:50-64
    0: (0, 0.0, 0.0, 0.0), 1: (0, 0.0, 0.001, 0.5), 2: (75, 0.0, 0.0075, 0.999), 3: (0, 1.0, 0.0, 1.0),
    4: (0, 0.0, 0.02, 0.99), 5: (0, 0.0, 0.01, 0.5), 6: (0, 0.0, 0.0075, 0.999), 'none': (0, 0.0, 0.0, 0.0),
    'slow': (0, 0.0, 0.001, 0.5), 'medium': (75, 0.0, 0.0075, 0.999), 'offline': (0, 1.0, 0.0, 1.0),
    'fast': (0, 0.0, 0.02, 0.99), 'moderate': (0, 0.0, 0.01, 0.5)}


def test_defaults_are_the_official_example():
    """examples/crd/lora/sd3_5/default.yaml (the paper's Table 3, OCR, 8 GPUs) on CRDTrainingArguments
    (hparams/training_args.py:811-935) and TrainingArguments."""
    a = crd.Args()
    assert (a.num_steps, a.eval_steps, a.guidance, a.resolution, a.group_size, a.prompts_per_iteration) == (
        10, 40, 1.0, 512, 24, 48)
    assert (a.crd_beta, a.crd_loss, a.weight_temp, a.adaptive_weights) == (1.0, "mse", -1.0, True)
    assert (a.old_decay, a.sampling_decay) == ("0-0.25-0.005-0.999", "75-0.0-0.0075-0.999")
    assert (a.beta, a.kl_cfg, a.reward_adaptive_kl, a.train_timesteps, a.timestep_fraction) == (0.1, 4.5, True, 20, 0.99)
    assert (a.adv_clip, a.adv_eps, a.global_std, a.updates_per_iteration) == (5.0, 0.0, True, 2)
    assert (a.learning_rate, a.weight_decay, a.max_grad_norm, a.lora_rank, a.lora_alpha) == (3e-4, 1e-4, 1.0, 32, 64)
    assert (a.ema_decay, a.ema_every, a.eval_every, a.save_every, a.max_sequence_length) == (0.995, 20, 20, 20, 256)
    assert a.rewards == ("ocr",) and a.prompts == "data/ocr/train.txt"
    assert crd.planned_nfe(a) == {"rollout": 240, "train": 480, "old": 480, "reference": 480}


def official_decay(step, decay_type):
    """compute_decay (crd.py:67-102)."""
    if isinstance(decay_type, str):
        try:
            decay_type = int(decay_type)
        except ValueError:
            pass
    if decay_type in OFFICIAL_PRESETS:
        start_step, start_value, slope, end_value = OFFICIAL_PRESETS[decay_type]
    else:
        parts = decay_type.split('-')
        start_step, start_value, slope, end_value = float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3])
        start_step = int(start_step)
    if step < start_step:
        return start_value
    return min(start_value + (step - start_step) * slope, end_value)


def test_decays_are_the_official_compute_decay():
    specs = [str(k) for k in OFFICIAL_PRESETS] + ["0-0.25-0.005-0.999", "75-0.0-0.0075-0.999", "10-0.5-0.01-0.9"]
    assert sorted(DECAYS) == sorted(str(k) for k in OFFICIAL_PRESETS)
    for spec in specs:
        assert [snapshot_decay(s, spec) for s in range(300)] == [official_decay(s, spec) for s in range(300)], spec
    assert snapshot_decay(2, "0-0.25-0.005-0.999") == 0.26 and snapshot_decay(100, "2") == pytest.approx(0.1875)


def official_discrete(num_train_timesteps, scheduler_timesteps, timestep_range, rand):
    """TimeSampler.discrete(include_init=True, force_init=False) with _stratified_sample (noise_schedule.py:185-259),
    its uniform draws given: the schedule indices of one micro-batch."""
    ts = scheduler_timesteps.float()
    t_min, t_max = 1000.0 * (1.0 - timestep_range), 1000.0 * (1.0 - 0.0)
    mask = (ts >= t_min - 1e-3) & (ts <= t_max + 1e-3)
    valid_indices = torch.where(mask)[0]
    min_idx, max_idx = int(valid_indices.min().item()), int(valid_indices.max().item())
    boundaries = torch.linspace(min_idx, max_idx, num_train_timesteps + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return (lower + (rand * (upper - lower)).long()).clamp(min=0, max=len(ts) - 1)


@pytest.mark.parametrize("steps,k,fraction", [(10, 20, 0.99), (10, 9, 0.99), (16, 8, 0.99), (10, 3, 0.5)])
def test_timesteps_are_the_official_discrete_sampler(steps, k, fraction):
    """SD3's 10-step schedule ends at sigma 0.0089 < 0.01: the last step is never trained; K strata over the rest."""
    sigmas = common.shifted_sigmas(steps, shift=3.0) if steps == 16 else torch.tensor(
        [1.0, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780, 0.0089, 0.0])
    ours = stratified_steps(sigmas, k, 50, fraction=fraction, generator=torch.Generator().manual_seed(0))
    rand = torch.rand(50, k, generator=torch.Generator().manual_seed(0))
    official = torch.stack([official_discrete(k, sigmas[:-1] * 1000, fraction, rand[n]) for n in range(50)])
    assert torch.equal(ours, official)
    assert int(ours.max()) < (9 if steps == 10 else steps)


def official_crd_loss(adv_cur, r_theta, crd_beta, crd_loss_type, weight_temp):
    """_compute_crd_loss (crd.py:522-629) on one centring set (the gathered rewards are the local ones)."""
    adv_cur_rank, r_theta_gathered, r_theta_local = adv_cur, r_theta, r_theta
    weight_temp = torch.inf if weight_temp < 0 else weight_temp
    if weight_temp == torch.inf:
        softmax_p = torch.softmax(adv_cur / weight_temp, dim=0)
        adv_cur_avg = (adv_cur * softmax_p).sum(dim=0, keepdim=True)
        r_theta_avg = (r_theta_gathered * softmax_p).sum(dim=0, keepdim=True)
        Rc = adv_cur_rank - adv_cur_avg
        R_theta_c = r_theta_local - r_theta_avg.detach()
        if crd_loss_type == 'bce':
            return F.binary_cross_entropy_with_logits(crd_beta * R_theta_c, torch.sigmoid(Rc.detach()), reduction='mean')
        return ((crd_beta * R_theta_c - Rc) ** 2).mean()
    if weight_temp == 0:
        adv_plus_mask = (adv_cur > 0.0)
        if adv_plus_mask.sum() == 0:
            softmax_p = torch.ones_like(adv_cur) / adv_cur.shape[0]
        else:
            softmax_p = torch.softmax(adv_cur.where(adv_plus_mask, torch.tensor(float('-inf'), dtype=adv_cur.dtype)), dim=0)
        adv_minus_mask = (adv_cur < 0.0)
        if adv_minus_mask.sum() == 0:
            softmax_p_minus = torch.ones_like(adv_cur) / adv_cur.shape[0]
        else:
            softmax_p_minus = torch.softmax(adv_cur.where(adv_minus_mask, torch.tensor(float('-inf'), dtype=adv_cur.dtype)),
                                            dim=0)
    else:
        softmax_p = torch.softmax(adv_cur / weight_temp, dim=0)
        softmax_p_minus = torch.softmax(-adv_cur / weight_temp, dim=0)
    adv_cur_avg = (adv_cur * softmax_p).sum(dim=0, keepdim=True)
    r_theta_avg = (r_theta_gathered * softmax_p).sum(dim=0, keepdim=True)
    Rc, R_theta_c = adv_cur_rank - adv_cur_avg, r_theta_local - r_theta_avg.detach()
    adv_cur_avg_minus = (adv_cur * softmax_p_minus).sum(dim=0, keepdim=True)
    r_theta_avg_minus = (r_theta_gathered * softmax_p_minus).sum(dim=0, keepdim=True)
    Rc_minus, R_theta_c_minus = adv_cur_rank - adv_cur_avg_minus, r_theta_local - r_theta_avg_minus.detach()
    if crd_loss_type == 'bce':
        return 0.5 * F.binary_cross_entropy_with_logits(crd_beta * R_theta_c, torch.sigmoid(Rc.detach()), reduction='mean') \
            + 0.5 * F.binary_cross_entropy_with_logits(crd_beta * R_theta_c_minus, torch.sigmoid(Rc_minus.detach()),
                                                       reduction='mean')
    return 0.5 * ((crd_beta * R_theta_c - Rc) ** 2).mean() + 0.5 * ((crd_beta * R_theta_c_minus - Rc_minus) ** 2).mean()


@pytest.mark.parametrize("loss", ["mse", "bce"])
@pytest.mark.parametrize("temperature", [-1.0, 0.5, 0.0])
def test_centred_loss_and_gradient_are_the_official_expression(loss, temperature):
    """Three groups of 6 in one micro-batch, each centred on its own (a group is the official centring set), the mean
    of the per-sample losses and their gradient in the implicit rewards equal to 1e-12; a group whose rewards are all 0
    tests the hard selection's empty pool (uniform)."""
    g = torch.Generator().manual_seed(0)
    reward = torch.rand(18, generator=g, dtype=torch.float64)
    reward[12:] = 0.0
    r_theta = (0.3 * torch.randn(18, generator=g, dtype=torch.float64)).requires_grad_(True)
    group = torch.tensor([5, 2, 7]).repeat_interleave(6)  # any prompt indices
    ours = centred_reward_loss(r_theta, reward, group, beta=1.7, loss=loss, temperature=temperature).mean()
    (ours_grad,) = torch.autograd.grad(ours, r_theta)
    official = sum(official_crd_loss(reward[k:k + 6], r_theta[k:k + 6], 1.7, loss, temperature)
                   for k in range(0, 18, 6)) / 3
    (official_grad,) = torch.autograd.grad(official, r_theta)
    assert ours.item() == pytest.approx(official.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(ours_grad, official_grad, rtol=1e-12, atol=1e-15)
    assert official_grad.abs().sum() > 0


def test_an_update_is_the_official_loss_and_the_snapshots_follow_their_laws(tiny, tmp_path, monkeypatch):
    """Two iterations on a tiny SD3 (LoRA, 2 prompts, one group a micro-batch, CFG 4.5 in the KL's reference, the old
    model's decay starting high): the rollouts sample with the sampling snapshot; the second iteration's loss, KL and
    gradient are the official lines written out (crd.py:730-824: the forward process, the implicit reward over the
    adaptive weights, the centring within the micro-batch's group, / crd_beta * adv_clip, the reward-adaptive KL to
    the guided reference) at its weights and snapshots; after each iteration old <- d old + (1 - d) w with d =
    compute_decay(steps) of each spec (crd.py:373-430)."""
    seen = {"steps": [], "forwards": [], "rollout_weights": [], "scores": [], "noise": [], "timesteps": [], "x0": []}
    old_spec, sampling_spec, beta, kl_cfg, lr = "0-0.3-0.1-0.9", "0-0.2-0.05-0.95", 0.2, 4.5, 0.05

    def velocities_spy(real):
        def spy(*a, **k):  # the weights the rollout samples with, once per iteration
            if len(seen["rollout_weights"]) == len(seen["scores"]):
                seen["rollout_weights"].append([p.detach().clone() for p in seen["run"].params.values()])
            return real(*a, **k)
        return spy

    def velocity_spy(real):
        def spy(transformer, kind, x, sigma, emb, *, guidance, **kw):
            if torch.is_grad_enabled():
                seen["forwards"].append((len(seen["steps"]), x.detach().clone(), sigma.clone(), emb, guidance))
            return real(transformer, kind, x, sigma, emb, guidance=guidance, **kw)
        return spy

    def timesteps_spy(real):
        def spy(sigmas, k, n, *, fraction, generator):
            out = real(sigmas, k, n, fraction=fraction, generator=generator)
            g = torch.Generator().set_state(generator.get_state())  # the loop's next draws: each step's noise
            seen["noise"].append([torch.randn(8, *seen["x0"][-1].shape[1:], generator=g) for _ in range(k)])
            seen["timesteps"].append(out)
            return out
        return spy

    def keep(name):
        def wrap(real):
            def spy(*a, **k):
                out = real(*a, **k)
                seen[name].append(out if name != "x0" else a[1])
                return out
            return spy
        return wrap

    def start_run_spy(real):
        def spy(*a, **k):
            run = seen["run"] = real(*a, **k)
            real_step = run.optimizer_step

            def optimizer_step(terms):
                seen["steps"].append({n: p.detach().clone() for n, p in run.params.items()})
                seen.setdefault("old", []).append([c.clone() for c in run.copies["old"]])
                seen.setdefault("sampling", []).append([c.clone() for c in run.copies["sampling"]])
                if len(seen["steps"]) == 2:
                    seen["file_gradient"] = {n: p.grad.clone() for n, p in run.params.items()}
                    seen["official"] = official(run, 1)
                return real_step(terms)
            run.optimizer_step = optimizer_step
            return run
        return spy

    def official(run, u):
        params, transformer = run.params, run.pipe.transformer
        x0 = torch.cat(seen["x0"][2 * u:2 * u + 2])  # this iteration's samples (2 chunks of a group)
        r = seen["scores"][u]["jpeg"].double().view(2, 4)
        adv = ((r - r.mean(1, keepdim=True)) / r.std(unbiased=False)).view(-1)  # global std, max(std, 1e-6)
        adv_cur_rank = torch.clamp(torch.clamp(adv, -5.0, 5.0) / 5.0 / 2.0 + 0.5, 0, 1)  # crd.py:785-791
        now = {n: p.detach().clone() for n, p in params.items()}

        def forward(x_t, sigma, emb, weights=None, guidance=1.0):
            with torch.set_grad_enabled(weights is None):
                if weights is not None:
                    for p, w in zip(params.values(), weights):
                        p.data.copy_(w)
                out = common.velocity(transformer, "sd3", x_t, sigma, emb, guidance=guidance)
                for n, p in params.items():
                    p.data.copy_(now[n])
                return out

        loss = 0.0
        terms = [f for f in seen["forwards"] if f[0] == u]
        for k, (_, x_t, sigma, emb, guidance) in enumerate(terms):
            b, t_idx = k % 2, k // 2  # the terms are step-major: (step j, micro-batch b)
            rows = slice(4 * b, 4 * b + 4)
            noise = seen["noise"][u][t_idx][rows]
            sigma_broadcast = sigma.view(-1, 1, 1, 1)
            assert torch.equal(x_t, (1 - sigma_broadcast) * x0[rows] + sigma_broadcast * noise)
            v_target = noise - x0[rows]
            old_v_pred = forward(x_t, sigma, emb, weights=seen["old"][u])
            with torch.no_grad():
                transformer.disable_adapters()
                ref_pred = common.velocity(transformer, "sd3", x_t, sigma, emb, guidance=kl_cfg)
                transformer.enable_adapters()
            forward_pred = forward(x_t, sigma, emb)
            weight_theta = (torch.abs(forward_pred.double() - v_target.double())
                            .mean(dim=tuple(range(1, forward_pred.ndim)), keepdim=True).clip(min=1e-5)).detach()
            weight_old = (torch.abs(old_v_pred.double() - v_target.double())
                          .mean(dim=tuple(range(1, old_v_pred.ndim)), keepdim=True).clip(min=1e-5))
            r_theta = -((forward_pred - v_target) ** 2 / weight_theta - (old_v_pred - v_target) ** 2 / weight_old)
            r_theta_local = r_theta.mean(dim=tuple(range(1, r_theta.ndim)))
            ori_policy_loss = official_crd_loss(adv_cur_rank[rows], r_theta_local, 1.0, "mse", -1.0)
            policy_loss = (ori_policy_loss * 5.0 / max(1.0, 1e-8)).mean()
            kl_div = ((forward_pred - ref_pred) ** 2).mean(dim=tuple(range(1, forward_pred.ndim)))
            min_coef = 1e-4 / max(beta, 1e-8)
            kl_loss = beta * torch.mean((min_coef + adv_cur_rank[rows] * (1 - min_coef)) * kl_div)
            loss = loss + (policy_loss + kl_loss) / len(terms)  # accelerator.backward: / accumulation steps
            seen.setdefault("official_terms", []).append((policy_loss.item(), kl_div.mean().item()))
        return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    flags = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path, eval_every=0, guidance=1.0, kl_cfg=kl_cfg, beta=beta,
                       train_timesteps=2, old_decay=old_spec, sampling_decay=sampling_spec, learning_rate=lr,
                       updates_per_iteration=1, ema_every=1, max_sequence_length=16)
    run_in_process("crd.py", flags, monkeypatch, wrap={
        "start_run": start_run_spy, "velocities": velocities_spy, "velocity": velocity_spy, "score": keep("scores"),
        "decode": keep("x0"), "stratified_steps": timesteps_spy})

    a, b = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in (seen["file_gradient"], seen["official"]))
    assert (a - b).norm() / b.norm() < 1e-5  # measured 3e-7
    run, m = read_metrics(tmp_path)
    policy, kl = zip(*seen["official_terms"])
    assert m[2]["train/policy_loss"] == pytest.approx(sum(policy) / len(policy), rel=1e-6)
    assert m[2]["train/kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-6) and m[2]["train/kl"] > 0
    # the snapshots after iteration 1 (1 step): d = compute_decay(1, spec); the second rollout samples the new one
    w0, w1 = ([p for p in seen["steps"][0].values()], [p for p in run_state(run, 1)["trainable"].values()])
    for name, spec, copies in (("old", old_spec, seen["old"]), ("sampling", sampling_spec, seen["sampling"])):
        d = official_decay(1, spec)
        for init, now, after in zip(w0, w1, copies[1]):
            torch.testing.assert_close(after, d * init + (1 - d) * now, rtol=1e-6, atol=1e-7)
        assert m[1][f"train/{name}_decay"] == d and m[2][f"train/{name}_decay"] == official_decay(2, spec)
    assert all(torch.equal(a, b) for a, b in zip(seen["rollout_weights"][0], w0))
    assert all(torch.equal(a, b) for a, b in zip(seen["rollout_weights"][1], seen["sampling"][1]))
    state = run_state(run, 2)["extra"]
    assert state["old"].keys() == state["sampling"].keys() == run_state(run, 2)["trainable"].keys()


def run_state(run, iteration):
    return torch.load(os.path.join(run, "checkpoints", f"iter_{iteration}", "state.pt"), weights_only=True)


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_planned_nfe_is_measured_and_the_run_ends_with_its_summary(tiny, tmp_path, kind):
    out = run_script("crd.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, train_timesteps=3,
                                          updates_per_iteration=1, ema_every=1, max_sequence_length=16)).stdout
    _, m = read_metrics(tmp_path)
    assert "iteration 0 -> 2, change +- paired standard error" in out and "training reward" in out
    plan = crd.planned_nfe(crd.Args(num_steps=4, group_size=4, train_timesteps=3))
    assert plan == {"rollout": 16, "train": 12, "old": 12, "reference": 12}
    for it in (1, 2):
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == plan["rollout"]
        assert m[it]["perf/nfe_per_iteration"] == 2 * sum(plan.values())  # 2 prompts
        assert m[it]["train/kept_fraction"] == 1.0 and m[it]["train/updates"] == 1
    assert m[1]["train/old_decay"] == 0.255 and m[1]["train/sampling_decay"] == 0.0  # the defaults after 1 step


@pytest.mark.slow
def test_one_and_two_processes_take_the_same_steps(tiny, tmp_path):
    """Every rank draws every rank's prompts, noise and timesteps, and a group is centred on its rank, so 1 process and
    2 (FSDP2 sharding, the snapshots swapped-in shards) end two iterations with the same weights (the loss on 1 and 2
    processes, LoRA too: tests/test_memory.py; a resume restores the snapshots: tests/test_resume.py)."""
    from test_diffusion_nft import exported

    flags = dict(prompts_per_iteration=2, eval_every=0, num_iterations=2, train_timesteps=2, updates_per_iteration=1,
                 ema_every=1, max_sequence_length=16, full_finetune=True, no_ema=True)
    runs = []
    for nproc in (1, 2):
        run_script("crd.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / f"n{nproc}", **flags), nproc=nproc)
        runs.append(read_metrics(tmp_path / f"n{nproc}"))
    (one, m1), (two, m2) = runs
    assert m2[2]["train/updates"] == 1 and m2[2]["perf/nfe_per_iteration"] == 2 * 4 * (4 + 3 * 2)
    for key in ("reward/jpeg_mean", "train/policy_loss", "train/kl", "train/implicit_reward", "train/grad_norm"):
        assert m1[2][key] == pytest.approx(m2[2][key], rel=1e-4, abs=1e-8), key
    a, b = exported(one, 2), exported(two, 2)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("over,message", [
    ({"old_decay": "fastest"}, "--old-decay 'fastest' is not allowed; use start-value-slope-end"),
    ({"sampling_decay": "1-2-3"}, "--sampling-decay '1-2-3' is not allowed; use start-value-slope-end"),
    ({"old_decay": "0-nan-0-1"}, "--old-decay '0-nan-0-1' is not allowed"),
    ({"micro_batch": 12}, r"--micro-batch 12 is not allowed; use a multiple of --group-size 24 \(a group is centred "
                          r"within one forward\)"),
    ({"crd_beta": 0.0}, re.escape("--crd-beta 0.0 is not allowed; use a value in (0, 1e6]")),
    ({"weight_temp": -2.0}, re.escape("--weight-temp -2.0 is not allowed; use a value in [-1, 1e6]")),
    ({"kl_cfg": -1.0}, re.escape("--kl-cfg -1.0 is not allowed; use a value in [0, 100]")),
    ({"train_timesteps": 0}, re.escape("--train-timesteps 0 is not allowed; use a value in [1, 1000]")),
    ({"updates_per_iteration": 49}, r"--updates-per-iteration 49 is not allowed; use 1..48 \(mini-batches per "
                                    r"iteration\)"),
])
def test_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(crd, **{"rewards": ("jpeg",), **over})  # (the default OCR reward needs requirements-ocr.txt)
