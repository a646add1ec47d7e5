"""results/estimate.py checked on a real GPU: the single-GPU G2RPO configuration (a random-initialised FLUX.1-dev-size
transformer, bf16 frozen weights, LoRA r64, 720 px, gradient checkpointing) runs one rollout forward of a micro-batch
and one training step through common.py, and torch.cuda.max_memory_allocated is printed next to the estimate of the
same phases (transformer and its adapters only: no text encoders, VAE or reward models are loaded here).

    python results/gpu_check.py            # on one CUDA GPU with >= 40 GB; about 2 minutes
    python results/gpu_check.py --tiny     # the same code on a tiny transformer, on a CPU (the tests run this)
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy"), os.path.join(ROOT, "results")]


def main():
    import tyro

    import common
    import estimate
    import g2rpo

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    name, script, argv, world = next(c for c in estimate.COMMANDS if c[0].startswith("1 GPU: G2RPO"))
    args = tyro.cli(g2rpo.Args, args=argv.split())
    device = torch.device("cpu" if a.tiny else "cuda")
    make, _, _ = estimate.architectures("flux", a.tiny)
    res = 32 if a.tiny else args.resolution
    C, H = (4, 16) if a.tiny else (16, res // 8)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        transformer = make()
        torch.set_default_dtype(torch.float32)
    params, _ = common.make_trainable(transformer.requires_grad_(False), "flux", args.lora_rank, args.lora_alpha, False, False,
                                      False, torch.bfloat16, True)
    txt, pooled = (32, 32) if a.tiny else (4096, 768)
    seq = 16 if a.tiny else args.max_sequence_length
    emb = {"embeds": torch.randn(1, seq, txt, device=device, dtype=torch.bfloat16),
           "pooled": torch.randn(1, pooled, device=device, dtype=torch.bfloat16)}
    sigmas, out = common.sigma_schedule(args.num_steps, args.shift), {"build seconds": round(time.time() - t0, 1)}
    memory = (lambda: torch.cuda.max_memory_allocated() / 2**30) if device.type == "cuda" else (lambda: 0.0)  # noqa: E731
    resident = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    x = torch.randn(args.micro_batch, C, H, H, device=device)
    with torch.no_grad():  # a rollout forward of one micro-batch (the completions' shape)
        common.velocity(transformer, "flux", x, sigmas[1], common.select(emb, torch.zeros(len(x), dtype=torch.long)), 3.5)
    out["rollout forward peak GiB"] = round(memory(), 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    xt = torch.randn(1, C, H, H, device=device)  # one prompt's v(x_k): G2RPO's training forward
    v = common.velocity(transformer, "flux", xt, sigmas[1], emb, 3.5)
    _, log_prob, _, _ = common.sde_step(v.expand(args.group_size, -1, -1, -1), xt.expand(args.group_size, -1, -1, -1),
                                        sigmas, 1, args.noise_level, prev_sample=torch.randn(args.group_size, C, H, H,
                                                                                             device=device))
    loss, _, _ = common.clipped_policy_loss(log_prob, log_prob.detach(), torch.randn(args.group_size, device=device), 1e-4)
    loss.backward()
    out["training step peak GiB"] = round(memory(), 1)
    out["resident GiB (weights and adapters)"] = round(resident, 1)
    out["lora gradients"] = sum(p.grad is not None for p in params)
    print(json.dumps(out, indent=1))
    if not a.tiny:
        print("estimate (results/estimate.md, '1 GPU: G2RPO'): the same phases add the VAE, the reward models and the "
              "rollout's stored tensors (~6 GiB) to these")


if __name__ == "__main__":
    main()
