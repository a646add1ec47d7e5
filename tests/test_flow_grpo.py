"""flow_grpo.py end to end on tiny random Flux and SD3 pipelines (CPU, offline)."""
import json
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
    out = run_script("flow_grpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, ema_every=1, **extra)).stdout
    run, m = read_metrics(tmp_path)
    # the end-of-run summary and the evaluation grids (issue: what a new user sees)
    assert "iteration 0 -> 2, change +- paired standard error" in out and "training reward" in out
    assert "eval_<iteration>.png" in out
    assert f"pipe.load_lora_weights('{os.path.join(run, 'checkpoints', 'iter_2', 'lora')}')" in out
    assert sorted(os.listdir(os.path.join(run, "samples"))) == ["eval_0.png", "eval_2.png"]
    for it in (1, 2):
        assert m[it]["train/first_ratio_max_dev"] <= 1e-6  # on-policy: identical numerics in sampling and training
        assert m[it]["perf/nfe_rollout_per_prompt"] == m[it]["perf/nfe_min_per_prompt"] == 4 * 4  # G * T
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


@pytest.mark.slow
def test_resume_after_a_kill_reads_like_one_run(tiny, tmp_path):
    """A run killed after logging iteration 3 but before its checkpoint resumes from iter_2: metrics.jsonl, eval_3.json
    and samples/eval_3.png are rewritten, never duplicated, and equal the uninterrupted run's."""
    flags = dict(num_iterations=3, eval_every=1, save_every=2, ema_every=1)
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "full", **flags))
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "part", **flags))
    run, _ = read_metrics(tmp_path / "part")
    import shutil

    shutil.rmtree(os.path.join(run, "checkpoints", "iter_3"))  # killed before the last checkpoint was published
    os.remove(os.path.join(run, "eval_2.json"))  # resuming from iter_2 keeps what it logged up to iteration 2 ...
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "part", resume=run, **flags))
    full_run, _ = read_metrics(tmp_path / "full")
    rows = lambda r: [json.loads(line) for line in open(os.path.join(r, "metrics.jsonl"))]  # noqa: E731
    a, b = rows(full_run), rows(run)
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b] == [0, 1, 1, 2, 2, 3, 3]
    for ra, rb in zip(a, b):
        assert {k: v for k, v in ra.items() if "seconds" not in k} == pytest.approx(
            {k: v for k, v in rb.items() if "seconds" not in k}, rel=1e-6, abs=1e-12)
    assert not os.path.exists(os.path.join(run, "eval_2.json"))  # ... and does not re-evaluate iteration 2
    last = [json.load(open(os.path.join(r, "eval_3.json"))) for r in (run, full_run)]
    assert last[0] == pytest.approx(last[1])
    assert sorted(os.listdir(os.path.join(run, "samples"))) == ["eval_0.png", "eval_1.png", "eval_2.png", "eval_3.png"]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter_2", "iter_3"]


def test_keep_only_the_newest_checkpoints(tiny, tmp_path):
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_iterations=3, eval_every=0,
                                          save_every=1, keep_checkpoints=2))
    run, _ = read_metrics(tmp_path)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter_2", "iter_3"]


@pytest.mark.slow
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


@pytest.mark.slow
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
