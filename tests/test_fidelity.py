"""Fidelity to the official code: schedules, the rewarded image, KL scale, LoRA targets, prompt length, EMA warm-up,
timestep precision, G2RPO optimizer steps, DenseGRPO calibration and completion lengths, reward preprocessing."""
import json
import math
import os

import pytest
import torch

import models

import common
import densegrpo
import flow_grpo
from common import ema_update, make_trainable, pipeline_sigmas, shifted_sigmas, velocity
from densegrpo import spaced_indices
from g2rpo import strided_indices
from helpers import read_metrics, run_in_process, run_script, tiny_flags
from tiny import build_flux, build_sd3

SD3_T10 = [1.0, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780, 0.0089, 0.0]  # diffusers, shift 3
FLUX_512_T6 = [1.0, 0.9037, 0.7897, 0.6525, 0.4842, 0.2730, 0.0]  # FLUX.1-dev's config, mu = calculate_shift(1024)


def test_pipeline_schedules():
    sd3 = pipeline_sigmas(build_sd3(), "sd3", num_steps=10, shape=(16, 64, 64))
    torch.testing.assert_close(sd3, torch.tensor(SD3_T10), atol=1e-4, rtol=0)
    flux = build_flux(dynamic_shifting=True)
    torch.testing.assert_close(pipeline_sigmas(flux, "flux", num_steps=6, shape=(16, 64, 64)),
                               torch.tensor(FLUX_512_T6), atol=1e-4, rtol=0)
    assert pipeline_sigmas(flux, "flux", num_steps=6, shape=(16, 128, 128))[5] > FLUX_512_T6[5]  # more tokens, more shift
    # a static shift 3 scheduler (the toy's) gives DanceGRPO's shifted linspace exactly
    toy = build_flux(shift=3.0)
    assert torch.equal(pipeline_sigmas(toy, "flux", num_steps=16, shape=(16, 16, 16)), shifted_sigmas(16, shift=3.0))
    # the documented noise of an untrained, stochastic last step: a sqrt(sigma / (1 - sigma)) sqrt(sigma), a = 0.7 / 0.9
    last_std = lambda s, a: a * math.sqrt(s / (1 - s)) * math.sqrt(s)  # noqa: E731
    assert last_std(SD3_T10[9], 0.7) == pytest.approx(0.0063, abs=2e-4)
    assert last_std(float(shifted_sigmas(10, shift=3.0)[9]), 0.7) == pytest.approx(0.202, abs=1e-3)
    assert last_std(float(shifted_sigmas(16, shift=3.0)[15]), 0.7) == pytest.approx(0.128, abs=1e-3)
    assert last_std(FLUX_512_T6[5], 0.9) == pytest.approx(0.288, abs=1e-3)


def sampling_steps(script, args, monkeypatch):
    """Run an algorithm file's main block here, recording every sampling step of its own sde_step (i, noise level,
    sigmas, x, v, x_next, the step's std)."""
    calls = []

    def wrap(real):
        def spy(v, x, sigmas, i, noise_level, *, prev_sample=None, generator=None):
            out = real(v, x, sigmas, i, noise_level, prev_sample=prev_sample, generator=generator)
            if prev_sample is None:
                calls.append((i, noise_level, sigmas.clone(), x.float(), v.float(), out[0], out[3]))
            return out
        return spy

    run_in_process(script, args, monkeypatch, wrap={"sde_step": wrap})
    return calls


def levels(calls):
    """The noise level of each sampling step, checked to be the same for every micro-batch."""
    out = {}
    for i, level, *_ in calls:
        assert out.setdefault(i, level) == level
    return [out[i] for i in sorted(out)]


@pytest.mark.parametrize("script", ["flow_grpo.py", "densegrpo.py"])
def test_untrained_last_step_is_deterministic(tiny, tmp_path, monkeypatch, script):
    """The rewarded (decoded) latent carries no untrained noise: the last step is x - sigma v unless it is trained."""
    base = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path / "a", num_iterations=1, eval_every=0, guidance=4.5,
                      num_steps=5, noise_level=0.7)
    calls = sampling_steps(script, base, monkeypatch)
    assert levels(calls) == [0.7] * 4 + [0.0]  # T = 5: int(0.99 * 5) = 4 trained steps, the 5th is not
    for i, _, sigmas, x, v, x_next, _ in calls[-2:]:  # two micro-batches of 4
        assert i == 4 and float(sigmas[5]) == 0
        torch.testing.assert_close(x_next, x - float(sigmas[4]) * v)
    # Flow-GRPO and DenseGRPO sample with the pipeline's own schedule (SD3: diffusers' set_timesteps)
    torch.testing.assert_close(sigmas, pipeline_sigmas(build_sd3(), "sd3", num_steps=5, shape=(16, 2, 2)))
    assert not torch.equal(sigmas, shifted_sigmas(5, shift=3.0))
    # a trained last step keeps its noise
    calls = sampling_steps(script, tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path / "b", num_iterations=1,
                                              eval_every=0, guidance=4.5, num_steps=5, timestep_fraction=1.0),
                           monkeypatch)
    assert levels(calls) == [0.7] * 5


def test_dancegrpo_samples_its_schedule_and_decodes_x0_hat(tiny, tmp_path, monkeypatch):
    """DanceGRPO: the shifted schedule, its constant-eta SDE at every step but the last, which is x - sigma v."""
    flags = tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_iterations=1, eval_every=0, num_steps=6,
                       no_full_finetune=True, updates_per_iteration=1)
    calls = sampling_steps("dancegrpo.py", flags, monkeypatch)
    assert levels(calls) == [0.3] * 5 + [0.0]
    for i, _, sigmas, *_, std in calls[:-2]:  # DanceGRPO's constant eta: std = eta sqrt(-dt)
        assert std == pytest.approx(0.3 * math.sqrt(float(sigmas[i] - sigmas[i + 1])), rel=1e-6)
    assert torch.equal(calls[0][2], shifted_sigmas(6, shift=3.0))
    for i, _, sigmas, x, v, x_next, _ in calls[-2:]:
        assert i == 5 and float(sigmas[6]) == 0
        torch.testing.assert_close(x_next, x - float(sigmas[5]) * v)


def test_kl_scales_against_hand_computation():
    """The reference step mean is flow_grpo.sde_step's, as a hand computation: std_dev_t = a sqrt(sigma / (1 -
    sigma)) and mu = x + (v + std_dev_t^2 / (2 sigma) (x + (1 - sigma) v)) dt."""
    ref = build_flux().transformer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g)
    emb = {"embeds": torch.randn(2, 16, 32, generator=g), "pooled": torch.randn(2, 32, generator=g)}
    sigmas, i, a = shifted_sigmas(10, shift=3.0), 3, 0.7
    sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
    with torch.no_grad():
        v_ref = velocity(ref, "flux", x, sigmas[i], emb, guidance=3.5).float()
    std_dev_t = a * math.sqrt(sigma / (1 - sigma))
    mu_ref = x + (v_ref + std_dev_t**2 / (2 * sigma) * (x + (1 - sigma) * v_ref)) * dt
    _, _, mean, std = flow_grpo.sde_step(v_ref, x, sigmas, i, a, prev_sample=x)
    torch.testing.assert_close(mean, mu_ref, rtol=1e-6, atol=1e-6)
    assert std == pytest.approx(std_dev_t * math.sqrt(-dt))
    assert 4 < 1 / abs(dt) < 28  # at T = 10 the exact form is 4x to 28x the official one


def test_the_files_kl_forms_differ_by_one_over_dt(tiny, tmp_path):
    """flow_grpo.py's own KL lines: with one trained step, the second mini-batch's KL (the first is 0: LoRA B
    starts at 0, so the policy is the reference) in --kl-form exact is the official one divided by |dt|."""
    metrics = {}
    for form in ("official", "exact"):
        out = tmp_path / form
        run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], out, num_iterations=1, eval_every=0,
                                              num_steps=4, timestep_fraction=0.25, beta=0.04, kl_form=form,
                                              updates_per_iteration=2, learning_rate=1e-2))
        metrics[form] = read_metrics(out)[1][1]
    sigmas = pipeline_sigmas(build_flux(dynamic_shifting=True), "flux", num_steps=4, shape=(16, 16, 16))
    step = float(sigmas[0] - sigmas[1])
    assert metrics["official"]["train/kl"] > 0
    assert metrics["exact"]["train/kl"] == pytest.approx(metrics["official"]["train/kl"] / step, rel=1e-4)


def adapted(transformer):
    return sorted({n.rsplit(".lora_A", 1)[0] for n, _ in transformer.named_parameters() if ".lora_A" in n})


def test_lora_targets_skip_sd35_second_attention():
    sd3 = build_sd3().transformer
    modules = dict(sd3.named_modules())
    make_trainable(sd3, "sd3", lora=(4, 8), reference=False)
    names = adapted(sd3)
    assert names == sorted(n for n in (f"transformer_blocks.0.{t}" for t in models.FAMILIES["sd3"]["lora_targets"](None)) if modules.get(n))
    assert len(names) >= 7 and "transformer_blocks.0.attn2.to_q" in modules and not any("attn2" in n for n in names)
    flux = build_flux().transformer
    make_trainable(flux, "flux", lora=(4, 8), reference=False)
    names = adapted(flux)
    assert "single_transformer_blocks.0.attn.to_q" in names and "transformer_blocks.0.ff_context.net.2" in names
    assert "single_transformer_blocks.0.proj_out" not in names


def test_prompt_length_defaults():
    assert flow_grpo.Args().max_sequence_length == densegrpo.Args().max_sequence_length == 128


def test_ema_warm_up():
    """Flow-GRPO's decay min((1 + s) / (10 + s), 0.9): after 7 optimizer steps 8/17, from s = 80 on 0.9."""
    for step, decay in [(7, 8 / 17), (79, 80 / 89), (80, 0.9), (200, 0.9), (0, 0.1)]:
        ema, params = [torch.zeros(3)], [torch.ones(3)]
        ema_update(ema, params, 0.9, step)
        torch.testing.assert_close(ema[0], torch.full((3,), 1 - decay))


def test_timestep_reaches_the_transformer_in_float32():
    transformer = build_sd3().transformer.to(torch.bfloat16)
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    emb = {"embeds": torch.randn(1, 8, 64), "pooled": torch.randn(1, 64)}
    velocity(transformer, "sd3", torch.randn(1, 4, 16, 16), torch.tensor(0.9601), emb, guidance=1.0)
    assert seen[0].dtype == torch.float32 and seen[0].item() == pytest.approx(960.1, abs=1e-3)
    assert torch.tensor(960.1).to(torch.bfloat16).item() == 960  # what a bf16 timestep would have been


@pytest.mark.slow
@pytest.mark.parametrize("updates,expected", [(3, 3), (1, 1)])
def test_g2rpo_optimizer_steps_per_k(tiny, tmp_path, updates, expected):
    run_script("g2rpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_steps=6, sde_steps="0 1 4",
                                      lambdas="1 2", no_full_finetune=True, learning_rate=1e-2, num_iterations=1,
                                      eval_every=0, updates_per_iteration=updates))
    _, m = read_metrics(tmp_path)
    assert m[1]["train/updates"] == expected and m[1]["train/first_ratio_max_dev"] <= 1e-6
    if expected == 1:
        assert m[1]["train/ratio_mean"] == pytest.approx(1, abs=1e-6)
    else:  # later k are trained after the first steps: their ratio moved (the official per-k behaviour)
        assert abs(m[1]["train/ratio_mean"] - 1) > 1e-6


def test_calibration_seeks_balance_per_group():
    """Balanced outcomes at a step raise psi there, one-sided ones lower it; the pooled rule lowers psi whenever the
    pooled count is off by sqrt(N), as it almost always is for N = 480 random signs."""
    g = torch.Generator().manual_seed(0)
    P, G = 40, 12
    balanced = torch.randn(P * G, generator=g)  # random signs: balanced in expectation
    one_sided = balanced.abs() + 0.1
    mixed = torch.where(torch.arange(P * G) % G < 9, 1.0, -1.0)  # 9 of 12 up in every group
    delta = torch.stack([balanced, one_sided, -one_sided, mixed, torch.zeros(P * G)], 1)
    psi, active = [0.7] * 5, [True] * 4 + [False]  # the last step is taken without noise: left alone
    group = densegrpo.calibrate_step(psi, delta, eps1=2, eps2=0.01, psi_range=(0.1, 1.5), groups=P, active=active)
    assert group == pytest.approx([0.71, 0.69, 0.69, 0.69, 0.7])
    pooled = densegrpo.calibrate_step(psi, delta, eps1=2, eps2=0.01, psi_range=(0.1, 1.5), groups=1, active=active)
    pooled_balance = abs(int((balanced > 0).sum() - (balanced < 0).sum()))
    assert pooled_balance >= 2 and pooled == pytest.approx([0.69, 0.69, 0.69, 0.69, 0.7])
    # the group rule is the pooled count over the number of groups: a pooled rule whose eps1 grows with the prompts
    assert densegrpo.calibrate_step(psi, delta, eps1=2 * P, eps2=0.01, psi_range=(0.1, 1.5), groups=1) == \
        pytest.approx(densegrpo.calibrate_step(psi, delta, eps1=2, eps2=0.01, psi_range=(0.1, 1.5), groups=P))


def test_spaced_completions_take_exactly_n_steps():
    T = 10
    for n in range(1, T + 1):
        for i in range(T):
            idx = spaced_indices(i, T, n)
            assert idx[0] == i and idx[-1] == T and len(idx) - 1 == min(n, T - i)
            assert all(b > a for a, b in zip(idx, idx[1:]))
    assert spaced_indices(0, 10, 6) == [0, 2, 4, 5, 7, 9, 10]
    for i in range(T):  # n = 2 and n = t are the strided paths they always were
        assert spaced_indices(i, T, 2) == strided_indices(i, T, -(-(T - i) // min(2, T - i)))
        assert spaced_indices(i, T, T) == list(range(i, T + 1))


@pytest.mark.slow
def test_dense_nfe_closed_form_for_any_n(tiny, tmp_path):
    """n = 6 at T = 10, G = 24: G (T + sum_i (min(6, T - i) - 1)) = 24 (10 + 35) = 1080."""
    run_script("densegrpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_steps=10, group_size=24,
                                          prompts_per_iteration=1, micro_batch=48, dense_ode_steps=6, num_iterations=1,
                                          eval_every=0, updates_per_iteration=1))
    _, m = read_metrics(tmp_path)
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] == 1080


def test_open_clip_normalisation_comes_from_the_model(tmp_path):
    import open_clip
    from test_rewards import TINY_OPEN_CLIP, images, manual_cosine

    root = tmp_path / "clip"
    os.makedirs(root)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    with open(root / "open_clip_config.json", "w") as f:
        json.dump({"model_cfg": TINY_OPEN_CLIP, "preprocess_cfg": {"mean": mean, "std": std}}, f)
    model = open_clip.create_model(f"local-dir:{root}")
    from safetensors.torch import save_file

    save_file(model.state_dict(), str(root / "open_clip_model.safetensors"))
    fn = common.load_rewards(["clip"], "cpu", models=common.RewardModels(clip_model=str(root)))["clip"]
    x, prompts = images(2), ["a cat", "a dog"]
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    expected = manual_cosine(model.eval(), (x - m) / s, prompts, open_clip.get_tokenizer(f"local-dir:{root}"))
    torch.testing.assert_close(fn(x, prompts), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("detach_uncond", [False, True])
def test_sd3_guidance_gradient_follows_the_official_form(detach_uncond):
    """Flow-GRPO's compute_log_prob (scripts/train_sd3.py) forms uncond + g (text - uncond) from one forward of
    [negative; positive]; since a482878 (2025-08-19) the gradient flows through both halves, g d(text) - (g - 1)
    d(uncond); before it, `noise_pred_uncond.detach()` left g d(text) (--detach-uncond). The parameter gradient
    of velocity() is checked against each expression computed by hand from the two halves, and differs from the
    other one."""
    pipe = build_sd3()
    transformer, g = pipe.transformer, 4.5
    emb = common.encode_prompts(pipe, "sd3", ["a red circle", "a blue square"], max_sequence_length=16, cfg=g)
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    projection = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    params = [p for p in transformer.parameters()]
    transformer.requires_grad_(True)

    def grads(v):
        return torch.autograd.grad((v * projection).sum(), params, allow_unused=True, retain_graph=True)

    v = velocity(transformer, "sd3", x, 0.7, emb, guidance=g, detach_uncond=detach_uncond)
    ours = grads(v)
    # the official expression: the transformer on [negative; positive]
    t = torch.full((4,), 700.0)
    out = transformer(hidden_states=torch.cat([x, x]), timestep=t,
                      encoder_hidden_states=torch.cat([emb["neg_embeds"], emb["embeds"]]),
                      pooled_projections=torch.cat([emb["neg_pooled"], emb["pooled"]]), return_dict=False)[0]
    uncond, text = out.chunk(2)
    both_halves = uncond + g * (text - uncond)  # train_sd3.py at 1f4ca40 (after a482878)
    detached = uncond.detach() + g * (text - uncond.detach())  # train_sd3.py before a482878
    official, other = (detached, both_halves) if detach_uncond else (both_halves, detached)
    torch.testing.assert_close(v, official, rtol=0, atol=1e-6)  # the velocity itself is the same
    for a, b in zip(ours, grads(official)):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    diff = max((a - b).abs().max() for a, b in zip(ours, grads(other)) if b is not None)
    assert diff > 1e-3  # the two forms really differ on this model
    transformer.requires_grad_(False)


def official_training_samples(advantages, *, num_batches, updates):
    """train_sd3.py's rule on one process, as written there: mask = advantages.abs().sum(dim=1) != 0; random
    masked-out samples put back until the count is a multiple of num_batches (if there are enough); a permutation;
    reshaped to num_batches micro-batches, `updates` optimizer steps of num_batches / updates micro-batches each."""
    mask = advantages.abs().sum(dim=1) != 0
    true_count = mask.sum()
    if true_count % num_batches != 0:
        false_indices = torch.where(~mask)[0]
        num_to_change = num_batches - (true_count % num_batches)
        if len(false_indices) >= num_to_change:
            random_indices = torch.randperm(len(false_indices))[:num_to_change]
            mask[false_indices[random_indices]] = True
    samples = torch.arange(len(advantages))[mask]
    samples = samples[torch.randperm(len(samples))]
    batches = samples.reshape(num_batches, -1)
    return [b.reshape(-1) for b in batches.reshape(updates, num_batches // updates, -1)]


@pytest.mark.parametrize("zero_groups", [0, 1, 3, 5, 6])
def test_trained_samples_follow_the_official_rule(zero_groups):
    """common.training_minibatches against train_sd3.py's rule (same seed, same draws): the samples whose advantage
    is 0 at every trained step are dropped, topped up to a multiple of the micro-batches, shuffled into mini-batches;
    the sample sets and their order are identical. 6 groups of 4, 8 micro-batches, 2 optimizer steps."""
    g = torch.Generator().manual_seed(zero_groups)
    advantages = torch.randn(24, 9, generator=g)  # [samples, trained steps], as train_sd3.py holds them
    advantages[:4 * zero_groups] = 0  # groups of equal rewards: advantage 0 at every step
    advantages[-1, :5] = 0  # zero at some steps only: kept
    torch.manual_seed(7)
    official = official_training_samples(advantages.clone(), num_batches=8, updates=2) if zero_groups != 5 else None
    ours = common.training_minibatches(advantages.T, updates=2, micro_batches=8,
                                       generator=torch.Generator().manual_seed(7))
    kept = torch.cat(ours)
    nonzero = set(range(4 * zero_groups, 24))
    assert nonzero <= set(kept.tolist()) and len(set(kept.tolist())) == len(kept)
    if zero_groups == 5:  # 4 kept, 4 needed to reach 8 but 20 dropped: topped up to 8
        assert len(kept) == 8
    else:
        assert [b.tolist() for b in ours] == [b.tolist() for b in official]
    assert len(kept) % 8 == 0 and len({len(b) for b in ours}) == 1
    everything_zero = common.training_minibatches(torch.zeros(9, 24), updates=2, micro_batches=8, generator=g)
    assert [len(b) for b in everything_zero] == [0, 0]


def test_rank_chunks_weigh_every_sample_alike_on_any_number_of_ranks():
    """A mini-batch of samples over all ranks: each rank gets its own samples (local indices, micro-batches of at
    most 3), weighted so that the average of the ranks' weighted sums is the mean over the mini-batch, for 1, 2 and
    4 ranks; sharded ranks get extra weight-0 forwards up to the busiest rank's count."""
    minibatch = torch.tensor([13, 2, 7, 0, 15, 9, 1, 3, 14])  # 16 samples, rank r holds 16 / world of them
    values = torch.randn(16, dtype=torch.float64)
    for world in (1, 2, 4):
        per_rank = 16 // world
        total, counts = 0.0, []
        for rank in range(world):
            chunks = common.rank_chunks(minibatch, rank=rank, world=world, per_rank=per_rank, micro_batch=3,
                                        sharded=True)
            counts.append(len(chunks))
            for c, weight in chunks:
                assert len(c) <= 3 and (weight == 0 or weight == len(c) * world / 9)
                total += weight * float(values[c + rank * per_rank].mean()) / world
        torch.testing.assert_close(total, float(values[minibatch].mean()))
        assert len(set(counts)) == 1  # every rank runs the same forwards
    assert common.rank_chunks(minibatch[:0], rank=0, world=2, per_rank=8, micro_batch=3, sharded=True) == []
    assert common.rank_chunks(minibatch[1:2], rank=1, world=2, per_rank=8, micro_batch=3, sharded=False) == []
    unsharded = common.rank_chunks(minibatch, rank=3, world=4, per_rank=4, micro_batch=3, sharded=False)
    assert [c.tolist() for c, _ in unsharded] == [[1, 3, 2]]  # samples 13, 15, 14 of rank 3, in the batch's order


@pytest.mark.parametrize("script", ["flow_grpo.py", "densegrpo.py"])
def test_groups_of_equal_rewards_are_not_trained(tiny, tmp_path, monkeypatch, script):
    """A reward that is constant for one of the two prompts: those groups have advantage 0 at every step and are
    dropped before training (the KL too, beta > 0), so the training forwards are the other samples' only (policy
    and reference at each trained step), and train/kept_fraction is 1 - reward/zero_std_fraction."""
    def half_constant(images, prompts):
        brightness = images.float().mean(dim=(1, 2, 3))
        return torch.tensor([0.5 if p.startswith("a red") else float(b) for p, b in zip(prompts, brightness)])

    monkeypatch.setitem(common.REWARD_FUNCTIONS, "jpeg", half_constant)
    prompts = tmp_path / "two.txt"
    prompts.write_text("a red circle on the left\na blue square on the top\n")
    out = tmp_path / "out"
    flags = tiny_flags(tiny["flux"], str(prompts), out, num_iterations=3, eval_every=0, save_every=0, beta=0.04,
                       prompts_per_iteration=4, num_steps=4, timestep_fraction=1.0, **(
                           {"dense_ode_steps": 1} if script == "densegrpo.py" else {}))
    run_in_process(script, flags, monkeypatch)
    _, m = read_metrics(out)
    mixed = 0
    for it in (1, 2, 3):
        zero = m[it]["reward/zero_std_fraction"]
        assert m[it]["train/kept_fraction"] == pytest.approx(1 - zero)
        rollout = m[it]["perf/nfe_rollout_per_prompt"] * 4
        kept = round(16 * (1 - zero))
        assert m[it]["perf/nfe_per_iteration"] - rollout == kept * 4 * 2  # policy + reference, 4 trained steps
        mixed += 0 < zero < 1
    assert mixed  # some iteration had both kinds of group
