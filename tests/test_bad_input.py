"""Every rejected argument exits with a one-line error that names the value and what is allowed."""
import os

import pytest

import dancegrpo
import flow_grpo
from common import RewardModels, latent_shape, load_pipeline, load_prompt_set, load_rewards
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
    ({"eval_num": 0}, r"--eval-num 0 is not allowed; use >= 1 \(held-out pairs per evaluation\)"),
    ({"ema_every": 0}, "--ema-every 0 / --keep-checkpoints 3: use >= 1 / >= 0"),
])
def test_more_argument_checks(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(flow_grpo, **over)


def checkpoint(root, args, iteration=3, script="flow_grpo.py", world=1, sharded=False):
    import dataclasses
    import json

    path = root / "checkpoints" / f"iter_{iteration}"
    path.mkdir(parents=True)
    run = {"iteration": iteration, "script": script, "world": world, "sharded": sharded,
           "args": dataclasses.asdict(args)}
    (path / "run.json").write_text(json.dumps(run))
    return path


def test_resume_paths(tmp_path):
    from common import latest_checkpoint

    ckpt = checkpoint(tmp_path / "run", flow_grpo.Args())
    assert latest_checkpoint(str(ckpt) + "/") == str(ckpt) == latest_checkpoint(str(tmp_path / "run") + "/")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "run.json").write_text("{}")
    with pytest.raises(SystemExit, match="is not a run's checkpoints/iter_<N>; pass the run directory"):
        latest_checkpoint(str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("saved,now,world,message", [
    ({"script": "g2rpo.py"}, {}, 1, "was made by g2rpo.py, not flow_grpo.py; resume it with that file"),
    ({}, {"full_finetune": True}, 1, "has --full-finetune False, this run True; the trainable weights must match"),
    ({}, {"model": "flux-dev"}, 1, "has --model sd3.5-medium, this run flux-dev; the trainable weights must match"),
    ({}, {"ema": False}, 1, "has --ema True, this run False; the trainable weights must match to resume"),
    ({}, {"lora_rank": 8}, 1, "has --lora-rank 32, this run 8"),
    ({"world": 2, "sharded": True, "full_finetune": True}, {"full_finetune": True}, 1,
     r"was saved by 2 process\(es\) \(sharded\); resume it with that world size, not 1"),
])
def test_resume_refuses_what_it_cannot_honour(tmp_path, saved, now, world, message):
    """Before any model loads, in one line: another algorithm file, model, LoRA vs full fine-tuning, LoRA shape,
    EMA, or the world size of a sharded run."""
    from common import resume_checkpoint

    fields = {k: v for k, v in saved.items() if k in ("full_finetune",)}
    checkpoint(tmp_path / "run", flow_grpo.Args(**fields), script=saved.get("script", "flow_grpo.py"),
               world=saved.get("world", 1), sharded=saved.get("sharded", False))
    with pytest.raises(SystemExit, match=message):
        resume_checkpoint(str(tmp_path / "run"), args=flow_grpo.Args(**now), world=world, script="flow_grpo.py")


def test_unreadable_checkpoint(tmp_path):
    from common import resume_checkpoint

    path = checkpoint(tmp_path / "run", flow_grpo.Args())
    (path / "run.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"cannot be read \(JSONDecodeError in run.json\); resume from another one"):
        resume_checkpoint(str(tmp_path / "run"), args=flow_grpo.Args(), world=1, script="flow_grpo.py")


def test_no_noise():
    """Flow-GRPO's images differ by their initial noise: without SDE noise they get advantages and no step has a
    log-prob to train (it failed inside the backward pass). DanceGRPO's KL needs the noise too."""
    with pytest.raises(SystemExit, match=r"--noise-level 0.0 is not allowed; use a value > 0 \(a step without "
                                         r"noise has no log-prob\)"):
        check_args(flow_grpo, noise_level=0.0, beta=0.0)
    with pytest.raises(SystemExit, match=r"--beta > 0 needs --noise-level > 0 \(the KL divides by the step's "
                                         r"variance\); pass --beta 0"):
        check_args(dancegrpo, noise_level=0.0, beta=0.04)


def test_world_size_must_divide_prompts():
    with pytest.raises(SystemExit, match="--prompts-per-iteration 48 is not a positive multiple of the world size 5"):
        check_args(flow_grpo, world=5)


def test_unknown_reward():
    with pytest.raises(SystemExit, match=r"unknown reward 'nonsense'; choose from \['hps', 'clip', 'pickscore', "
                                         r"'imagereward', 'aesthetic', 'unifiedreward', 'jpeg'"):
        load_rewards(["nonsense"], "cpu", models=RewardModels())


@pytest.mark.parametrize("flags,message", [
    (["--rewards", "nonsense"], "error: unknown reward 'nonsense'; choose from"),
    (["--rewards", "hps", "--hps-checkpoint", "/nowhere/HPS_v2.1_compressed.pt"],
     "error: --hps-checkpoint '/nowhere/HPS_v2.1_compressed.pt' does not exist; pass an existing path or a hub id"),
    (["--rewards", "unifiedreward"], "error: the unifiedreward reward needs --unifiedreward-url"),
    (["--prompts", "NOT_UTF8"], "is not UTF-8 text (byte 5); save it as UTF-8, a prompt per line"),
    (["--resume", "/nowhere/run"], "error: --resume '/nowhere/run' is not a directory; pass a run directory"),
])
def test_bad_input_fails_before_any_model_loads(tmp_path, flags, message):
    """The model path does not exist either: the error must be about the flag, so it came first."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("a caf\xe9 on the left\n".encode("latin-1"))
    flags = [str(bad) if f == "NOT_UTF8" else f for f in flags]
    proc = run_script("flow_grpo.py", ["--model", str(tmp_path / "no_model"), "--prompts", "toy",
                                       "--eval-prompts", "toy", *flags], check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and message in last, proc.stderr[-2000:]


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
    (tmp_path / "mixed.txt").write_text("a red circle on the left\na green triangle\n")
    assert load_prompt_set(str(tmp_path / "mixed.txt"), rewards=("jpeg",)) == ["a red circle on the left",
                                                                               "a green triangle"]
    with pytest.raises(SystemExit, match=f"prompt file '{tmp_path}/mixed.txt': not a toy-world prompt: 'a green "
                                         r"triangle'; expected e.g. .*; the rewards \['toy_strict'\] score toy"):
        load_prompt_set(str(tmp_path / "mixed.txt"), rewards=("jpeg", "toy_strict"))


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

    dance = tyro.cli(dancegrpo.Args, args=[])  # torchrun --nproc_per_node 16 dancegrpo.py
    assert (dance.model, dance.resolution, dance.max_sequence_length, dance.num_steps, dance.shift) == \
        ("flux-dev", 720, 512, 16, 3.0)
    assert (dance.noise_level, dance.timestep_fraction, dance.group_size, dance.prompts_per_iteration) == (0.3, 0.6, 12, 16)
    assert dance.rewards == ("hps", "clip") and dance.reward_combine == "advantages" and not dance.global_std
    assert (dance.adv_eps, dance.beta, dance.learning_rate, dance.updates_per_iteration) == (1e-8, 0.0, 1e-5, 3)
    assert dance.full_finetune and not dance.ema
    default = tyro.cli(flow_grpo.Args, args=[])
    assert (default.num_steps, default.group_size, default.beta, default.noise_level) == (10, 24, 0.01, 0.7)


def test_toy_preset_explicit_flags_win(monkeypatch):
    from common import parse_args

    monkeypatch.setattr("sys.argv", ["flow_grpo.py", "--model", "toy", "--beta", "0"])
    args = parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="")
    assert args.beta == 0.0 and args.resolution == 32 and args.group_size == 12
    monkeypatch.setattr("sys.argv", ["flow_grpo.py", "--beta", "0"])
    assert parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="").resolution == 512  # no preset


@pytest.mark.parametrize("script", ["flow_grpo.py", "densegrpo.py", "dancegrpo.py", "mixgrpo.py", "g2rpo.py"])
def test_help(script):
    """--help starts with the file's description, shows each default once, shows the TOY preset's values with
    --model toy, and `--help | head` ends without a BrokenPipeError traceback."""
    import subprocess
    import sys

    from helpers import ROOT

    import ast

    out = run_script(script, ["--help"]).stdout
    names = {"flow_grpo.py": "Flow-GRPO:", "densegrpo.py": "DenseGRPO:", "dancegrpo.py": "DanceGRPO:",
             "mixgrpo.py": "MixGRPO:", "g2rpo.py": "G2RPO:"}
    assert out.splitlines()[2].startswith(names[script])
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    docs = [n.value.value for n in args.body if isinstance(n, ast.Expr)]
    assert len(docs) > 40 and not [d for d in docs if "(default" in d]  # tyro shows each default itself
    toy = run_script(script, ["--model", "toy", "--help"]).stdout
    assert "the defaults below are the file's TOY preset" in toy and "(default: 32)" in toy
    head = subprocess.run(f"{sys.executable} {os.path.join(ROOT, script)} --help | head -3", shell=True,
                          capture_output=True, text=True)
    assert head.returncode == 0 and "Traceback" not in head.stderr and "BrokenPipe" not in head.stderr


def test_a_broken_jsonl_line_is_a_one_line_error(tmp_path):
    path = tmp_path / "test_metadata.jsonl"
    path.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue\n')
    with pytest.raises(SystemExit, match=r"line 2 of .*test_metadata.jsonl"):
        load_prompt_set(str(path), split="test")
    path.write_text('{"prompt": "a red circle"}\n{"caption": "no prompt field"}\n')
    with pytest.raises(SystemExit, match=r"line 2 of .*test_metadata.jsonl"):
        load_prompt_set(str(path), split="test")


@pytest.mark.parametrize("flag,reward,content", [
    ("hps_checkpoint", "hps", b"not a checkpoint"),
    ("aesthetic_head", "aesthetic", b"\x80\x04 truncated pickle"),
])
def test_unreadable_reward_weights_are_one_line_errors_before_the_model_loads(tmp_path, flag, reward, content):
    """A corrupt weight file stops the run with one line naming the flag; the rewards load before the pipeline,
    so the nonexistent --model is never reached."""
    bad = tmp_path / "weights.pt"
    bad.write_bytes(content)
    paths = tiny_model_dirs(str(tmp_path / "tiny"))
    flags = tiny_flags(str(tmp_path / "no-such-model"), paths["prompts"], tmp_path / "o", rewards=reward,
                       **{flag.replace("_", "-"): str(bad), "aesthetic_clip": str(tmp_path)})
    out = run_script("flow_grpo.py", flags, check=False)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and last.startswith(f"error: --{flag.replace('_', '-')} ") and "cannot be read" in last, \
        out.stderr[-2000:]
