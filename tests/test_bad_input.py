"""Every rejected argument exits with a one-line error that names the value and what is allowed."""
import glob
import os
import re

import pytest

import dancegrpo
import flow_grpo
from common import RewardModels, latent_shape, load_pipeline, load_prompt_set, load_rewards
from helpers import check_args, run_script, tiny_flags, tiny_model_dirs


@pytest.mark.parametrize("over,message", [
    ({"group_size": 1}, "--group-size 1 is not allowed; GRPO needs at least 2 images per prompt"),
    ({"noise_level": -0.1}, r"--noise-level -0.1 is not allowed; use a value in \[0, 10\]"),
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
        "error: prompt file 'data/pickscore/train.txt' does not exist; docs/rewards.md 'Prompt sets' says where each paper's "
        "prompts come from (or pass any text file with one prompt per line)")


@pytest.mark.parametrize("over,message", [
    ({"eval_num": 0}, r"--eval-num 0 is not allowed; use a value in \[1, 1e7\]"),
    ({"ema_every": 0}, r"--ema-every 0 is not allowed; use a value in \[1, 1e9\]"),
    ({"clip_range": -1.0}, r"--clip-range -1.0 is not allowed; use a value in \(0, 100\]"),
    ({"beta": -1.0}, r"--beta -1.0 is not allowed; use a value in \[0, 1e6\]"),
    ({"learning_rate": -1e-4}, r"--learning-rate -0.0001 is not allowed; use a value in \(0, 1\]"),
    ({"num_iterations": 0}, r"--num-iterations 0 is not allowed; use a value in \[1, 1e9\]"),
    ({"reward_weights": (float("nan"),)}, r"--reward-weights nan is not allowed; use a value in \(0, 1e6\]"),
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
    from rundir import latest_checkpoint

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
    from rundir import resume_checkpoint

    fields = {k: v for k, v in saved.items() if k in ("full_finetune",)}
    checkpoint(tmp_path / "run", flow_grpo.Args(**fields), script=saved.get("script", "flow_grpo.py"),
               world=saved.get("world", 1), sharded=saved.get("sharded", False))
    with pytest.raises(SystemExit, match=message):
        resume_checkpoint(str(tmp_path / "run"), args=flow_grpo.Args(**now), world=world, script="flow_grpo.py")


def test_unreadable_checkpoint(tmp_path):
    from rundir import resume_checkpoint

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
                                         r"'imagereward', 'aesthetic', 'unifiedreward', 'ocr', 'geneval', "
                                         r"'deqa', 'videoalign_vq', 'videoalign_mq', 'videoalign_ta', "
                                         r"'image_similarity', 'editreward', 'jpeg'"):
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


def test_missing_model_path(tmp_path, monkeypatch):
    """A missing path; a missing relative path with one slash (which could be a hub id: offline, it is not); the
    toy alias without the toy model next to common.py (a copied file)."""
    import common

    with pytest.raises(SystemExit, match=f"model path '{tmp_path}/nope' does not exist; pass a local pipeline"):
        load_pipeline(str(tmp_path / "nope"), "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as e:
        load_pipeline("fx/nope", "cpu")
    assert str(e.value).startswith("error: model 'fx/nope' is no local directory, and no hub model that could be "
                                   "loaded (") and "stacktrace" not in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setitem(common.MODEL_ALIASES, "toy", str(tmp_path / "toy" / "flux-shapes"))
    with pytest.raises(SystemExit, match=f"the toy model is not at '{tmp_path}/toy/flux-shapes': copy this project's "
                                         f"toy/flux-shapes there"):
        load_pipeline("toy", "cpu")


def test_output_paths_are_checked_before_any_work(tmp_path):
    """--output-dir on a file, --psi-out into a directory that does not exist: one line before any model loads."""
    import densegrpo

    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=f"--output-dir '{tmp_path}/afile' is a file; pass a directory"):
        check_args(flow_grpo, output_dir=str(tmp_path / "afile"))
    with pytest.raises(SystemExit, match=f"--psi-out '{tmp_path}/afile/psi.json' cannot be written "):
        check_args(densegrpo, calibrate=True, psi_out=str(tmp_path / "afile" / "psi.json"))
    with pytest.raises(SystemExit, match=f"--psi-out '{tmp_path}/new/psi.json' cannot be written "):
        check_args(densegrpo, calibrate=True, psi_out=str(tmp_path / "new" / "psi.json"))
    check_args(densegrpo, calibrate=True, psi_out=str(tmp_path / "psi.json"))
    check_args(flow_grpo, output_dir=str(tmp_path / "new" / "runs"))  # made by the run


def test_prompt_files(tmp_path):
    with pytest.raises(SystemExit, match=f"prompt file '{tmp_path}/missing.txt' does not exist; docs/rewards.md 'Prompt sets' says"):
        load_prompt_set(str(tmp_path / "missing.txt"))
    with pytest.raises(SystemExit, match=f"prompt file '{tmp_path}' is a directory; pass a text file with one prompt"):
        load_prompt_set(str(tmp_path))
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


@pytest.mark.parametrize("script", ["flow_grpo.py", "diffusion_nft.py", "awm.py", "dgpo.py", "flow_dppo.py"])
def test_the_readmes_command_lines_parse_and_pass_the_checks(script):
    """Every command line of the forward-process files in README.md and docs/ (continuation lines joined) parses and passes
    check_args at its world size, before any model or prompt file is read."""
    import importlib
    import importlib.util
    import re
    import shlex

    import tyro

    from helpers import ROOT

    pages = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    text = "\n".join(open(p).read() for p in pages).replace("\\\n", " ")
    for name, value in re.findall(r'^(\w+)="([^"]*)"', text, flags=re.M):  # the pages' shell variables: P="..."
        text = text.replace(f"${name}", value)
    lines = [line.split("#")[0] for line in text.splitlines() if re.match(rf"(torchrun .*|python ){script}", line)]
    assert len(lines) >= 2, lines
    module = importlib.import_module(script[:-3])
    for line in lines:
        words = shlex.split(line)
        world = int(next((w.split("=")[1] for w in words if w.startswith("--nproc_per_node=")), None) or
                    (words[words.index("--nproc_per_node") + 1] if "--nproc_per_node" in words else 1))
        args = tyro.cli(module.Args, args=words[words.index(script) + 1:])
        if "ocr" in args.rewards and importlib.util.find_spec("rapidocr") is None:  # the optional engine
            with pytest.raises(SystemExit, match="the ocr reward needs an OCR engine"):
                module.check_args(args, world)
            continue
        module.check_args(args, world)


def test_toy_preset_explicit_flags_win(monkeypatch):
    from rundir import parse_args

    monkeypatch.setattr("sys.argv", ["flow_grpo.py", "--model", "toy", "--beta", "0"])
    args = parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="")
    assert args.beta == 0.0 and args.resolution == 32 and args.group_size == 12
    monkeypatch.setattr("sys.argv", ["flow_grpo.py", "--beta", "0"])
    assert parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="").resolution == 512  # no preset


@pytest.mark.parametrize("script", ["flow_grpo.py", "densegrpo.py", "dancegrpo.py", "mixgrpo.py", "g2rpo.py",
                                    "diffusion_nft.py", "awm.py", "dgpo.py", "flow_dppo.py"])
def test_help(script):
    """--help starts with the file's description, shows each default once, shows the TOY preset's values with
    --model toy, and `--help | head` ends without a BrokenPipeError traceback."""
    import subprocess
    import sys

    from helpers import ROOT

    import ast

    out = run_script(script, ["--help"]).stdout
    names = {"flow_grpo.py": "Flow-GRPO:", "densegrpo.py": "DenseGRPO:", "dancegrpo.py": "DanceGRPO:",
             "mixgrpo.py": "MixGRPO:", "g2rpo.py": "G2RPO:", "diffusion_nft.py": "DiffusionNFT:",
             "awm.py": "AWM (Advantage Weighted Matching):",
             "dgpo.py": "DGPO (Direct Group Preference Optimization):", "flow_dppo.py": "Flow-DPPO:"}
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


ENTRY_POINTS = ["flow_grpo", "densegrpo", "dancegrpo", "g2rpo", "mixgrpo", "diffusion_nft", "awm", "dgpo", "flow_dppo",
                "evaluate"]


def numeric_fields(module):
    """(name, is_int, is_tuple) of every field of the module's Args that holds numbers (or a tuple of them)."""
    import dataclasses
    import typing

    out = []
    for f in dataclasses.fields(module.Args):
        hint = str(typing.get_type_hints(module.Args)[f.name])
        if "int" in hint or "float" in hint:
            out.append((f.name, "float" not in hint, "tuple" in hint))
    return out


def outside(rule: str, is_int: bool):
    """Values that break `rule` (an interval, finite both ways): both sides, just beyond each bound, NaN and
    infinity for floats, an integer beyond any float for integers."""
    low, high = (float(x) for x in rule[1:-1].split(","))
    bad = [low if rule[0] == "(" else low - 1, high if rule[-1] == ")" else high + 1]
    if not is_int:
        return [low if rule[0] == "(" else low - abs(low) * 1e-9 - 1e-12, high * (1 + 1e-9) + 1e-12] + bad + [
            float("nan"), float("inf")]
    return [int(v) for v in bad] + [10**400]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_numeric_argument_is_checked_before_any_model_loads(name, tmp_path):
    """Every numeric argument of every entry point's Args has a range (common.ARG_RANGES), and every value outside
    it, NaN and infinity included, stops check_args (which loads nothing) with a one-line error naming the flag
    and the value; a few go through the command line too, to show that no traceback comes out of it."""
    import importlib

    import common

    module = importlib.import_module(name)
    fields = numeric_fields(module)
    assert fields and not [f for f, _, _ in fields if f not in common.ARG_RANGES], "a numeric argument has no range"
    tried = 0
    for field, is_int, is_tuple in fields:
        for value in outside(common.ARG_RANGES[field], is_int):
            args = module.Args(prompts="toy", **({"eval_prompts": "toy"} if name != "evaluate" else {}))
            setattr(args, field, (value,) * (2 if field == "psi_range" else 1) if is_tuple else value)
            if field == "reward_weights":
                args.rewards = ("jpeg",)
            with pytest.raises(SystemExit) as e:
                module.check_args(args, **({} if name == "evaluate" else {"world": 1}))
            message = str(e.value)
            assert "\n" not in message and message.startswith(f"error: --{field.replace('_', '-')}"), (field, value,
                                                                                                     message)
            tried += 1
    assert tried > len(fields)
    script = f"{name}.py"
    flags = {"flow_grpo": ["--clip-range", "-1"], "densegrpo": ["--eps2", "nan"], "dancegrpo": ["--shift", "0"],
             "g2rpo": ["--lambdas", "0"], "mixgrpo": ["--window-stride", "-1"], "diffusion_nft": ["--nft-beta", "0"],
             "awm": ["--ghuber-power", "0"], "dgpo": ["--beta-dpo", "0"], "flow_dppo": ["--kl-threshold", "-1"],
             "evaluate": ["--steps", "0"]}[name]
    proc = run_script(script, ["--model", str(tmp_path / "no-model"), *flags], check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {flags[0]} "), proc.stderr[-500:]


@pytest.mark.slow
def test_copying_one_file_as_the_readme_says(tmp_path):
    """README "Copying one file into your project", literally, in an empty directory: mixgrpo.py, common.py,
    rundir.py and models.py train the toy pipeline (given by its path: its toy_world.json gives it the TOY preset) on --rewards
    jpeg; the toy rewards need toy/world.py, a one-line error until it is copied, then they train; the learned
    rewards name rewards.py; --model toy names the toy model's place. The summary counts in seconds below a
    minute; without rundir.py or models.py one line names the file, without common.py Python's own message."""
    import shutil
    import subprocess
    import sys

    from helpers import ROOT

    project = tmp_path / "project"
    project.mkdir()
    for f in ("mixgrpo.py", "common.py", "rundir.py", "models.py"):
        shutil.copy(os.path.join(ROOT, f), project)
    (project / "prompts.txt").write_text("a red circle on the left\na blue square on the top\n")
    toy_model = os.path.join(ROOT, "toy", "flux-shapes")
    small = ["--num-iterations", "1", "--eval-every", "0", "--prompts-per-iteration", "1", "--group-size", "4",
             "--num-steps", "6", "--window-size", "2"]

    def run(*flags):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH="")
        return subprocess.run([sys.executable, "mixgrpo.py", *flags], cwd=project, capture_output=True, text=True,
                              env=env, timeout=600)

    jpeg = run("--model", toy_model, "--rewards", "jpeg", "--eval-rewards", "jpeg", "--prompts", "prompts.txt",
               "--eval-prompts", "prompts.txt", *small)
    assert jpeg.returncode == 0, jpeg.stderr[-2000:]
    assert re.search(r"mixgrpo on .*flux-shapes: 1 iteration in \d+ s, ", jpeg.stdout), jpeg.stdout
    assert "height=32, width=32" in jpeg.stdout  # the TOY preset, not the paper's 720 px
    missing = run("--model", toy_model, *small)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1] == ("error: toy/world.py is missing: copy this project's "
                                                       "toy/world.py next to common.py as toy/world.py (README: "
                                                       "copying one file)")
    (project / "toy").mkdir()
    shutil.copy(os.path.join(ROOT, "toy", "world.py"), project / "toy" / "world.py")
    toy = run("--model", toy_model, *small)
    assert toy.returncode == 0 and "1 iteration in" in toy.stdout, toy.stderr[-2000:]
    learned = run("--model", toy_model, "--rewards", "pickscore", *small)
    assert learned.stderr.strip().splitlines()[-1].startswith("error: rewards.py is missing: copy this project's "
                                                              "rewards.py next to common.py"), learned.stderr[-500:]
    alias = run("--model", "toy", *small)
    for name in ("rundir.py", "models.py"):  # one line naming the file, rundir's after common's import too
        os.remove(project / name)
        lacking = run("--model", toy_model, *small)
        assert lacking.returncode == 1 and lacking.stderr.strip() == (
            f"error: {name} is missing: copy this project's {name} next to common.py as {name} (README: copying "
            f"one file)"), lacking.stderr[-2000:]
    os.remove(project / "common.py")  # Python's own message (README)
    assert run("--model", toy_model, *small).stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'common'")
    assert alias.stderr.strip().splitlines()[-1].startswith(f"error: the toy model is not at "
                                                            f"'{project / 'toy' / 'flux-shapes'}': copy"), alias.stderr


def test_messages_that_say_what_is_wrong():
    """Each names what the user can change: DanceGRPO with one step (never trained), G2RPO's optimizer steps per
    trained k when --sde-steps gives fewer, sampled images that are NaN (a diverged sampler, not a reward's fault)."""
    import g2rpo
    import torch

    from common import score

    with pytest.raises(SystemExit, match=r"--timestep-fraction 0.6 of --num-steps 1 trains no step \(the last is "
                                         r"never trained\); raise --num-steps to >= 2, or the fraction"):
        check_args(dancegrpo, num_steps=1)
    with pytest.raises(SystemExit, match=r"--updates-per-iteration 8 is not allowed; use 1..1 \(one per trained k "
                                         r"at most: --sde-steps gives 1\)"):
        check_args(g2rpo, sde_steps=(0,))
    images = torch.full((2, 3, 8, 8), float("nan"))
    with pytest.raises(SystemExit, match=r"^error: the sampled images are not finite \(NaN\): sampling diverged; "
                                         r"lower --noise-level \(or psi\)"):
        score({"jpeg": lambda x, p: torch.zeros(2)}, images, ["a", "b"])
