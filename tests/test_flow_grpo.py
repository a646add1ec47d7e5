"""flow_grpo.py end to end on tiny random Flux and SD3 pipelines (CPU, offline)."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import read_metrics, run_script, tiny_flags


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_two_iterations_lora(tiny, tmp_path, kind):
    extra = {"guidance": 4.5} if kind == "sd3" else {}
    out = run_script("flow_grpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, ema_every=1, **extra)).stdout
    run, m = read_metrics(tmp_path)
    # the end-of-run summary and the evaluation grids (issue: what a new user sees)
    assert "iteration 0 -> 2, change +- paired standard error" in out and "training reward" in out
    assert f"Sample grids in {os.path.join(run, 'samples')}: eval_0.png, eval_2.png" in out  # the real files
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
    assert last[0].keys() == last[1].keys()
    for k in last[0]:  # (pytest 9's approx takes no nested containers)
        assert last[0][k] == pytest.approx(last[1][k])
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
    """Two processes train (the first ratio is exactly 1, checkpoints written). With LoRA, against one process as
    well: eval_0.json (the base model) holds the same pairs in the same order, and the NFE of an iteration is summed
    over the ranks: the closed form times the prompts of all ranks."""
    extra = {"full_finetune": True, "no_ema": True} if full else {"eval_num": 8}
    flags = dict(prompts_per_iteration=4, **extra)
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "n2", **flags), nproc=2)
    run, m = read_metrics(tmp_path / "n2")
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6
    assert m[2]["perf/nfe_per_iteration"] > 0 and "eval/jpeg" in m[2]
    assert os.path.isdir(os.path.join(run, "checkpoints", "iter_2"))
    if full:
        return
    flags.update(num_iterations=1, eval_every=1, save_every=0)
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "n1", **flags))
    one, m1 = read_metrics(tmp_path / "n1")
    planned = 4 * 4 + 3 * 4 * 2  # per prompt: G T rollout + (trained steps) G (policy + reference)
    for metrics in (m, m1):
        assert metrics[1]["perf/nfe_per_iteration"] == 4 * planned and metrics[1]["perf/nfe_rollout_per_prompt"] == 16
    evals = [json.load(open(os.path.join(r, "eval_0.json"))) for r in (run, one)]
    for k in evals[0]:
        assert evals[0][k] == pytest.approx(evals[1][k], rel=1e-5, abs=1e-6), k


def test_help_documents_every_argument():
    import re

    out = " ".join(re.sub("[│╭╮╰╯─]", " ", run_script("flow_grpo.py", ["--help"]).stdout).split())  # unwrapped
    for flag, doc in [("--group-size", "images per prompt"), ("--noise-level", "SDE noise level"),
                      ("--timestep-fraction", "sampling steps are trained"), ("--beta", "KL coefficient"),
                      ("--resume", "latest checkpoint"), ("--model", "toy")]:
        assert flag in out and doc in out, flag


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_lora_export_loads_at_full_strength(tiny, tmp_path, kind):
    """The exported LoRA, loaded with pipe.load_lora_weights, gives the trained transformer's velocity (it carries
    its alpha: loaded without it, diffusers assumes alpha = rank and applies half of a r4/a8 adapter)."""
    from diffusers import DiffusionPipeline

    from common import make_trainable, select, velocity

    extra = {"guidance": 4.5} if kind == "sd3" else {}
    run_script("flow_grpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, num_iterations=2, eval_every=0,
                                          no_ema=True, learning_rate=3e-2, **extra))
    run, _ = read_metrics(tmp_path)
    ckpt = os.path.join(run, "checkpoints", "iter_2")
    trained = DiffusionPipeline.from_pretrained(tiny[kind]).transformer
    params, _ = make_trainable(trained, kind, lora=(4, 8), reference=False)
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state["trainable"][n])
    pipe = DiffusionPipeline.from_pretrained(tiny[kind])
    base = DiffusionPipeline.from_pretrained(tiny[kind]).transformer
    pipe.load_lora_weights(os.path.join(ckpt, "lora"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g)
    dim = 32 if kind == "flux" else 64
    emb = select({"embeds": torch.randn(1, 16, dim, generator=g), "pooled": torch.randn(1, dim, generator=g)},
                 torch.zeros(2, dtype=torch.long))
    with torch.no_grad():
        v_trained, v_loaded, v_base = (velocity(t, kind, x, torch.tensor(0.7), emb, guidance=3.5)
                                       for t in (trained, pipe.transformer, base))
    assert (v_trained - v_base).abs().max() > 1e-3  # the adapter changed the model
    torch.testing.assert_close(v_loaded, v_trained, rtol=1e-5, atol=1e-6)


def test_resume_applies_the_new_learning_rate_and_says_what_changed(tiny, tmp_path):
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_iterations=1, eval_every=0))
    run, _ = read_metrics(tmp_path)
    out = run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_iterations=2,
                                                eval_every=0, resume=run, learning_rate=3e-5, weight_decay=0.01)).stdout
    assert ("resuming with the checkpoint's arguments; changed on the command line: learning_rate 0.0003 -> 3e-05, "
            "weight_decay 0.0001 -> 0.01, num_iterations 1 -> 2") in out
    groups = torch.load(os.path.join(run, "checkpoints", "iter_2", "state.pt"), weights_only=True)["optimizer"]
    assert [(g["lr"], g["weight_decay"]) for g in groups["param_groups"]] == [(3e-5, 0.01)]


def test_resume_alone_takes_the_checkpoints_arguments(tiny, tmp_path):
    """--resume DIR with no other flag but the new total continues with what the checkpoint recorded (the tiny
    model, its prompts, 32 px, 4 steps, LoRA r4, ...), not the file's SD3.5-M defaults; it says what changed."""
    import json
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_iterations=1, eval_every=0,
                                          learning_rate=1e-3))
    run, _ = read_metrics(tmp_path)
    out = run_script("flow_grpo.py", ["--resume", run, "--num-iterations", "2"]).stdout
    assert "resuming with the checkpoint's arguments; changed on the command line: num_iterations 1 -> 2\n" in out
    saved = [json.load(open(os.path.join(run, "checkpoints", f"iter_{i}", "run.json")))["args"] for i in (1, 2)]
    assert {k for k in saved[0] if saved[0][k] != saved[1][k]} == {"num_iterations", "resume"}
    assert saved[1]["model"] == tiny["flux"] and saved[1]["learning_rate"] == 1e-3


@pytest.mark.slow
def test_no_gradient_anywhere_takes_no_step_on_1_or_2_processes(tiny, tmp_path):
    """The 0/1 reward toy_strict is 0 for every image of a tiny random model: every advantage is 0 and, without a KL,
    no rank has a gradient. Neither 1 nor 2 processes may step (a zero-gradient AdamW step still applies weight
    decay)."""
    from safetensors.torch import load_file

    prompts = tmp_path / "toy.txt"
    prompts.write_text("a red circle on the left\na blue square on the top\n")
    flags = dict(rewards="toy_strict", beta=0.0, eval_every=0, num_iterations=1, prompts_per_iteration=4)
    exports = []
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        run_script("flow_grpo.py", tiny_flags(tiny["flux"], str(prompts), out, **flags), nproc=nproc)
        run, m = read_metrics(out)
        assert m[1]["train/updates"] == 0 and m[1]["reward/zero_std_fraction"] == 1.0
        exports.append(load_file(os.path.join(run, "checkpoints", "iter_1", "lora", "pytorch_lora_weights.safetensors")))
    assert exports[0].keys() == exports[1].keys()
    for k in exports[0]:
        assert torch.equal(exports[0][k], exports[1][k]), k


def test_non_finite_gradient_stops_before_any_checkpoint(tiny, tmp_path, monkeypatch):
    """A training forward that returns NaN (e.g. a bf16 overflow) stops the run with one line, before the optimizer
    steps or a checkpoint is written."""
    import runpy
    import sys

    import common
    from helpers import ROOT

    real = common.velocity

    def overflowing(transformer, kind, x, sigma, emb, *, guidance, detach_uncond=False):
        v = real(transformer, kind, x, sigma, emb, guidance=guidance, detach_uncond=detach_uncond)
        return v * float("nan") if torch.is_grad_enabled() else v

    monkeypatch.setattr(common, "velocity", overflowing)
    flags = tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_iterations=1, eval_every=0, save_every=1)
    monkeypatch.setattr(sys, "argv", ["flow_grpo.py", *flags])
    with pytest.raises(SystemExit, match=r"error: the gradient norm is nan; the run stops before the weights or a "
                                         r"checkpoint change"):
        runpy.run_path(os.path.join(ROOT, "flow_grpo.py"), run_name="__main__")
    (run,) = os.listdir(tmp_path)
    assert not os.path.exists(os.path.join(tmp_path, run, "checkpoints"))


def test_prompt_encoding_moves_the_text_encoders_once_per_call():
    """40 prompts, 16 at a time through the encoders: each encoder goes to the transformer's device and back once
    (T5-XXL is 9.5 GiB each way), not once per 16 prompts; an encoder already there (the text cache's fill) stays."""
    import types

    from common import encode_prompts

    moves, calls = [], []
    encoders = [types.SimpleNamespace(to=lambda d, i=i: moves.append((i, str(d))), device=torch.device("cpu"))
                for i in range(2)]

    def encode_prompt(batch, prompt_2=None, device=None, max_sequence_length=16):
        calls.append(len(batch))
        return torch.zeros(len(batch), 16, 8), torch.zeros(len(batch), 8), None

    pipe = types.SimpleNamespace(text_encoder=encoders[0], text_encoder_2=encoders[1], encode_prompt=encode_prompt,
                                 transformer=types.SimpleNamespace(device=torch.device("cuda:0")))
    emb = encode_prompts(pipe, "flux", [f"prompt {i}" for i in range(40)], max_sequence_length=16)
    assert calls == [16, 16, 8] and emb["embeds"].shape == (40, 16, 8)
    assert moves == [(0, "cuda:0"), (1, "cuda:0"), (0, "cpu"), (1, "cpu")]
    encoders[1].device = torch.device("cuda:0")
    moves.clear()
    encode_prompts(pipe, "flux", ["a prompt"], max_sequence_length=16)
    assert moves == [(0, "cuda:0"), (0, "cpu")]


@pytest.mark.slow
def test_metrics_count_every_rank_when_the_ranks_differ(tmp_path):
    """2 ranks, one prompt each, trained on the 0/1 toy_strict without KL: a group whose samples all score the same
    has zero advantages and skips its training forwards, so the ranks do different work. perf/nfe_per_iteration is
    the sum over the ranks (rank 0's count times 2 would be wrong in exactly these iterations)."""
    import dataclasses

    import flow_grpo

    flags = ["--model", "toy", "--rewards", "toy_strict", "--eval-rewards", "--prompts-per-iteration", "2",
             "--num-iterations", "6", "--eval-every", "0", "--save-every", "0", "--beta", "0", "--no-full-finetune",
             "--lora-rank", "4", "--lora-alpha", "8", "--log-images-every", "0", "--output-dir", str(tmp_path)]
    run_script("flow_grpo.py", flags, nproc=2)
    _, m = read_metrics(tmp_path)
    plan = flow_grpo.planned_nfe(dataclasses.replace(flow_grpo.Args(), **{**flow_grpo.TOY, "beta": 0.0}))  # per prompt
    uneven = 0
    for it in range(1, 7):
        busy = round(2 * (1 - m[it]["reward/zero_std_fraction"]))  # groups with a reward spread
        assert m[it]["perf/nfe_per_iteration"] == 2 * plan["rollout"] + busy * plan["train"], (it, m[it])
        uneven += busy == 1
    assert uneven > 0  # at least one iteration where one rank trained and the other did not


def official_sde_step(v, x, x_next, sigmas, i: int, noise_level: float):
    """sde_step_with_logprob (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:37-92, sde_type 'sde',
    return_sqrt_dt) written out for a batch at step i: (log_prob [B], prev_sample_mean, std_dev_t [B, 1, 1, 1],
    sqrt(-dt) [B, 1, 1, 1])."""
    v, x, x_next = v.float(), x.float(), x_next.float()
    sigma = sigmas[i].float().expand(len(x)).view(-1, 1, 1, 1)
    sigma_prev = sigmas[i + 1].float().expand(len(x)).view(-1, 1, 1, 1)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    log_prob = (-((x_next.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return log_prob, prev_sample_mean, std_dev_t, torch.sqrt(-1 * dt)


def official_guard_loss(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, adv, clip_range, *, per_sample=False):
    """train_sd3_GRPO_Guard.py:910-932 (config.rationorm, beta 0) for one micro-batch at one step. The bias's
    `.mean(dim=tuple(range(1, log_prob.ndim)))` with a 1-d log_prob reduces over every dimension (torch's dim=()):
    one value per micro-batch; per_sample: verl-omni's GRPOGuardLoss (a value per sample), for comparison."""
    adv = torch.clamp(adv, -5.0, 5.0)  # adv_clip_max (config/base.py)
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (mean - old_mean).pow(2).mean(dim=(1, 2, 3) if per_sample else tuple(range(1, log_prob.ndim)))
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    return policy_loss / (sqrt_dt.mean() ** 2), ratio


def test_guard_update_is_the_official_one(tiny, tmp_path, monkeypatch):
    """--guard, one iteration of two optimizer steps on a tiny SD3 (LoRA, no CFG): the logged policy loss of both
    mini-batches and the second step's gradient (its ratio away from 1) equal GRPO-Guard's official loss written
    out here (train_sd3_GRPO_Guard.py:903-932 on sd3_sde_with_logprob.py, accumulated as accelerate does: the mean
    over the (micro-batch, step) terms) from the run's samples, advantages and mini-batches alone."""
    import common
    from helpers import run_in_process

    seen = {"rollout": [], "terms": [], "steps": []}
    clip_range, lr, a = 0.05, 3e-2, 0.7

    def keep_rollout(real):  # the rollout's latents at every step, its embeddings and rows
        def spy(transformer, kind, x, sigma, emb, *, rows, chunks, guidance):
            seen["rollout"].append(x.clone())
            seen["emb"], seen["rows"] = emb, rows
            return real(transformer, kind, x, sigma, emb, rows=rows, chunks=chunks, guidance=guidance)
        return spy

    def keep(name, many=False):
        def wrap(real):
            def spy(*a, **k):
                out = real(*a, **k)
                seen[name].append(out) if many else seen.__setitem__(name, out)
                return out
            return spy
        return wrap

    def start_run_spy(real):
        def spy(*a, **k):
            run = seen["run"] = real(*a, **k)
            real_step = run.optimizer_step

            def optimizer_step(terms):
                seen["steps"].append({n: p.detach().clone() for n, p in run.params.items()})
                u = len(seen["steps"]) - 1
                if u == 1:
                    seen["file_gradient"] = {n: p.grad.clone() for n, p in run.params.items()}
                nfe = common.NFE["count"]
                seen.setdefault("official_loss", []).append(official(run, u, gradient=u == 1))
                common.NFE["count"] = nfe  # the test's forwards are not the file's
                return real_step(terms)
            run.optimizer_step = optimizer_step
            return run
        return spy

    def official(run, u, gradient, per_sample=False):
        """Mini-batch u's official loss (and, with gradient, its gradient) at the weights now."""
        x, params = seen["rollout"], run.params
        sigmas = common.pipeline_sigmas(run.pipe, "sd3", num_steps=4, shape=run.shape)
        adv = seen["advantages"].reshape(-1)
        now = {n: p.detach().clone() for n, p in params.items()}

        def v_of(j, c):
            emb = common.select(seen["emb"], seen["rows"][c])
            return common.velocity(run.transformer, "sd3", x[j][c], sigmas[j], emb, guidance=1.0)

        terms = seen["terms"][u]
        with torch.no_grad():  # the rollout's log-probs and means: the initial weights
            for n, p in params.items():
                p.copy_(seen["steps"][0][n])
            old = [official_sde_step(v_of(j, c), x[j][c], x[j + 1][c], sigmas, j, a)[:2] for j, c, _ in terms]
            for n, p in params.items():
                p.copy_(now[n])
        losses = []
        with torch.set_grad_enabled(gradient):
            for (j, c, _), (old_log_prob, old_mean) in zip(terms, old):
                log_prob, mean, std_dev_t, sqrt_dt = official_sde_step(v_of(j, c), x[j][c], x[j + 1][c], sigmas, j, a)
                loss, _ = official_guard_loss(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, adv[c],
                                              clip_range, per_sample=per_sample)
                losses.append(loss)
        loss = torch.stack(losses).mean()  # accelerate: each term's loss / the accumulated terms
        if gradient:
            grads = torch.autograd.grad(loss, list(params.values()))
            seen["official_gradient" + ("_per_sample" if per_sample else "")] = dict(zip(params, grads))
            if not per_sample:
                official(run, u, gradient, per_sample=True)
        return [float(v.detach()) for v in losses]

    flags = tiny_flags(tiny["sd3"], tiny["prompts"], tmp_path, guidance=1.0, num_iterations=1, eval_every=0,
                       updates_per_iteration=2, guard=True, beta=0.0, clip_range=clip_range, learning_rate=lr,
                       no_global_std=True)
    run_in_process("flow_grpo.py", flags, monkeypatch, wrap={
        "start_run": start_run_spy, "velocities": keep_rollout, "combined_advantages": keep("advantages"),
        "micro_batches": keep("terms", many=True)})

    assert len(seen["steps"]) == 2 and [len(t) for t in seen["terms"]] == [3, 3]  # 3 trained steps, 4 samples each
    flat = lambda g: torch.cat([g[n].flatten() for n in sorted(g)])  # noqa: E731
    file, official_grad = flat(seen["file_gradient"]), flat(seen["official_gradient"])
    error = ((file - official_grad).norm() / official_grad.norm()).item()
    other = ((flat(seen["official_gradient_per_sample"]) - official_grad).norm() / official_grad.norm()).item()
    print(f"relative gradient error {error:.1e}; a per-sample bias (verl-omni) differs by {other:.1e}")
    assert error < 1e-5
    _, m = read_metrics(tmp_path)
    losses = seen["official_loss"][0] + seen["official_loss"][1]
    scale = sum(map(abs, losses)) / len(losses)  # the terms' mean nearly cancels (the advantages sum to ~0)
    print("official per-term losses", losses, "logged mean", m[1]["train/policy_loss"])
    assert abs(m[1]["train/policy_loss"] - sum(losses) / len(losses)) < 1e-5 * scale
    assert m[1]["train/ratio_mean"] != 1 and m[1]["train/first_ratio_max_dev"] <= 1e-6
