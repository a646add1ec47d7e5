"""The gradient of the PPO-clip + KL loss through common.velocity on a fixed batch of 4, on tiny Flux, and the
weights after one common.optimizer_step (AdamW, norm clipping) with it, for each of several modes in one launch.

    python tests/dist_grad.py OUT.pt MODE [MODE ...]               # one process, the whole batch
    torchrun --nproc_per_node 2 tests/dist_grad.py OUT.pt MODE [...]  # each rank half of the batch: FSDP2 (full
                                                                    # fine-tuning) or DDP-style LoRA

A MODE is a comma-separated set of flags, or "plain": checkpointing (activation checkpointing), bf16, lora, awm
(awm.py's loss instead: the PPO-clipped ratio of flow-matching log-probs, the KL to the reference and to a KL-EMA
weight set swapped in with common.swapped_in: DTensor shards under FSDP2), dpo (dpo.py's: a pair per rank, its
reference a weight set swapped in), crd (crd.py's: a group of 2 per rank centred on its own, the old model swapped
in, the reward-adaptive KL to the guided reference), wan (the tiny Wan2.1 of toy/tiny_video.py instead of Flux:
video latents [4, 3, 8, 8], true CFG against a negative embedding).

Writes {MODE: {"grads": {name: full gradient}, "before" / "updated": {name: trainable weight before / after the
step}}} (rank 0); tests/test_memory.py compares the files.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]
from awm import awm_log_prob  # noqa: E402
from crd import centred_reward_loss  # noqa: E402
from common import (as_reference, close_distributed, make_trainable, optimizer_step, select, setup_distributed,  # noqa: E402
                    shifted_sigmas, swapped_in, velocity)
from flow_grpo import sde_step  # noqa: E402
from tiny import build_flux  # noqa: E402
from tiny_video import build_wan  # noqa: E402


def one_step(flags: set, rank: int, world: int) -> dict:
    """The gradients and the weights before and after one optimizer step, in the mode `flags`."""
    kind = "wan" if "wan" in flags else "flux"
    transformer = (build_wan(seed=0) if kind == "wan" else build_flux(seed=0)).transformer.requires_grad_(False)
    with torch.no_grad():  # a reference that differs from the policy, so that the KL has a gradient
        for p in transformer.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    amp = torch.bfloat16 if "bf16" in flags else None
    lora = "lora" in flags
    sharded = world > 1 and not lora
    params, ref = make_trainable(transformer, kind, lora=(4, 8) if lora else None,
                                 reference=True, sharded=sharded, compute_dtype=amp,
                                 checkpointing="checkpointing" in flags)
    with torch.no_grad():
        if ref is not None:  # full fine-tuning: a frozen copy, made to differ from the policy
            for p in ref.parameters():
                p.mul_(0.99)
        else:  # LoRA: the reference is the model without adapters, so make the adapters non-zero
            g0 = torch.Generator().manual_seed(2)
            for p in params.values():
                p.copy_(0.01 * torch.randn(p.shape, generator=g0))
    transformer.train()
    g = torch.Generator().manual_seed(1)
    n = 4
    shape, guidance = ((4, 3, 8, 8), 4.0) if kind == "wan" else ((4, 16, 16), 3.5)
    x, x_next = torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)
    emb = {"embeds": torch.randn(n, 16, 32, generator=g), "pooled": torch.randn(n, 32, generator=g)}
    if kind == "wan":  # UMT5 embeddings of 16 channels, and the negative prompt's for true CFG
        emb = {"embeds": torch.randn(n, 16, 16, generator=g), "neg_embeds": torch.randn(n, 16, 16, generator=g)}
    advantages, sigmas = torch.randn(n, generator=g), shifted_sigmas(4, shift=3.0)
    rows = torch.arange(rank * n // world, (rank + 1) * n // world)  # this rank's half (or all of it)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None and world == 1)
    if "dpo" in flags or "crd" in flags:  # rows 2k, 2k + 1: a pair (winner, loser) or a group of 2 on each rank
        copy = [p.detach().clone().mul_(0.9) for p in params.values()]  # the reference (dpo), the old model (crd)
        t = torch.tensor([0.7, 0.4, 0.6, 0.3])[rows]
        x0, eps = x[rows], x_next[rows] if "crd" in flags else x_next[rows // 2 * 2]  # a pair shares its noise
        x_t, e = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps, select(emb, rows)
        with torch.no_grad(), autocast, swapped_in(list(params.values()), copy):
            v_copy = velocity(transformer, "flux", x_t, t, e, guidance=3.5)
        with autocast:
            v = velocity(transformer, "flux", x_t, t, e, guidance=3.5)
        if "dpo" in flags:  # dpo.py's loss
            mse, mse_ref = (((w.double() - (eps - x0).double()) ** 2).mean(dim=(1, 2, 3)) for w in (v, v_copy))
            d = mse - mse_ref
            loss = -torch.nn.functional.logsigmoid(-0.5 * 30.0 * (d[0::2] - d[1::2])).mean()  # winners, losers
        else:  # crd.py's: the implicit reward's adaptive errors, the centred loss, the reward-adaptive KL
            target, v, v_copy = eps - x0, v.float(), v_copy.float()
            weight = lambda w: (w.detach().double() - target).abs().mean((1, 2, 3), keepdim=True)  # noqa: E731
            r_theta = -((v - target) ** 2 / weight(v) - (v_copy - target) ** 2 / weight(v_copy)).mean((1, 2, 3))
            r = torch.sigmoid(advantages[rows])
            loss = centred_reward_loss(r_theta, r, torch.arange(len(rows)) // 2, beta=1.0, loss="mse",
                                       temperature=-1.0).mean() * 5.0
            with torch.no_grad(), as_reference(transformer, ref) as reference:
                v_ref = velocity(reference, "flux", x_t, t, e, guidance=4.5)
            low = 1e-4 / 0.1
            loss = loss + 0.1 * ((low + r * (1 - low)) * ((v - v_ref.float()) ** 2).mean((1, 2, 3))).mean()
    elif "awm" in flags:  # awm.py's order: the KL-EMA's forward (weights swapped in place) before the policy's
        kl_ema = [p.detach().clone().mul_(0.9) for p in params.values()]
        t, x0, eps = 0.6, x[rows], x_next[rows]
        x_t, e = (1 - t) * x0 + t * eps, select(emb, rows)
        with torch.no_grad(), autocast, swapped_in(list(params.values()), kl_ema):
            v_ema = velocity(transformer, "flux", x_t, t, e, guidance=3.5)
        with autocast:
            v = velocity(transformer, "flux", x_t, t, e, guidance=3.5).double()
        log_prob = awm_log_prob(v, eps - x0, t, weighting="ghuber", power=0.25)
        with torch.no_grad(), as_reference(transformer, ref) as reference:
            v_ref = velocity(reference, "flux", x_t, t, e, guidance=3.5)
        ratio, adv = torch.exp(log_prob - log_prob.detach()), advantages[rows]
        loss = (torch.max(-adv * ratio, -adv * ratio.clamp(0, 2)).mean() + 0.04 * ((v - v_ref.double()) ** 2).mean()
                + ((v - v_ema.double()) ** 2).mean())
    else:
        with autocast:
            v = velocity(transformer, kind, x[rows], sigmas[1], select(emb, rows), guidance=guidance)
        _, log_prob, mean, std = sde_step(v, x[rows], sigmas, 1, 0.7, prev_sample=x_next[rows])
        # the files' loss: the PPO-clipped ratio and the official KL of the step means
        with torch.no_grad(), as_reference(transformer, ref) as reference:
            v_ref = velocity(reference, kind, x[rows], sigmas[1], select(emb, rows), guidance=guidance)
        _, _, mean_ref, _ = sde_step(v_ref, x[rows], sigmas, 1, 0.7, prev_sample=x_next[rows])
        kl = ((mean - mean_ref) ** 2).flatten(1).mean(1).mean() / (2 * std**2 / float(sigmas[1] - sigmas[2]))
        ratio, adv = torch.exp(log_prob - log_prob.detach()), advantages[rows]
        loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)).mean() + 0.04 * kl
    loss.backward()  # FSDP2 averages the ranks' gradients: the mean over the whole batch
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()  # noqa: E731
    grads = {name: full(p.grad) for name, p in params.items()}  # before the step averages LoRA's over ranks
    before = {name: full(p) for name, p in params.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3, weight_decay=1e-4)
    optimizer_step(params, optimizer, max_grad_norm=1.0, sharded=sharded, has_gradient=True)
    updated = {name: full(p) for name, p in params.items()}
    return {"grads": grads, "before": before, "updated": updated}


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank, world, device = setup_distributed()
    results = {mode: one_step(set(mode.split(",")), rank, world) for mode in sys.argv[2:]}
    if rank == 0:
        torch.save(results, sys.argv[1])
    close_distributed()  # rank 0 has written the file before any rank leaves
