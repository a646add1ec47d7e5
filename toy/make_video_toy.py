"""Make the moving-shapes toy model: a genuine diffusers WanPipeline trained on procedurally drawn clips.

Trains, from a fixed seed, a tiny AutoencoderKLWan (Wan2.1's causal 3D VAE: 9 frames of 32x32x3 -> 3 latent frames of
8x8x16, 4x in time as the real one, 4x in space) and then a tiny WanTransformer3DModel on its normalised latents with
the rectified-flow loss at the integer timesteps Wan's schedulers give (the UMT5 text encoder stays frozen at its
random init), and saves the pipeline with `save_pretrained` and its UniPC scheduler (flow_shift 3.0). Every stage
checkpoints into --work, so a stopped run continues where it stopped. `--samples-only` loads a saved pipeline,
measures it on held-out prompts with the project's sampler and writes an animated sample grid.

    python toy/make_video_toy.py                    # VAE, latents, transformer (1.7 hours on 2 busy cores)
    python toy/make_video_toy.py --samples-only     # metrics + results/video_toy_samples.webp
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from video_world import render_clips, toy_consistency_reward, toy_frame_mean_reward, toy_motion_reward  # noqa: E402
from video_world import toy_video_strict_accuracy, video_prompts  # noqa: E402

FRAMES, EVAL_PROMPT_SEED, EVAL_NOISE_SEED = 9, 2001, 200_000


def atomic_save(obj, path: str):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------- the VAE
def train_vae(args, log):
    """Reconstruction (L2 + L1, the object's pixels weighted --fg-weight more than the black around it) of rendered
    clips in [-1, 1] plus a small KL, in two stages, each with its own warm-up and cosine decay: --vae-short-steps on
    5-frame clips (the first frame and one 4-frame chunk: cheap), then --vae-steps on clips of the toy's 9 frames (the
    causal VAE codes a clip chunk by chunk, its cache carrying each chunk into the next: the second chunk must be
    seen); resumes from --work/vae.pt."""
    from tiny_video import tiny_wan_vae
    torch.manual_seed(args.seed)
    vae = tiny_wan_vae("2.1", z_dim=args.z_dim, base_dim=args.vae_base, latents_mean=[0.0] * args.z_dim,
                       latents_std=[1.0] * args.z_dim)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    path, start = os.path.join(args.work, "vae.pt"), 0
    if os.path.isfile(path):
        state = torch.load(path, weights_only=True)
        vae.load_state_dict(state["vae"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log(f"vae: resumed at step {start}")
    t0 = time.time()
    total = args.vae_short_steps + args.vae_steps
    for step in range(start, total):
        short = step < args.vae_short_steps
        k, n = (step, args.vae_short_steps) if short else (step - args.vae_short_steps, args.vae_steps)
        lr = args.vae_lr * min(1.0, (k + 1) / 50) * 0.5 * (1 + math.cos(math.pi * k / n))
        for g in opt.param_groups:
            g["lr"] = lr
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        x = render_clips(video_prompts(args.vae_batch_size, seed=args.seed * 7919 + step), 5 if short else FRAMES,
                         generator=gen)
        x = x * 2 - 1
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        weight = 1 + args.fg_weight * (x > -0.9).any(1, keepdim=True).float()  # the object, not the black
        rec_loss = (weight * ((rec - x).square() + (rec - x).abs())).mean() / weight.mean()
        kl = post.kl().mean() / x[0].numel()
        loss = rec_loss + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == total:
            log(f"vae step {step + 1} rec {rec_loss.item():.4f} kl {kl.item():.3f} ({time.time() - t0:.0f}s)")
            atomic_save({"vae": vae.state_dict(), "opt": opt.state_dict(), "step": step + 1}, path)
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_pool(vae, args, log):
    """A fixed pool of (prompt, latent) pairs, the posterior means; the per-channel mean and std go into the VAE's
    config (latents_mean, latents_std) and the latents are normalised with them, as WanPipeline undoes it."""
    path = os.path.join(args.work, "pool.pt")
    if os.path.isfile(path):
        pool = torch.load(path, weights_only=True)
        return pool["prompts"], pool["latents"], pool["mean"], pool["std"]
    gen = torch.Generator().manual_seed(args.seed + 4)
    prompts = video_prompts(args.pool, seed=args.seed + 5)
    z = torch.cat([vae.encode(render_clips(prompts[k:k + 64], FRAMES, generator=gen) * 2 - 1).latent_dist.mode()
                   for k in range(0, args.pool, 64)])
    mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
    latents = (z - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    atomic_save({"prompts": prompts, "latents": latents, "mean": mean, "std": std}, path)
    log(f"pool: {args.pool} latents {tuple(latents.shape[1:])}, channel std {std.min():.3f}..{std.max():.3f}")
    return prompts, latents, mean, std


# ---------------------------------------------------------------------------------------------------- the model
def build(args, vae, mean, std):
    from tiny_video import build_wan, tiny_wan_transformer
    vae.register_to_config(latents_mean=[round(float(m), 4) for m in mean],
                           latents_std=[round(float(s), 4) for s in std])
    torch.manual_seed(args.seed + 1)
    transformer = tiny_wan_transformer(args.z_dim, text_dim=args.text_dim, heads=args.heads, head_dim=args.head_dim,
                                       layers=args.layers, ffn_dim=args.ffn_dim)
    pipe = build_wan(seed=args.seed, vae=vae, transformer=transformer, text_dim=args.text_dim,
                     max_length=args.max_length)
    pipe.text_encoder.eval().requires_grad_(False)
    return pipe


def train_transformer(pipe, prompts, latents, mean, std, args, log):
    """Rectified flow on the pool's latents: x_t = (1 - s) x0 + s eps, target eps - x0, s a shifted uniform, the
    model's timestep floor(1000 s) as at sampling; prompts dropped to "" at --uncond-prob (CFG). A constant learning
    rate after warm-up and an EMA of the weights (what gets saved); resumes from --work/transformer.pt."""
    tr = pipe.transformer.train()
    params = list(tr.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    path, start = os.path.join(args.work, "transformer.pt"), 0
    if os.path.isfile(path):
        state = torch.load(path, weights_only=True)
        tr.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        for e, v in zip(ema, state["ema"]):
            e.copy_(v)
        start = state["step"]
        log(f"transformer: resumed at step {start}")
    with torch.no_grad():
        uniq = sorted(set(prompts)) + [""]
        emb, _ = pipe.encode_prompt(uniq, do_classifier_free_guidance=False, max_sequence_length=args.max_length)
    index = {p: i for i, p in enumerate(uniq)}
    ids = torch.tensor([index[p] for p in prompts])
    t0 = time.time()
    for step in range(start + 1, args.dit_steps + 1):
        gen = torch.Generator().manual_seed(args.seed * 1_000_033 + step)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 200)
        b = torch.randint(len(prompts), (args.batch_size,), generator=gen)
        x0, t = latents[b], ids[b].clone()
        t[torch.rand(args.batch_size, generator=gen) < args.uncond_prob] = index[""]
        u = torch.rand(args.batch_size, generator=gen)
        s = args.shift * u / (1 + (args.shift - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        xt = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * eps
        v = tr(hidden_states=xt, timestep=torch.floor(s.double() * 1000).float(), encoder_hidden_states=emb[t],
               return_dict=False)[0]
        loss = (v - (eps - x0)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - min(args.ema, (1 + step) / (10 + step)))
        if step % 100 == 0 or step == args.dit_steps:
            log(f"dit step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
            atomic_save({"model": tr.state_dict(), "opt": opt.state_dict(), "ema": ema, "step": step}, path)
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    tr.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def sample(pipe, prompts: list[str], seeds: list[int], steps: int = 16, guidance: float = 1.0):
    """The project's evaluation sampler (common.ode_complete on the pipeline's schedule): videos [B, 3, 9, 32, 32]."""
    import common
    kind = common.family_of(pipe)
    shape = common.latent_shape(pipe, kind, 32, frames=FRAMES)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape)
    emb = common.encode_prompts(pipe, kind, prompts, max_sequence_length=16, cfg=guidance, device="cpu")
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    x = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))] * len(prompts), sigmas, emb,
                            guidance=guidance, micro_batch=64)
    return common.decode(pipe, x)


def measure(pipe, log, n: int = 256, batch: int = 64, guidance: float = 1.0) -> dict:
    """The rewards' means on n held-out prompt/seed pairs, sampled as the TOY preset evaluates (16 ODE steps)."""
    prompts, seeds = video_prompts(n, seed=EVAL_PROMPT_SEED), list(range(EVAL_NOISE_SEED, EVAL_NOISE_SEED + n))
    fns = {"frame_mean": toy_frame_mean_reward, "motion": toy_motion_reward, "consistency": toy_consistency_reward,
           "strict": toy_video_strict_accuracy}
    out = {k: [] for k in fns}
    for k in range(0, n, batch):
        videos = sample(pipe, prompts[k:k + batch], seeds[k:k + batch], guidance=guidance)
        for name, fn in fns.items():
            out[name].append(fn(videos, prompts[k:k + batch]))
    out = {k: torch.cat(v).mean().item() for k, v in out.items()}
    log(f"guidance {guidance}: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out


def save_samples(pipe, path: str, n: int = 12):
    """An animated grid (rundir.save_video_grid) of n held-out samples."""
    import rundir
    prompts, seeds = video_prompts(n, seed=EVAL_PROMPT_SEED), list(range(EVAL_NOISE_SEED, EVAL_NOISE_SEED + n))
    rundir.save_video_grid(sample(pipe, prompts, seeds), path, fps=8)


def write_marker(out):
    """toy_world.json next to model_index.json: the algorithm files apply their TOY preset and the moving-shapes
    world (rundir.TOY_VIDEO_WORLD) to a pipeline that has it, wherever it was copied."""
    about = {"about": "the moving-shapes toy world's pipeline (toy/make_video_toy.py): --model <this directory> "
                      "gets each file's TOY preset with rundir.TOY_VIDEO_WORLD", "world": "video",
             "resolution": 32, "num_frames": FRAMES, "max_sequence_length": 16}
    with open(os.path.join(out, "toy_world.json"), "w") as f:
        json.dump(about, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "wan-shapes"), help="pipeline directory to write (or read)")
    ap.add_argument("--work", default="/tmp/wan-shapes-work", help="checkpoints of every stage (resumable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--z-dim", type=int, default=16, help="latent channels (Wan2.1's 16)")
    ap.add_argument("--vae-base", type=int, default=8, help="the VAE's base width")
    ap.add_argument("--vae-steps", type=int, default=800, help="the second stage: 9-frame clips")
    ap.add_argument("--vae-batch-size", type=int, default=8)
    ap.add_argument("--vae-short-steps", type=int, default=800, help="the first stage: 5-frame clips")
    ap.add_argument("--vae-lr", type=float, default=1e-3)
    ap.add_argument("--kl-weight", type=float, default=1e-3, help="weight of the per-element KL term")
    ap.add_argument("--fg-weight", type=float, default=10.0, help="extra weight of the object's pixels")
    ap.add_argument("--pool", type=int, default=12288, help="number of pre-encoded training clips")
    ap.add_argument("--text-dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn-dim", type=int, default=256)
    ap.add_argument("--dit-steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--shift", type=float, default=3.0, help="sigma shift of training (the scheduler's flow_shift)")
    ap.add_argument("--uncond-prob", type=float, default=0.1)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--max-length", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples-only", action="store_true", help="load --out, print metrics, write --samples")
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--guidance", type=float, nargs="+", default=[1.0, 4.5], help="CFG weights to measure")
    ap.add_argument("--samples", default=os.path.join(os.path.dirname(HERE), "results", "video_toy_samples.webp"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if args.samples_only:
        import common
        pipe, _ = common.load_pipeline(args.out, torch.device("cpu"))
        for guidance in args.guidance:
            measure(pipe, log, n=args.eval_prompts, guidance=guidance)
        save_samples(pipe, args.samples)
        log(f"wrote {args.samples}")
        return
    os.makedirs(args.work, exist_ok=True)
    t0 = time.time()
    vae = train_vae(args, log)
    prompts, latents, mean, std = encode_pool(vae, args, log)
    pipe = build(args, vae, mean, std)
    log(f"transformer params {sum(p.numel() for p in pipe.transformer.parameters()):,}")
    train_transformer(pipe, prompts, latents, mean, std, args, log)
    pipe.save_pretrained(args.out)
    write_marker(args.out)
    log(f"saved {args.out} after {time.time() - t0:.0f}s")
    for guidance in args.guidance:
        measure(pipe, log, n=args.eval_prompts, guidance=guidance)


if __name__ == "__main__":
    main()
