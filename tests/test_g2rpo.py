"""g2rpo.py end to end on tiny random pipelines: NFE against the closed form, singular stochasticity, smoke runs."""
import pytest

import g2rpo
from helpers import check_args, read_metrics, run_script, tiny_flags


def g2_flags(tiny, out, kind="flux", **over):
    base = dict(num_steps=6, sde_steps="0 1 4", lambdas="1 2 3", no_full_finetune=True, updates_per_iteration=3,
                guidance=4.5 if kind == "sd3" else 3.5)
    base.update(over)
    return tiny_flags(tiny[kind], tiny["prompts"], out, **base)


@pytest.mark.slow
@pytest.mark.parametrize("lambdas,expected", [("1", 1112), ("1 2", 1592), ("1 3", 1412), ("1 2 3", 1892)])
def test_nfe_equals_closed_form_minimum(tiny, tmp_path, lambdas, expected):
    """T = 16, M = the first 8 steps, G = 12: 8 anchor evaluations, then per member and k one shared first completion
    velocity plus the remaining steps of each granularity (the official code spends about 2188 for {1, 2, 3})."""
    run_script("g2rpo.py", g2_flags(tiny, tmp_path, num_steps=16, sde_steps=" ".join(map(str, range(8))), lambdas=lambdas,
                                     group_size=12, prompts_per_iteration=1, micro_batch=48, num_iterations=1,
                                     eval_every=0))
    _, m = read_metrics(tmp_path)
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] == expected


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_two_iterations(tiny, tmp_path, kind):
    run_script("g2rpo.py", g2_flags(tiny, tmp_path, kind))
    run, m = read_metrics(tmp_path)
    # T = 6, M = {0, 1, 4}, Lambda = {1, 2, 3}, G = 4; remaining steps 5, 4, 1; first velocity shared by the strides:
    # 5 anchor + 4 * ((1 + 4 + 2 + 1) + (1 + 3 + 1 + 1) + (1 + 0 + 0 + 0))
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] == 5 + 4 * (8 + 6 + 1)
    for it in (1, 2):
        assert m[it]["train/first_ratio_max_dev"] <= 1e-6 and m[it]["train/ratio_mean"] == pytest.approx(1, abs=1e-6)
    assert "eval/jpeg" in m[2] and m[2]["reward/zero_std_fraction"] < 1


def test_eta_zero_makes_every_member_identical(tiny, tmp_path):
    """Singular stochasticity: members share x_k bit for bit, so without SDE noise every image of a group is the same,
    every group's reward spread is zero and every advantage is exactly 0 (no gradient at all)."""
    run_script("g2rpo.py", g2_flags(tiny, tmp_path, noise_level=0.0, rewards="jpeg", eval_every=0))
    _, m = read_metrics(tmp_path)
    assert m[1]["reward/zero_std_fraction"] == 1.0 and m[1]["reward/jpeg_std"] >= 0
    assert m[1]["train/grad_norm"] == 0.0 and m[1]["train/policy_loss"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("full", [False, True], ids=["lora-ddp", "full-fsdp2"])
def test_torchrun_two_processes(tiny, tmp_path, full):
    over = {"full_finetune": True, "no_full_finetune": None} if full else {}
    run_script("g2rpo.py", g2_flags(tiny, tmp_path, prompts_per_iteration=2, **over), nproc=2)
    run, m = read_metrics(tmp_path)
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6 and "eval/jpeg" in m[2]



@pytest.mark.parametrize("over,message", [
    ({"lambdas": ()}, r"--lambdas \[\] is not allowed; give distinct values in 1..15"),
    ({"lambdas": (0, 1)}, r"--lambdas 0 is not allowed; use a value in \[1, 1000\]"),
    ({"lambdas": (1, 16)}, r"--lambdas \[1, 16\] is not allowed; give distinct values in 1..15"),
    ({"lambdas": (1, 2, 2)}, r"--lambdas \[1, 2, 2\] is not allowed; give distinct values in 1..15"),
    ({"sde_steps": (0, 1, 2)}, r"--updates-per-iteration 8 is not allowed; use 1..3 \(one per trained k at most"),
    ({"sde_steps": ()}, r"--sde-steps \[\] is not allowed; give distinct values in 0..15"),
    ({"sde_steps": (0, 16)}, r"--sde-steps \[0, 16\] is not allowed; give distinct values in 0..15"),
    ({"sde_steps": (-1,)}, r"--sde-steps -1 is not allowed; use a value in \[0, 1000\]"),
    ({"group_size": 1}, "--group-size 1 is not allowed; GRPO needs at least 2 images per prompt"),
])
def test_bad_input(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(g2rpo, **over)


def test_paper_command_line_parses():
    import tyro

    args = tyro.cli(g2rpo.Args, args=["--lambdas", "1", "2", "3"])
    assert args.lambdas == (1, 2, 3) and args.sde_steps == tuple(range(8)) and args.full_finetune
    assert (args.num_steps, args.group_size, args.noise_level, args.learning_rate) == (16, 12, 0.7, 2e-6)
    assert args.updates_per_iteration == len(args.sde_steps) == 8 and args.beta == 0  # one step per trained k
    assert args.rewards == ("hps", "clip") and args.model == "flux-dev" and args.resolution == 720
