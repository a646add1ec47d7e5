"""Every rejected argument exits with a one-line error that names the value and what is allowed."""
import pytest
import torch

import flow_grpo
from common import latent_shape, load_pipeline, load_prompt_set, load_rewards
from helpers import check_args, run_script, tiny_flags, tiny_model_dirs



@pytest.mark.parametrize("over,message", [
    ({"group_size": 1}, "--group-size 1 is not allowed; GRPO needs at least 2 images per prompt"),
    ({"noise_level": -0.1}, "--noise-level -0.1 is not allowed; use a value >= 0"),
    ({"timestep_fraction": 0.0}, r"--timestep-fraction 0.0 is not allowed; use a value in \(0, 1\]"),
    ({"timestep_fraction": 1.5}, r"--timestep-fraction 1.5 is not allowed; use a value in \(0, 1\]"),
    ({"reward_weights": (1.0, 2.0)}, "--reward-weights has 2 values for 1 rewards; give one per reward"),
])
def test_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(flow_grpo, **over)


def test_updates_per_iteration_needs_as_many_micro_batches():
    # 48 prompts over 8 ranks x 24 images = 144 per rank in micro-batches of 12: at most 12 optimizer steps
    with pytest.raises(SystemExit, match=r"--updates-per-iteration 13 is not allowed; use 1..12 \(mini-batches per iteration\)"):
        check_args(flow_grpo, world=8, updates_per_iteration=13)


def test_paper_commands_fail_at_once_without_the_prompt_files(tmp_path):
    """The README's paper command lines, on a machine without the data: a one-line error pointing at 'Prompt sets'."""
    paths = tiny_model_dirs(str(tmp_path))
    out = run_script("flow_grpo.py", ["--model", paths["flux"], "--output-dir", str(tmp_path / "o")], check=False)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == (
        "error: prompt file 'data/pickscore/train.txt' does not exist; README 'Prompt sets' says where each paper's "
        "prompts come from (or pass any text file with one prompt per line)")


@pytest.mark.parametrize("over,message", [
    ({"eval_num": 0}, "--eval-num 0 is not a positive multiple of the world size 1"),
    ({"ema_every": 0}, "--ema-every 0 / --keep-checkpoints 3: use >= 1 / >= 0"),
])
def test_more_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(flow_grpo, **over)


def test_resume_paths_and_mismatched_ema(tmp_path):
    from common import latest_checkpoint, load_state

    ckpt = tmp_path / "run" / "checkpoints" / "iter_3"
    ckpt.mkdir(parents=True)
    torch.save({"iteration": 3, "args": {}, "trainable": {}, "optimizer": {}, "ema": None}, ckpt / "state.pt")
    assert latest_checkpoint(str(ckpt) + "/") == str(ckpt) == latest_checkpoint(str(tmp_path / "run") + "/")
    (tmp_path / "elsewhere").mkdir()
    torch.save({}, tmp_path / "elsewhere" / "state.pt")
    with pytest.raises(SystemExit, match="is not a run's checkpoints/iter_<N>; pass the run directory"):
        latest_checkpoint(str(tmp_path / "elsewhere"))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(SystemExit, match="was saved without an EMA; resume with --no-ema"):
        load_state(str(ckpt), None, opt, [], [], False, "cpu", with_ema=True)


def test_kl_without_noise_at_a_trained_step(tmp_path):
    paths = tiny_model_dirs(str(tmp_path))
    out = run_script("flow_grpo.py", tiny_flags(paths["flux"], paths["prompts"], tmp_path / "o", noise_level=0, beta=0.04,
                                                eval_every=0, num_iterations=1), check=False)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == (
        "error: --beta > 0 needs noise at every trained step (the KL divides by its variance); step 0 has none")


def test_world_size_must_divide_prompts():
    with pytest.raises(SystemExit, match="--prompts-per-iteration 48 is not a positive multiple of the world size 5"):
        check_args(flow_grpo, world=5)


def test_unknown_reward():
    with pytest.raises(SystemExit, match=r"unknown reward 'aesthetic'; choose from \['hps', 'clip', 'pickscore'"):
        load_rewards(["aesthetic"], "cpu")


def test_missing_model_path(tmp_path):
    with pytest.raises(SystemExit, match=f"model path '{tmp_path}/nope' does not exist; pass a local pipeline"):
        load_pipeline(str(tmp_path / "nope"), "cpu")


def test_prompt_files(tmp_path):
    with pytest.raises(SystemExit, match=f"prompt file '{tmp_path}/missing.txt' does not exist; README 'Prompt sets' says"):
        load_prompt_set(str(tmp_path / "missing.txt"))
    (tmp_path / "geneval.jsonl").write_text('{"tag": "counting", "prompt": "a photo of two cats"}\n{"prompt": "a dog"}\n')
    assert load_prompt_set(str(tmp_path / "geneval.jsonl")) == ["a photo of two cats", "a dog"]
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(SystemExit, match=f"prompt file '{tmp_path}/empty.txt' is empty"):
        load_prompt_set(str(tmp_path / "empty.txt"))


def test_resolution_the_model_cannot_take(tmp_path):
    paths = tiny_model_dirs(str(tmp_path))
    for kind in ("flux", "sd3"):
        pipe, k = load_pipeline(paths[kind], "cpu")
        assert latent_shape(pipe, k, 32) == (4, 16, 16)
        with pytest.raises(SystemExit, match="--resolution 30 is not allowed for this model; use a positive multiple of 4"):
            latent_shape(pipe, k, 30)


def test_cli_error_is_one_line(tmp_path):
    paths = tiny_model_dirs(str(tmp_path))
    proc = run_script("flow_grpo.py", tiny_flags(paths["flux"], paths["prompts"], tmp_path, group_size=1), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --group-size 1 is not allowed; GRPO needs at least 2 images per prompt")


def test_paper_command_lines_parse():
    import tyro

    dance = ("--model flux-dev --resolution 720 --guidance 3.5 --max-sequence-length 512 --num-steps 16 --group-size 12 "
             "--prompts-per-iteration 16 --noise-form dance --noise-level 0.3 --timestep-selection random "
             "--timestep-fraction 0.6 --same-init-noise --rewards hps clip --reward-combine advantages --no-global-std "
             "--std-unbiased --adv-eps 1e-8 --beta 0 --full-finetune --learning-rate 1e-5 --updates-per-iteration 1 "
             "--no-ema --micro-batch 4").split()
    args = tyro.cli(flow_grpo.Args, args=dance)
    assert args.rewards == ("hps", "clip") and args.noise_form == "dance" and not args.global_std and args.std_unbiased
    default = tyro.cli(flow_grpo.Args, args=[])
    assert (default.num_steps, default.group_size, default.beta, default.noise_level) == (10, 24, 0.01, 0.7)


def test_toy_preset_explicit_flags_win():
    from common import apply_preset

    args = tyro_args = flow_grpo.Args(model="toy", beta=0.0)
    apply_preset(tyro_args, flow_grpo.TOY, argv=["--model", "toy", "--beta", "0"])
    assert args.beta == 0.0 and args.resolution == 32 and args.group_size == 12
