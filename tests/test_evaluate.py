"""evaluate.py: the base model and checkpoints of real (tiny) runs scored on the same pairs, checked against the runs'
own evaluations and diffusers' own pipeline; the toy world command; every bad input's one-line error; torchrun."""
import dataclasses
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

import rundir
import evaluate
from helpers import ROOT, run_script, tiny_flags, tiny_model_dirs

TINY_EVAL = ["--metrics", "jpeg", "--steps", "4", "--guidance", "4.5", "--resolution", "32", "--max-sequence-length",
             "16", "--mixed-precision", "no"]  # flow_grpo.py's settings in tiny_flags: its evaluation, reproduced


def run_dir(out):
    (name,) = os.listdir(out)
    return os.path.join(out, name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA run (with its EMA) and a full fine-tuning run of one iteration on a tiny random Flux, each evaluated on
    the 3 pairs (prompt k, noise seed 10^6 + k) at iterations 0 and 1."""
    root = tmp_path_factory.mktemp("evaluate")
    tiny = tiny_model_dirs(str(root))
    common = dict(num_iterations=1, eval_every=1, eval_num=3, log_images_every=0, learning_rate=1e-3)
    flags = {"lora": tiny_flags(tiny["flux"], tiny["prompts"], root / "lora", ema_every=1, **common),
             "full": tiny_flags(tiny["flux"], tiny["prompts"], root / "full", full_finetune=True, no_ema=True, **common)}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(partial(run_script, "flow_grpo.py"), flags.values()))
    runs = {k: run_dir(root / k) for k in flags}
    out = root / "eval1"
    full_dir = os.path.join(runs["full"], "checkpoints", "iter_1", "transformer")
    proc = run_script("evaluate.py", ["--model", tiny["flux"], "--prompts", tiny["prompts"], "--checkpoints", runs["lora"],
                                      full_dir, "--out", str(out), *TINY_EVAL])
    return {**tiny, **runs, "full_dir": full_dir, "root": root, "out": out, "stdout": proc.stdout}


def eval_json(run, iteration):
    with open(os.path.join(run, f"eval_{iteration}.json")) as f:
        return json.load(f)


def test_base_lora_and_full_checkpoints(trained):
    table = open(trained["out"] / "table.md").read()
    assert table in trained["stdout"]
    assert "3 prompts x 1 seed(s) = 3 pairs" in table and "4 steps, guidance 4.5, 32 px" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| entry")]
    assert [r.split(" | ")[:2] for r in rows] == [["| base", "-"], [f"| {trained['lora']}", "1"],
                                                  [f"| {trained['full_dir']}", "1"]]  # iteration: from run.json
    assert rows[0].endswith("| (reference) |")
    for r in rows[1:]:  # mean +- SE, then the paired change +- its paired SE
        assert re.fullmatch(r"\| .* \| 1 \| -?\d\.\d+ \+- \d\.\d+ \| [+-]\d\.\d+ \+- \d\.\d+ \|", r), r
    saved = json.load(open(trained["out"] / "scores.json"))
    s = saved["settings"]
    prompts = open(trained["prompts"]).read().splitlines()
    assert s["pair_prompts"] == prompts and s["pair_noise_seeds"] == [10**6 + k for k in range(3)]
    assert (s["steps"], s["guidance"], s["resolution"], s["num_pairs"], s["world"]) == (4, 4.5, 32, 3, 1)
    base, lora, full = saved["entries"]
    assert (base["name"], lora["name"], full["name"]) == ("base", trained["lora"], trained["full_dir"])
    assert lora["path"] == os.path.join(trained["lora"], "checkpoints", "iter_1", "lora")  # the run's newest checkpoint
    assert (lora["weights"], lora["iteration"], full["weights"], full["iteration"]) == ("lora", 1, "transformer", 1)
    # every entry is scored on the same pairs; the base model is what each run evaluated before training ...
    assert all(len(e["scores"]["jpeg"]) == 3 for e in saved["entries"])
    assert base["scores"] == eval_json(trained["lora"], 0) == eval_json(trained["full"], 0)
    # ... and each checkpoint is exactly what its run evaluated after its last iteration (the LoRA: its EMA, exported)
    assert lora["scores"] == eval_json(trained["lora"], 1) and full["scores"] == eval_json(trained["full"], 1)
    assert lora["scores"] != base["scores"] and full["scores"] != base["scores"]


def test_kl_to_base_is_the_path_kl_of_each_checkpoint(trained, tmp_path):
    """--kl-to-base: the base model is 0 from itself; a transformer whose velocity differs from the base's by a
    constant c (proj_out's bias shifted by b: the same shift at every input) is ||c||^2 / 2 from it on every path,
    ||c||^2 = 64 patches x ||b||^2 (each 2x2 patch of the 4 x 16 x 16 latent is 16 packed channels); the trained
    checkpoints are further than 0; every other score is the evaluation's without it (the same ODE steps)."""
    from diffusers import FluxTransformer2DModel

    from common import load_pipeline, pipeline_sigmas

    shifted = FluxTransformer2DModel.from_pretrained(os.path.join(trained["flux"], "transformer"))
    b = 0.1 * torch.randn(shifted.proj_out.bias.shape, generator=torch.Generator().manual_seed(0))
    shifted.proj_out.bias.data += b
    shifted.save_pretrained(tmp_path / "shifted")
    out = tmp_path / "eval"
    run_script("evaluate.py", ["--model", trained["flux"], "--prompts", trained["prompts"], "--checkpoints",
                               trained["lora"], trained["full_dir"], str(tmp_path / "shifted"), "--kl-to-base",
                               "--out", str(out), *TINY_EVAL])
    base, lora, full, shift = json.load(open(out / "scores.json"))["entries"]
    before = json.load(open(trained["out"] / "scores.json"))["entries"]
    for now, then in zip((base, lora, full), before):
        assert {k: v for k, v in now["scores"].items() if k != "kl_to_base"} == then["scores"], now["name"]
    assert base["scores"]["kl_to_base"] == [0.0] * 3
    assert min(lora["scores"]["kl_to_base"]) > 0 and min(full["scores"]["kl_to_base"]) > 0
    sigmas = pipeline_sigmas(*load_pipeline(trained["flux"], "cpu"), num_steps=4, shape=(4, 16, 16))
    expected = 0.5 * float(sigmas[0] - sigmas[-1]) * 64 * b.double().square().sum().item()
    assert shift["scores"]["kl_to_base"] == pytest.approx([expected] * 3, rel=1e-4)


def test_base_scores_equal_diffusers_own_pipeline(trained):
    """An independent computation: FluxPipeline.__call__ (its own schedule, Euler steps and decoding) from the same
    noise, scored by the same JPEG compressibility."""
    from diffusers import FluxPipeline

    from common import jpeg_compressibility

    pipe = FluxPipeline.from_pretrained(trained["flux"])
    pipe.set_progress_bar_config(disable=True)
    prompts = open(trained["prompts"]).read().splitlines()
    noise = torch.stack([torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(10**6 + k)) for k in range(3)])
    images = pipe(prompts, latents=FluxPipeline._pack_latents(noise, 3, 4, 16, 16), num_inference_steps=4,
                  guidance_scale=4.5, height=32, width=32, max_sequence_length=16, output_type="pt").images
    base = json.load(open(trained["out"] / "scores.json"))["entries"][0]
    assert base["scores"]["jpeg"] == jpeg_compressibility(images, prompts).tolist()


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy_run")
    run_script("flow_grpo.py", ["--model", "toy", "--num-iterations", "1", "--eval-every", "0", "--prompts-per-iteration",
                                "1", "--group-size", "3", "--save-every", "1", "--log-images-every", "0", "--output-dir",
                                str(out)])
    return run_dir(out)


def test_toy_world_command(toy_run, tmp_path, monkeypatch):
    """The docs' command on 16 pairs; the preset's 256 pairs (64 held-out prompts x 4 seeds) from the same
    check_args, without scoring them."""
    toy = ["--model", "toy", "--checkpoints", toy_run, "--metrics", "toy_color_position", "toy_shape_count", "toy_strict",
           "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *toy])
    entries, preset_pairs = evaluate.check_args(rundir.parse_args(evaluate.Args, toy=evaluate.TOY, description=""))
    assert len(preset_pairs) == 256 and [e["weights"] for e in entries] == ["base", "transformer"]
    pairs = 16
    proc = run_script("evaluate.py", [*toy, "--num-prompts", "8", "--seeds-per-prompt", "2"])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == ("| entry | iteration | toy_color_position | toy_color_position change | toy_shape_count | "
                       "toy_shape_count change | toy_strict | toy_strict change |")
    assert rows[1].startswith("| base | - | ") and rows[1].count("(reference)") == 3
    assert re.fullmatch(re.escape(f"| {toy_run} | 1 |") + r"( \d\.\d+ \+- \d\.\d+ \| [+-]\d\.\d+ \+- \d\.\d+ \|){3}", rows[2])
    assert f"= {pairs} pairs of toy" in proc.stdout and "16 steps, guidance 3.5, 32 px, 16 tokens" in proc.stdout
    saved = json.load(open(tmp_path / "scores.json"))
    assert [e["weights"] for e in saved["entries"]] == ["base", "transformer"]
    assert all(len(v) == pairs for e in saved["entries"] for v in e["scores"].values())


# ---- bad input: one-line errors before any model loads ----
TOY = os.path.join(ROOT, "toy", "flux-shapes")


def make_dirs(root):
    """Fake checkpoints (no weights are read before the checks pass): a LoRA run trained on toy, a transformer
    directory of another class, one of another architecture, and an incomplete run."""
    def write(path, content=""):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))

    ckpt = os.path.join(root, "run", "checkpoints", "iter_3")
    write(os.path.join(ckpt, "run.json"), {"iteration": 3, "args": {"model": "toy"}})
    from safetensors.torch import save_file

    os.makedirs(os.path.join(ckpt, "lora"))
    save_file({"w": torch.zeros(64)}, os.path.join(ckpt, "lora", evaluate.LORA_FILE))
    cut = os.path.join(root, "cut", "checkpoints", "iter_2")  # its export cut short
    write(os.path.join(cut, "run.json"), {"iteration": 2, "args": {"model": "toy"}})
    os.makedirs(os.path.join(cut, "lora"))
    with open(os.path.join(ckpt, "lora", evaluate.LORA_FILE), "rb") as f, \
            open(os.path.join(cut, "lora", evaluate.LORA_FILE), "wb") as g:
        g.write(f.read()[:-100])
    write(os.path.join(root, "done", "scores.json"), {})
    write(os.path.join(root, "sd3", "config.json"), {"_class_name": "SD3Transformer2DModel"})
    write(os.path.join(root, "sd3", "diffusion_pytorch_model.safetensors"))
    write(os.path.join(root, "wide", "config.json"), {"_class_name": "FluxTransformer2DModel", "num_layers": 5})
    write(os.path.join(root, "wide", "diffusion_pytorch_model.safetensors.index.json"), {"weight_map": {}})
    os.makedirs(os.path.join(root, "empty"))
    os.makedirs(os.path.join(root, "dead", "checkpoints", "iter_1.tmp"))
    write(os.path.join(root, "bare", "run.json"), {"iteration": 1, "args": {"model": "toy"}})
    write(os.path.join(root, "prompts.txt"), "a red circle on the left\na blue square on the top\n")
    write(os.path.join(root, "afile"), "x")


def args_with(root, **over):
    base = dict(model="toy", prompts=os.path.join(root, "prompts.txt"), metrics=("jpeg",), out=os.path.join(root, "o"))
    return dataclasses.replace(evaluate.Args(), **{**base, **over})


def test_every_kind_of_checkpoint_path_resolves(tmp_path):
    make_dirs(str(tmp_path))
    run = str(tmp_path / "run")
    lora = os.path.join(run, "checkpoints", "iter_3", "lora")
    # a run directory, its checkpoint, the LoRA directory itself; 'toy' in run.json is the same model as its path
    entries, pairs = evaluate.check_args(args_with(str(tmp_path), model=TOY, checkpoints=(run, os.path.dirname(lora),
                                                                                          lora), seeds_per_prompt=3))
    assert [e["path"] for e in entries] == [TOY, lora, lora, lora] and [e["iteration"] for e in entries[1:]] == [3] * 3
    assert [e["weights"] for e in entries] == ["base", "lora", "lora", "lora"]
    assert pairs == [(["a red circle on the left", "a blue square on the top"][k % 2], 10**6 + k) for k in range(6)]
    _, pairs = evaluate.check_args(args_with(str(tmp_path), num_prompts=1, seed=2))
    assert pairs == [("a red circle on the left", 3 * 10**6)]


def neither(path):
    return (f"--checkpoints '{path}' is neither a LoRA directory (pytorch_lora_weights.safetensors), a transformer "
            f"directory (config.json and diffusion_pytorch_model.safetensors[.index.json]), a checkpoint (run.json) nor "
            f"a run directory with checkpoints/iter_<N>")


def test_bad_inputs_give_one_line_errors(tmp_path):
    root = str(tmp_path)
    make_dirs(root)
    p = os.path.join
    cases = [
        (dict(checkpoints=(p(root, "nope"),)),
         f"--checkpoints '{p(root, 'nope')}' does not exist; pass a LoRA directory, a transformer directory, a checkpoint "
         f"(runs/<run>/checkpoints/iter_<N>) or a run directory"),
        (dict(checkpoints=(p(root, "empty"),)), neither(p(root, "empty"))),
        (dict(checkpoints=(p(root, "afile"),)), neither(p(root, "afile"))),
        (dict(checkpoints=(p(root, "dead"),)),
         f"--checkpoints '{p(root, 'dead')}' is a run directory without a complete checkpoint (checkpoints/iter_<N>); "
         f"wait for its first checkpoint or pass another"),
        (dict(checkpoints=(p(root, "bare"),)),
         f"--checkpoints '{p(root, 'bare')}': checkpoint '{p(root, 'bare')}' has neither a lora/ nor a transformer/ "
         f"export"),
        (dict(model="sd3.5-medium", checkpoints=(p(root, "run"),)),
         f"--checkpoints '{p(root, 'run')}' was trained with --model 'toy' (its run.json), not 'sd3.5-medium'; pass "
         f"--model toy"),
        (dict(checkpoints=(p(root, "sd3"),)),
         f"--checkpoints '{p(root, 'sd3')}' holds a SD3Transformer2DModel, but --model 'toy' has a "
         f"FluxTransformer2DModel; evaluate it with the model it was trained from"),
        (dict(model="flux-dev", checkpoints=(p(root, "sd3"),)),  # a hub model: its class is known without the hub
         f"--checkpoints '{p(root, 'sd3')}' holds a SD3Transformer2DModel, but --model 'flux-dev' has a "
         f"FluxTransformer2DModel; evaluate it with the model it was trained from"),
        (dict(checkpoints=(p(root, "wide"),)),
         f"--checkpoints '{p(root, 'wide')}' has num_layers=5, but --model 'toy''s transformer has num_layers=2; "
         f"evaluate it with the model it was trained from"),
        (dict(metrics=("jpeg", "fid")), "unknown reward 'fid'; choose from ['hps', 'clip', 'pickscore', 'imagereward', "
         "'aesthetic', 'unifiedreward', 'ocr', 'geneval', 'deqa', 'videoalign_vq', 'videoalign_mq', 'videoalign_ta', "
         "'image_similarity', 'editreward', 'jpeg', 'toy_color_position', 'toy_shape_count', 'toy_strict', "
         "'toy_proxy', 'toy_frame', 'toy_frame_first', 'toy_frame_mean', 'toy_motion', 'toy_consistency', "
         "'toy_video_strict', 'toy_edit', 'toy_preserve', 'toy_edit_strict']"),
        (dict(metrics=evaluate.Args().metrics),
         "the unifiedreward reward needs --unifiedreward-url, the address of a server that serves it"),
        (dict(metrics=("jpeg", "jpeg")), "--metrics jpeg jpeg names a metric twice; name each once"),
        (dict(prompts=p(root, "missing.txt")),
         f"prompt file '{p(root, 'missing.txt')}' does not exist; docs/rewards.md 'Prompt sets' says where each paper's prompts "
         f"come from (or pass any text file with one prompt per line)"),
        (dict(num_prompts=0), "--num-prompts 0 is not allowed; use a value in [1, 1e7]"),
        (dict(seeds_per_prompt=0), "--seeds-per-prompt 0 is not allowed; use a value in [1, 1e4]"),
        (dict(num_prompts=3), f"--num-prompts 3 is more than the 2 prompts of '{p(root, 'prompts.txt')}'; pass fewer, "
         f"or none for all"),
        (dict(steps=0), "--steps 0 is not allowed; use a value in [1, 1000]"),
        (dict(guidance=float("nan")), "--guidance nan is not allowed; use a value in [0, 100]"),
        (dict(checkpoints=(p(root, "cut"),)),
         f"--checkpoints '{p(root, 'cut')}': {p(root, 'cut', 'checkpoints', 'iter_2', 'lora', evaluate.LORA_FILE)} is "
         f"cut short or no safetensors file (228 bytes); export or copy it again"),
        (dict(out=p(root, "done")), f"--out '{p(root, 'done')}' holds an earlier evaluation's scores.json; pass another "
         f"--out, or --overwrite to replace it"),
        (dict(base=False), "nothing to evaluate: pass --checkpoints, or keep --base"),
        (dict(out=p(root, "afile")), f"--out '{p(root, 'afile')}' is a file; pass a directory (scores.json and table.md "
         f"go there)"),
    ]
    for over, message in cases:
        with pytest.raises(SystemExit) as e:
            evaluate.check_args(args_with(root, **over))
        assert str(e.value) == f"error: {message}", over


def test_the_script_stops_before_loading_a_model(tmp_path):
    proc = run_script("evaluate.py", ["--model", "toy", "--checkpoints", str(tmp_path / "nope")], check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: --checkpoints '{tmp_path / 'nope'}' does not exist; pass a LoRA directory, "
                                   f"a transformer directory, a checkpoint (runs/<run>/checkpoints/iter_<N>) or a run "
                                   f"directory")  # one line: no "Loading pipeline components" before it


@pytest.mark.slow
def test_torchrun_two_processes_give_the_same_scores(trained, tmp_path):
    """3 pairs over 2 ranks (2 + 1, the second share padded): the same scores.json as one process."""
    run_script("evaluate.py", ["--model", trained["flux"], "--prompts", trained["prompts"], "--checkpoints",
                               trained["lora"], trained["full_dir"], "--out", str(tmp_path), *TINY_EVAL], nproc=2)
    one, two = (json.load(open(d / "scores.json")) for d in (trained["out"], tmp_path))
    assert two["entries"] == one["entries"] and two["settings"]["world"] == 2
    assert {k: v for k, v in two["settings"].items() if k != "world"} == {
        k: v for k, v in one["settings"].items() if k != "world"}
