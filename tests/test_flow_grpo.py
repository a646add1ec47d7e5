"""flow_grpo.py end to end on tiny random Flux and SD3 pipelines (CPU, offline)."""
import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import read_metrics, run_script, tiny_flags, tiny_model_dirs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dirs(str(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_two_iterations_lora(tiny, tmp_path, kind):
    extra = {"guidance": 4.5} if kind == "sd3" else {}
    run_script("flow_grpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, ema_every=1, **extra))
    run, m = read_metrics(tmp_path)
    for it in (1, 2):
        assert m[it]["train/first_ratio_max_dev"] <= 1e-6  # on-policy: identical numerics in sampling and training
        assert m[it]["perf/nfe_rollout_per_prompt"] == 4 * 4  # G * T
    assert {"eval/jpeg", "reward/jpeg_mean", "train/clipfrac", "train/approx_kl", "train/kl"} <= set(m[2])
    lora = load_file(os.path.join(run, "checkpoints", "iter_2", "lora", "pytorch_lora_weights.safetensors"))
    lora_b = [v for k, v in lora.items() if "lora_B" in k or "lora_up" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # B starts at zero: the exported EMA adapter has learned
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_1", "state.pt"))
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run))


def test_full_finetune_changes_weights(tiny, tmp_path):
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, full_finetune=True, beta=0.04,
                                          no_ema=True, learning_rate=1e-3))
    run, m = read_metrics(tmp_path)
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6 and m[2]["train/kl"] > 0
    before = load_file(os.path.join(tiny["flux"], "transformer", "diffusion_pytorch_model.safetensors"))
    after = load_file(os.path.join(run, "checkpoints", "iter_2", "transformer", "diffusion_pytorch_model.safetensors"))
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2


def test_resume_matches_uninterrupted_run(tiny, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], full, num_iterations=3, eval_every=0,
                                          ema_every=1))
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], part, num_iterations=2, eval_every=0,
                                          ema_every=1))
    run, _ = read_metrics(part)
    os.makedirs(os.path.join(run, "checkpoints", "iter_3.tmp"))  # a checkpoint killed mid-write is ignored
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], part, num_iterations=3, eval_every=0,
                                          ema_every=1, resume=run))
    _, a = read_metrics(full)
    _, b = read_metrics(part)
    keys = [k for k in a[3] if not k.startswith("perf/") or "nfe" in k]
    assert len(keys) > 10
    for k in keys:
        assert a[3][k] == pytest.approx(b[3][k], rel=1e-6, abs=1e-12), k


@pytest.mark.parametrize("full", [False, True], ids=["lora-ddp", "full-fsdp2"])
def test_torchrun_two_processes(tiny, tmp_path, full):
    extra = {"full_finetune": True, "no_ema": True} if full else {}
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, prompts_per_iteration=4, **extra),
               nproc=2)
    run, m = read_metrics(tmp_path)
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6
    assert m[2]["perf/nfe_per_iteration"] > 0 and "eval/jpeg" in m[2]
    assert os.path.isdir(os.path.join(run, "checkpoints", "iter_2"))


def test_help_documents_every_argument():
    out = run_script("flow_grpo.py", ["--help"]).stdout
    for flag, doc in [("--group-size", "images per prompt"), ("--noise-level", "SDE noise level"),
                      ("--timestep-fraction", "fraction of the T steps"), ("--beta", "KL coefficient"),
                      ("--resume", "latest checkpoint"), ("--model", "toy")]:
        assert flag in out and doc in out, flag
