"""Make the embedded toy model: a genuine diffusers FluxPipeline trained on rendered coloured shapes.

Trains, from a fixed seed, a tiny AutoencoderKL (32x32x3 -> 16x16x4) and then a tiny FluxTransformer2DModel on its
latents with the rectified-flow loss (text encoders stay frozen at their random init), and saves the pipeline with
`save_pretrained`. `--samples-only` loads a saved pipeline, measures it on held-out prompts and writes a sample grid.

    python toy/make_toy.py                      # full run (20-35 minutes on 2 CPU cores), then as below
    python toy/make_toy.py --samples-only       # metrics + results/toy_samples.png
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from world import COLOURS, SHAPES, parse_toy_prompt, shape_coverage, toy_prompts  # noqa: E402
from world import toy_color_position_reward, toy_shape_count_reward, toy_strict_accuracy  # noqa: E402

CENTRES = {"left": (8.0, 16.0), "right": (24.0, 16.0), "top": (16.0, 8.0), "bottom": (16.0, 24.0)}
EVAL_PROMPT_SEED, EVAL_NOISE_SEED, GROUP_PROMPT_SEED = 1001, 100_000, 1002


def render(prompts: list[str], size: int = 32, generator: torch.Generator | None = None) -> torch.Tensor:
    """Ground-truth images [B, 3, size, size] in [0, 1]: each object in its region on black, with a random width
    of 9-12 px (at 32x32) and a random offset (+-1.5 px across the middle line, +-5 px along it)."""
    objs = [parse_toy_prompt(p) for p in prompts]
    n = len(prompts)
    u = torch.rand(n, 2, 3, generator=generator)
    shape, colour = torch.zeros(n, 2, dtype=torch.long), torch.zeros(n, 2, 3)
    cx, cy, valid = torch.zeros(n, 2), torch.zeros(n, 2), torch.zeros(n, 2)
    for i, ob in enumerate(objs):
        for j, (c, s, p) in enumerate(ob):
            across, along = 3 * u[i, j, 0] - 1.5, 10 * u[i, j, 1] - 5
            x0, y0 = CENTRES[p]
            horizontal = p in ("left", "right")
            cx[i, j], cy[i, j] = (x0 + across, y0 + along) if horizontal else (x0 + along, y0 + across)
            shape[i, j], colour[i, j], valid[i, j] = SHAPES.index(s), torch.tensor(COLOURS[c]), 1.0
    d = 9 + 3 * u[..., 2]
    scale = size / 32
    cov = shape_coverage(shape, cx * scale, cy * scale, d * scale, size) * valid[..., None, None]  # [B, 2, H, W]
    return torch.einsum("bjhw,bjc->bchw", cov, colour).clamp(0, 1)


# ---------------------------------------------------------------------------------------------------- training
def train_vae(args, log):
    from tiny import tiny_vae
    torch.manual_seed(args.seed)
    vae = tiny_vae(channels=tuple(args.vae_channels))
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    t0 = time.time()
    for step in range(args.vae_steps):
        lr = args.vae_lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / max(args.vae_steps, 1)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = render(toy_prompts(args.vae_batch_size, seed=args.seed * 1_000_003 + step), generator=gen) * 2 - 1
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        rec_loss = (rec - x).square().mean() + (rec - x).abs().mean()
        kl = post.kl().mean() / x[0].numel()
        loss = rec_loss + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.vae_steps - 1:
            log(f"vae step {step} rec {rec_loss.item():.4f} kl {kl.item():.3f} ({time.time() - t0:.0f}s)")
    vae.eval().requires_grad_(False)
    # Flux-style latent normalisation: scaled = (z - shift_factor) * scaling_factor has mean 0 and std 1.
    with torch.no_grad():
        z = torch.cat([vae.encode(render(toy_prompts(256, seed=7 + k), generator=gen) * 2 - 1).latent_dist.mode()
                       for k in range(4)])
    vae.register_to_config(shift_factor=round(z.mean().item(), 4), scaling_factor=round(1 / z.std().item(), 4))
    log(f"vae scaling_factor {vae.config.scaling_factor} shift_factor {vae.config.shift_factor}")
    return vae


def pack(z: torch.Tensor) -> torch.Tensor:
    from diffusers import FluxPipeline
    return FluxPipeline._pack_latents(z, z.shape[0], z.shape[1], z.shape[2], z.shape[3])


def velocity(pipe, x, sigma, emb, pooled, guidance: float = 3.5):
    """The transformer's velocity for packed latents x [B, N, 16] at noise level sigma (scalar or [B])."""
    from diffusers import FluxPipeline
    n, side = x.shape[0], int(math.isqrt(x.shape[1]))
    img_ids = FluxPipeline._prepare_latent_image_ids(n, side, side, x.device, x.dtype)
    txt_ids = torch.zeros(emb.shape[1], 3, dtype=x.dtype)
    sigma = torch.as_tensor(sigma, dtype=x.dtype).expand(n)
    g = torch.full((n,), guidance) if pipe.transformer.config.guidance_embeds else None
    return pipe.transformer(hidden_states=x, timestep=sigma, guidance=g, pooled_projections=pooled,
                            encoder_hidden_states=emb, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]


def train_transformer(pipe, args, log):
    """Rectified flow on normalised VAE latents: x_t = (1 - s) x0 + s eps, target eps - x0, s a shifted uniform.
    Constant learning rate after warmup and an EMA of the weights (which is what gets saved), so a run stopped
    after k steps is the same as a run with --dit-steps k."""
    torch.manual_seed(args.seed + 2)
    gen = torch.Generator().manual_seed(args.seed + 3)
    vae, cfg = pipe.vae, pipe.vae.config
    pool = max(args.pool, args.batch_size)
    with torch.no_grad():  # a fixed pool of (prompt, latent) pairs; latents are posterior means, normalised
        prompts = toy_prompts(pool, seed=args.seed + 4)
        lat = torch.cat([pack((vae.encode(render(prompts[k:k + 256], generator=gen) * 2 - 1).latent_dist.mode()
                               - cfg.shift_factor) * cfg.scaling_factor) for k in range(0, pool, 256)])
        uniq = sorted(set(prompts)) + [""]
        emb, pooled, _ = pipe.encode_prompt(uniq, max_sequence_length=args.max_length)
    index = {p: i for i, p in enumerate(uniq)}
    ids = torch.tensor([index[p] for p in prompts])
    log(f"pool: {pool} latents of {len(uniq) - 1} prompts, latent std {lat.std():.3f}")
    tr = pipe.transformer.train()
    params = list(tr.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)

    def swap():  # exchange the live weights and the EMA weights
        with torch.no_grad():
            for p, e in zip(params, ema):
                tmp = p.detach().clone()
                p.copy_(e)
                e.copy_(tmp)

    t0 = time.time()
    for step in range(1, args.dit_steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 200)
        b = torch.randint(pool, (args.batch_size,), generator=gen)
        x0, t = lat[b], ids[b].clone()
        t[torch.rand(args.batch_size, generator=gen) < args.uncond_prob] = index[""]
        u = torch.rand(args.batch_size, generator=gen)
        s = args.shift * u / (1 + (args.shift - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * eps
        loss = (velocity(pipe, xt, s, emb[t], pooled[t]) - (eps - x0)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - min(args.ema, (1 + step) / (10 + step)))
        if step % 200 == 0 or step == args.dit_steps:
            log(f"dit step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
        if args.ckpt_every and step % args.ckpt_every == 0 and step < args.dit_steps:
            swap()
            tr.eval()
            path = os.path.join(args.ckpt_dir, f"step{step}")
            pipe.save_pretrained(path)
            evaluate(pipe, path, lambda m: log(f"step {step}: {m}"), n=64, timing=False)
            tr.train()
            swap()
    swap()
    tr.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------- sampling
@torch.no_grad()
def sample(pipe, prompts: list[str], seeds: list[int], steps: int = 16, shift: float = 3.0, max_length: int = 16):
    """Euler ODE samples, images [B, 3, 32, 32] in [0, 1]; sigmas shift*u/(1+(shift-1)*u) on linspace(1, 0, steps+1)."""
    emb, pooled, _ = pipe.encode_prompt(prompts, max_sequence_length=max_length)
    c = pipe.transformer.config.in_channels // 4
    x = pack(torch.cat([torch.randn(1, c, 16, 16, generator=torch.Generator().manual_seed(s)) for s in seeds]))
    u = torch.linspace(1, 0, steps + 1)
    sig = shift * u / (1 + (shift - 1) * u)
    for i in range(steps):
        x = x + velocity(pipe, x, sig[i], emb, pooled) * (sig[i + 1] - sig[i])
    z = pipe._unpack_latents(x, 32, 32, pipe.vae_scale_factor)
    z = z / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return (pipe.vae.decode(z).sample / 2 + 0.5).clamp(0, 1)


def rewards(images, prompts) -> dict:
    a, b = toy_color_position_reward(images, prompts), toy_shape_count_reward(images, prompts)
    return dict(a=a, b=b, train=(a + b) / 2, strict=toy_strict_accuracy(images, prompts))


def evaluate(pipe, path: str, log, n: int = 256, batch: int = 64, timing: bool = True) -> dict:
    """Base-model numbers on n held-out (prompt, seed) pairs, n/8 groups of 12 seeds, and pipeline speed."""
    from diffusers import FluxPipeline
    prompts, seeds = toy_prompts(n, seed=EVAL_PROMPT_SEED), list(range(EVAL_NOISE_SEED, EVAL_NOISE_SEED + n))
    r = [rewards(sample(pipe, prompts[k:k + batch], seeds[k:k + batch]), prompts[k:k + batch])
         for k in range(0, n, batch)]
    r = {k: torch.cat([x[k] for x in r]) for k in r[0]}
    two = torch.tensor([" and " in p for p in prompts])
    subsets = (("", two | ~two), ("_one", ~two), ("_two", two))
    out = {f"{k}{sfx}": r[k][m].mean().item() for k in r for sfx, m in subsets}
    group_prompts = toy_prompts(max(n // 8, 1), seed=GROUP_PROMPT_SEED)
    stds = []
    for k in range(0, len(group_prompts), 4):
        ps = [p for p in group_prompts[k:k + 4] for _ in range(12)]
        g = rewards(sample(pipe, ps, list(range(12 * k, 12 * k + len(ps)))), ps)["train"].view(-1, 12)
        stds.append(g.std(1))
    stds = torch.cat(stds)
    out["groups_std_pos"], out["group_std_mean"] = (stds > 1e-6).float().mean().item(), stds.mean().item()
    if timing:  # the plain diffusers pipeline, as loaded by users
        p2 = FluxPipeline.from_pretrained(path)
        p2.set_progress_bar_config(disable=True)
        call = lambda: p2(prompts[:12], height=32, width=32, num_inference_steps=16, max_sequence_length=16)  # noqa
        call()
        t0 = time.time()
        call()
        out["seconds_12_images"] = time.time() - t0
    log(" ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out


def save_samples(pipe, png: str, n: int = 24, cols: int = 6):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    prompts, seeds = toy_prompts(n, seed=EVAL_PROMPT_SEED), list(range(EVAL_NOISE_SEED, EVAL_NOISE_SEED + n))
    images = sample(pipe, prompts, seeds)
    r = rewards(images, prompts)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 3.0 * rows))
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
            title = prompts[i].replace(" and ", "\nand ")
            ax.set_title(f"{title}\na {r['a'][i]:.2f}  b {r['b'][i]:.2f}  strict {r['strict'][i]:.0f}", fontsize=7)
    fig.suptitle("toy base model, 16-step ODE samples (a: colour/position, b: shape/count)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def write_marker(out):
    """toy_world.json next to model_index.json: the algorithm files apply their TOY preset to a pipeline that has
    it, however its directory is named or wherever it was copied."""
    about = {"about": "the toy world's pipeline (toy/make_toy.py): --model <this directory> gets each file's TOY preset",
             "resolution": 32, "max_sequence_length": 16}
    with open(os.path.join(out, "toy_world.json"), "w") as f:
        json.dump(about, f, indent=1)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "flux-shapes"), help="pipeline directory to write (or read)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-steps", type=int, default=2000)
    ap.add_argument("--dit-steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64, help="transformer batch size")
    ap.add_argument("--vae-batch-size", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=3e-3)
    ap.add_argument("--lr", type=float, default=1e-3, help="transformer learning rate")
    ap.add_argument("--kl-weight", type=float, default=1e-3, help="weight of the per-element KL term")
    ap.add_argument("--vae-channels", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--hidden-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    ap.add_argument("--single-layers", type=int, default=2, help="single-stream blocks")
    ap.add_argument("--shift", type=float, default=3.0, help="sigma shift for training and sampling")
    ap.add_argument("--uncond-prob", type=float, default=0.1, help="fraction of empty prompts")
    ap.add_argument("--pool", type=int, default=24576, help="number of pre-encoded training images")
    ap.add_argument("--ema", type=float, default=0.999, help="EMA decay of the saved transformer weights")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save and measure the EMA pipeline every N steps")
    ap.add_argument("--ckpt-dir", default="/tmp/flux-shapes-ckpts")
    ap.add_argument("--max-length", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples-only", action="store_true", help="load --out, print metrics, write --samples")
    ap.add_argument("--no-eval", action="store_true", help="skip the metrics and samples after training")
    ap.add_argument("--eval-prompts", type=int, default=256, help="held-out (prompt, seed) pairs for the metrics")
    ap.add_argument("--samples", default=os.path.join(os.path.dirname(here), "results", "toy_samples.png"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    from diffusers import FluxPipeline
    if args.samples_only:
        pipe = FluxPipeline.from_pretrained(args.out)
        evaluate(pipe, args.out, log, n=args.eval_prompts)
        save_samples(pipe, args.samples)
        log(f"wrote {args.samples}")
        return
    from tiny import build_flux
    t0 = time.time()
    vae = train_vae(args, log)
    pipe = build_flux(seed=args.seed, hidden_heads=args.hidden_heads, head_dim=args.head_dim, num_layers=args.layers,
                      num_single_layers=args.single_layers, max_length=args.max_length, vae=vae, shift=args.shift)
    for m in (pipe.text_encoder, pipe.text_encoder_2):
        m.eval().requires_grad_(False)
    log(f"transformer params {sum(p.numel() for p in pipe.transformer.parameters()):,}")
    train_transformer(pipe, args, log)
    pipe.save_pretrained(args.out)
    write_marker(args.out)
    log(f"saved {args.out} after {time.time() - t0:.0f}s")
    if not args.no_eval:
        evaluate(pipe, args.out, log, n=args.eval_prompts)
        save_samples(pipe, args.samples)
        log(f"wrote {args.samples}")


if __name__ == "__main__":
    main()
