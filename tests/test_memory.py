"""Memory-saving paths give the same numbers: activation checkpointing, FSDP2 (float32 and bf16 parameter policies)
against one process on the whole batch, and a sharded run's resume and exported weights."""
import os

import pytest
import torch

from common import make_trainable, select, shifted_sigmas, velocity
from flow_grpo import sde_step
from helpers import crashed_copy, read_metrics, run_script, tiny_flags
from tiny import build_flux, build_sd3


def loss_and_grads(kind, *, checkpointing, lora):
    """One PPO-clip loss through common.velocity on a fixed batch; returns the gradients and how often block 0 ran."""
    pipe = build_flux(seed=0) if kind == "flux" else build_sd3(seed=0)
    transformer = pipe.transformer
    params, _ = make_trainable(transformer, kind, lora=(4, 8) if lora else None, reference=False,
                               checkpointing=checkpointing)
    params = list(params.values())
    if lora:  # LoRA B starts at 0: move it so that every adapter has a gradient path
        with torch.no_grad():
            for p in params:
                p.add_(0.01)
    calls = []
    transformer.transformer_blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    transformer.train()
    g = torch.Generator().manual_seed(1)
    x, x_next = torch.randn(3, 4, 16, 16, generator=g), torch.randn(3, 4, 16, 16, generator=g)
    text = 32 if kind == "flux" else 64
    emb = {"embeds": torch.randn(3, 16, text, generator=g), "pooled": torch.randn(3, text, generator=g)}
    sigmas = shifted_sigmas(4, shift=3.0)
    v = velocity(transformer, kind, x, sigmas[1], select(emb, torch.arange(3)), guidance=3.5)
    _, log_prob, _, _ = sde_step(v, x, sigmas, 1, 0.7, prev_sample=x_next)
    ratio, adv = torch.exp(log_prob - log_prob.detach()), torch.tensor([1.0, -0.5, 0.3])
    torch.max(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)).mean().backward()  # the files' PPO loss
    return [p.grad.clone() for p in params], len(calls)


@pytest.mark.parametrize("kind,lora", [("flux", False), ("sd3", False), ("flux", True)])
def test_gradient_checkpointing_gives_the_same_gradients(kind, lora):
    plain, n_plain = loss_and_grads(kind, checkpointing=False, lora=lora)
    ckpt, n_ckpt = loss_and_grads(kind, checkpointing=True, lora=lora)
    assert (n_plain, n_ckpt) == (1, 2)  # checkpointing really recomputed the block in the backward pass
    assert sum(bool(g.abs().sum() > 0) for g in plain) > 0.8 * len(plain)  # (SD3: the last block ignores some inputs)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def rel_diff(a, b):
    return (sum(((a[k] - b[k]) ** 2).sum() for k in a) / sum((a[k] ** 2).sum() for k in a)).sqrt().item()


MODES = ["plain", "checkpointing", "bf16", "lora", "awm", "lora,awm", "dpo", "lora,dpo", "crd", "lora,crd", "wan",
         "wan,checkpointing", "wan,lora"]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """tests/dist_grad.py's gradients and one optimizer step in every mode, on 1 process (in this one) and on 2
    (torchrun): {1: {mode: result}, 2: {mode: result}}, each launch doing all the modes."""
    out = tmp_path_factory.mktemp("dist_grad")
    run_script("tests/dist_grad.py", [str(out / "one.pt"), *MODES])
    run_script("tests/dist_grad.py", [str(out / "two.pt"), *MODES], nproc=2)
    return {n: torch.load(out / f"{name}.pt") for n, name in ((1, "one"), (2, "two"))}


@pytest.mark.slow
def test_fsdp2_gradient_equals_the_full_batch_gradient(steps):
    """2 ranks x half the batch, FSDP2 full fine-tuning, PPO + KL: measured 2e-7 relative to one process in float32;
    with the bf16 parameter policy 3.4e-3 relative to one process under bf16 autocast (both bf16 runs differ from
    float32 by ~0.12 here: the tiny model's KL gradient is of the order of bf16 rounding)."""
    single, sharded = steps[1]["plain"]["grads"], steps[2]["plain"]["grads"]
    assert single.keys() == sharded.keys() and rel_diff(single, sharded) < 1e-5
    assert rel_diff(single, steps[2]["checkpointing"]["grads"]) < 1e-5
    assert rel_diff(steps[1]["bf16"]["grads"], steps[2]["bf16"]["grads"]) < 1e-2


@pytest.mark.slow
def test_fsdp2_gradient_of_a_video_model_equals_the_full_batch_gradient(steps):
    """Wan (toy/tiny_video.py: latents with a frame axis, true CFG through both predictions) fully fine-tuned under
    FSDP2 over its blocks on 2 ranks x half the batch: the gradient of one process on the whole batch, with and without
    activation checkpointing (DanceGRPO #110: its Wan script never wrapped the model, so ranks trained apart)."""
    single = steps[1]["wan"]["grads"]
    assert len(single) > 0 and sum(bool(g.abs().sum() > 0) for g in single.values()) > 0.9 * len(single)
    for mode in ("wan", "wan,checkpointing"):
        assert single.keys() == steps[2][mode]["grads"].keys() and rel_diff(single, steps[2][mode]["grads"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "lora", "awm", "lora,awm", "dpo", "lora,dpo", "crd", "lora,crd", "wan",
                                  "wan,lora"],
                         ids=["fsdp2", "lora-ddp", "awm-fsdp2", "awm-lora-ddp", "dpo-fsdp2", "dpo-lora-ddp",
                              "crd-fsdp2", "crd-lora-ddp", "wan-fsdp2", "wan-lora-ddp"])
def test_one_optimizer_step_is_the_same_on_one_and_two_processes(steps, mode):
    """The same batch, split over 2 ranks, gives the same weights after common.optimizer_step (gradient averaging,
    norm clipping, AdamW) as one process with all of it: FSDP2 full fine-tuning and DDP-style LoRA; Flow-GRPO's loss,
    AWM's (whose KL-EMA forward swaps a weight set into the FSDP2 shards), DPO's (a pair per rank, the reference swapped
    in) and CRD's (a group per rank, centred on its own, the old model swapped in)."""
    (start, one), (start2, two) = ((steps[n][mode]["before"], steps[n][mode]["updated"]) for n in (1, 2))
    assert one.keys() == two.keys() == start.keys() and len(one) > 0
    assert all(torch.equal(start[k], start2[k]) for k in start)
    moved = [k for k in one if not torch.equal(one[k], start[k])]
    assert len(moved) == len(one), set(one) - set(moved)  # the step moved every trainable tensor
    for k in one:  # Adam's first step is lr sign(g) for |g| >> eps: rounding moves it only where |g| ~ eps
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-5)  # 1% of the step, lr 1e-3
        assert (two[k] - one[k]).abs().max() < 1e-2 * (one[k] - start[k]).abs().max()


@pytest.mark.slow
def test_sharded_resume_and_export(tiny, tmp_path):
    """FSDP2 checkpoints (torch.distributed.checkpoint shards, no gathering on rank 0) resume exactly, and the exported
    per-rank safetensors load with from_pretrained."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    flags = dict(full_finetune=True, no_ema=True, prompts_per_iteration=4, eval_every=0, beta=0.04, learning_rate=1e-3,
                 gradient_checkpointing=True)
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "full", num_iterations=3, **flags), nproc=2)
    part = crashed_copy(tmp_path / "full", tmp_path / "part", after=2)
    assert os.path.isdir(os.path.join(part, "checkpoints", "iter_2", "dcp"))
    run_script("flow_grpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "part", num_iterations=3, resume=part,
                                          **flags), nproc=2)
    assert os.path.isdir(os.path.join(part, "checkpoints", "iter_3"))  # iteration 3 trained again
    full, a = read_metrics(tmp_path / "full")
    _, b = read_metrics(tmp_path / "part")
    keys = [k for k in a[3] if not k.startswith("perf/") or "nfe" in k]
    for k in keys:
        assert a[3][k] == pytest.approx(b[3][k], rel=1e-6, abs=1e-12), k
    export = os.path.join(full, "checkpoints", "iter_3", "transformer")
    assert sorted(f for f in os.listdir(export) if f.endswith(".safetensors")) == [
        "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
    loaded = FluxTransformer2DModel.from_pretrained(export)
    base = load_file(os.path.join(tiny["flux"], "transformer", "diffusion_pytorch_model.safetensors"))
    trained = loaded.state_dict()
    assert trained.keys() == base.keys()
    assert sum(not torch.equal(base[k], trained[k]) for k in base) > len(base) // 2


@pytest.mark.slow
def test_distributed_checks(tmp_path):
    """tests/dist_checks.py on 2 ranks: FSDP2 blocks receive RoPE in float32 (as an unsharded bf16 model's do), a
    sharded reference's FSDP2 forward record stays bounded over 5 iterations, and the resumed checkpoint is rank
    0's choice on every rank even when another rank's directory listing would pick another one."""
    import dataclasses
    import json

    import flow_grpo

    root = tmp_path / "run"
    for it in (1, 2):
        ckpt = root / "checkpoints" / f"iter_{it}"
        ckpt.mkdir(parents=True)
        run = {"iteration": it, "script": "flow_grpo.py", "world": 2, "sharded": False,
               "args": dataclasses.asdict(flow_grpo.Args())}
        (ckpt / "run.json").write_text(json.dumps(run))
    out = tmp_path / "checks.json"
    run_script("tests/dist_checks.py", [str(out), str(root)], nproc=2, timeout=300)
    result = json.loads(out.read_text())
    for block in ("FluxTransformerBlock", "FluxSingleTransformerBlock"):
        sharded, unsharded = result["dtypes"]["sharded"][block], result["dtypes"]["unsharded"][block]
        assert sharded["rope"] == unsharded["rope"] == ["torch.float32", "torch.float32"], result["dtypes"]
        assert sharded == unsharded
    assert result["bookkeeping"] == [0] * 5, result["bookkeeping"]  # was 9, 18, 27, ... before forget_forwards
    expected = [str(root / "checkpoints" / "iter_2"), 2]
    assert result["resume"] == [expected, expected], result["resume"]


@pytest.mark.parametrize("forked", [False, True], ids=["processes", "forked"])
def test_the_rank_launcher_sets_the_group_and_stops_the_ranks_when_one_fails(tmp_path, forked):
    """tests/helpers.run_ranks, the tests' torchrun, with new processes and with ranks forked by
    tests/fork_server.py, alike: each rank gets the environment given, its RANK, WORLD_SIZE and the same free
    MASTER_PORT, and its stdout and stderr come back in rank order; a rank ends as a script's process ends
    (its threads joined, then its atexit handlers; a SystemExit's message, an exception's last line, Ctrl-C's
    -2);
    when one rank fails the other (which would wait at its next collective) is stopped at once and the failed
    rank's code is returned; a run past its timeout is stopped and raises."""
    import subprocess
    import sys
    import time

    from helpers import run_ranks, script_env

    env = script_env()  # that of the 2-process runs: their fork server's, where one has started
    script = tmp_path / "rank.py"

    def run(source, timeout=60):
        script.write_text(source)
        return run_ranks([sys.executable, str(script)], 2, env=env, timeout=timeout, forked=forked)

    t0 = time.time()
    proc = run("import os, sys, time\nr = os.environ['RANK']\nprint(r, os.environ['WORLD_SIZE'], "
               "os.environ['MASTER_PORT'], os.environ['OMP_NUM_THREADS'], flush=True)\n"
               "print('err', r, file=sys.stderr)\nsys.exit(3) if r == '1' else time.sleep(60)\n")
    assert proc.returncode == 3 and time.time() - t0 < 30
    (zero, one) = [line.split() for line in proc.stdout.splitlines()]
    assert zero[:2] == ["0", "2"] and one[:2] == ["1", "2"] and zero[2] == one[2] and zero[3] == one[3] == "1"
    assert proc.stderr == "err 0\nerr 1\n"
    proc = run("import atexit, threading, time\natexit.register(print, 'atexit')\n"
               "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\nprint('main')\n")
    assert proc.returncode == 0 and proc.stdout == "main\nthread\natexit\n" * 2
    proc = run("import sys\nsys.exit('a message')\n")
    assert proc.returncode == 1 and proc.stderr == "a message\na message\n"
    proc = run("raise ValueError('no')\n")
    assert proc.returncode == 1 and proc.stderr.count("ValueError: no\n") == 2
    assert run("raise KeyboardInterrupt\n").returncode == -2
    with pytest.raises(subprocess.TimeoutExpired):
        run("import time\ntime.sleep(60)\n", timeout=1)
