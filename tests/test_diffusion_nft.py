"""diffusion_nft.py: the dpm2 sampler in closed form, NFE against planned_nfe, the old policy's EMA in the checkpoint,
LoRA and FSDP2 on two processes, bad arguments."""
import dataclasses
import math
import os

import pytest
import torch

import diffusion_nft
from common import dpm2_step
from g2rpo import ode_step
from helpers import check_args, read_metrics, run_script, tiny_flags
from test_math import M, S, TOL, exact_velocity


def end_points(solver, steps, z):
    """The ODE's end point from z at sigma = 1 with the exact velocity of N(M, S^2) data (the exact one: M + S z)."""
    sigmas = torch.linspace(1, 0, steps + 1)
    x, x0 = z.clone(), None
    for i in range(steps):
        v = exact_velocity(x, float(sigmas[i]), M, S)
        if solver == "euler":
            x = ode_step(v, x, sigmas[i], sigmas[i + 1])
        else:
            x, x0 = dpm2_step(v, x, sigmas, i, x0_prev=x0)
    return x


def test_dpm2_transports_noise_to_data_at_second_order():
    """dpm2 ends at the data law, and its error against the exact flow map z -> M + S z is several times Euler's at
    equal steps (measured 6.5x at 20 and 7.4x at 40 steps; its last step into sigma = 0 is first order, so the error
    halves with the step as Euler's does)."""
    z = torch.randn(20_000, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    x = end_points("dpm2", 100, z)
    assert abs(x.mean() - M) < TOL and abs(x.std() - S) < TOL
    err = {s: {n: (end_points(s, n, z) - (M + S * z)).abs().max().item() for n in (20, 40)} for s in ("dpm2", "euler")}
    assert err["dpm2"][40] < err["dpm2"][20] and err["euler"][40] < err["euler"][20], err
    assert err["dpm2"][20] < err["euler"][20] / 5 and err["dpm2"][40] < err["euler"][40] / 5, err


def test_dpm2_first_and_last_steps_are_first_order():
    """Without a previous x0, after sigma = 1 and into sigma = 0 the step is DDIM with eta 0 (= Euler)."""
    g = torch.Generator().manual_seed(1)
    x, v, x0_prev = (torch.randn(3, 4, generator=g) for _ in range(3))
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])
    for i, prev in ((0, None), (1, x0_prev), (2, x0_prev)):
        torch.testing.assert_close(dpm2_step(v, x, sigmas, i, x0_prev=prev)[0], ode_step(v, x, sigmas[i], sigmas[i + 1]))
    s, t, u = 0.8, 0.5, 0.3  # a second-order step, written out with lambda = log((1 - sigma) / sigma)
    lam = [math.log((1 - a) / a) for a in (s, t, u)]
    h, r0 = lam[2] - lam[1], (lam[1] - lam[0]) / (lam[2] - lam[1])
    x0 = x - t * v
    expected = u / t * x - (1 - u) * (math.exp(-h) - 1) * (x0 + (x0 - x0_prev) / (2 * r0))
    torch.testing.assert_close(dpm2_step(v, x, torch.tensor([s, t, u]), 1, x0_prev=x0_prev)[0], expected)


def test_defaults_are_the_official_sd3_pickscore_setting():
    a = diffusion_nft.Args()
    assert (a.num_steps, a.eval_steps, a.guidance, a.group_size, a.prompts_per_iteration) == (10, 40, 1.0, 24, 48)
    assert (a.nft_beta, a.beta, a.decay_type, a.adv_clip, a.timestep_fraction) == (1.0, 1e-4, 1, 5.0, 0.99)
    assert (a.learning_rate, a.lora_rank, a.lora_alpha, a.ema_decay, a.ema_every) == (3e-4, 32, 64, 0.9, 1)
    assert a.updates_per_iteration == 1 and a.global_std
    assert diffusion_nft.planned_nfe(a) == {"rollout": 240, "train": 216, "old": 216, "reference": 216}


@pytest.mark.slow
@pytest.mark.parametrize("kind,beta", [("flux", 1e-4), ("sd3", 0.0)])
def test_nfe_equals_planned_nfe(tiny, tmp_path, kind, beta):
    """The measured NFE of an iteration is planned_nfe's sum times the prompts: the rollout's steps, then per trained
    timestep the old policy, the policy and (beta > 0) the reference."""
    run_script("diffusion_nft.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, num_steps=5, timestep_fraction=0.6,
                                              beta=beta, num_iterations=1, eval_every=0))
    _, m = read_metrics(tmp_path)
    args = dataclasses.replace(diffusion_nft.Args(), num_steps=5, timestep_fraction=0.6, beta=beta, group_size=4)
    plan = diffusion_nft.planned_nfe(args)
    assert m[1]["perf/nfe_per_iteration"] == 2 * sum(plan.values()) == 2 * 4 * (5 + 3 * (3 if beta else 2))
    assert m[1]["perf/nfe_rollout_per_prompt"] == plan["rollout"]
    assert m[1]["train/updates"] == 1 and m[1]["train/kept_fraction"] == 1.0


@pytest.mark.slow
def test_old_policy_is_the_ema_of_return_decay(tiny, tmp_path):
    """The checkpoints hold the old policy: after iteration 2 (decay type 1, 2 optimizer steps) it is 0.002 old_1 +
    0.998 policy_2, old_1 being iteration 1's; the old policy is saved with the state, so a resume continues it."""
    run_script("diffusion_nft.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, eval_every=0, save_every=1))
    run, m = read_metrics(tmp_path)
    assert m[1]["train/old_decay"] == pytest.approx(0.001) and m[2]["train/old_decay"] == pytest.approx(0.002)
    s1, s2 = (torch.load(os.path.join(run, "checkpoints", f"iter_{i}", "state.pt"), weights_only=True) for i in (1, 2))
    for name, p2 in s2["trainable"].items():
        expected = torch.lerp(s1["extra"]["old"][name], p2, 0.998)
        torch.testing.assert_close(s2["extra"]["old"][name], expected, rtol=0, atol=1e-7)
        assert not torch.equal(s2["extra"]["old"][name], p2) or torch.equal(s1["trainable"][name], p2)


def exported(run, iteration):
    """Every tensor of a checkpoint's export (LoRA, or the transformer: one file per rank when sharded), by name."""
    from safetensors.torch import load_file

    out = {}
    for root, _, files in os.walk(os.path.join(run, "checkpoints", f"iter_{iteration}")):
        out.update({k: v for f in files if f.endswith(".safetensors") for k, v in load_file(os.path.join(root, f)).items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("full", [False, True], ids=["lora-ddp", "full-fsdp2"])
def test_one_and_two_processes_take_the_same_steps_and_resume(tiny, tmp_path, full):
    """Every rank draws every rank's prompts, noise, mini-batches and timesteps (and each sample its training noise),
    so 1 process and 2 (LoRA averaging gradients, or FSDP2 sharding) train the same samples and end two iterations
    with the same weights, up to the order of the float sums; then the two processes resume their old policy from
    the (distributed) checkpoint."""
    extra = {"full_finetune": True, "no_ema": True} if full else {}
    flags = dict(prompts_per_iteration=2, eval_every=0, num_iterations=2, **extra)
    runs = []
    for nproc in (1, 2):
        run_script("diffusion_nft.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / f"n{nproc}", **flags),
                   nproc=nproc)
        runs.append(read_metrics(tmp_path / f"n{nproc}"))
    (one, m1), (two, m2) = runs
    assert m2[2]["train/updates"] == 1 and m2[2]["perf/nfe_per_iteration"] == 2 * 4 * (4 + 3 * 3)
    for key in ("reward/jpeg_mean", "train/policy_loss", "train/kl", "train/grad_norm"):
        assert m1[2][key] == pytest.approx(m2[2][key], rel=1e-4, abs=1e-8), key
    a, b = exported(one, 2), exported(two, 2)
    assert a.keys() == b.keys() and len(a) > 10 and m1[2]["train/updates"] == m2[2]["train/updates"] == 1
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    resume = tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "n2", **{**flags, "num_iterations": 3}, resume=two)
    run_script("diffusion_nft.py", resume, nproc=2)
    _, m = read_metrics(tmp_path / "n2")
    assert m[3]["train/old_decay"] == pytest.approx(0.003) and m[3]["train/updates"] == 1


@pytest.mark.parametrize("over,message", [
    ({"nft_beta": 0.0}, "--nft-beta 0.0 is not allowed; use a value in \\(0, 100\\]"),
    ({"decay_type": 3}, r"--decay-type 3 is not allowed; use a value in \[0, 2\]"),
    ({"timestep_fraction": 0.05}, "--timestep-fraction 0.05 trains no step of 10; raise it"),
])
def test_bad_arguments(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(diffusion_nft, **over)
