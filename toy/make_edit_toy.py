"""Make the editing toy model: a genuine diffusers FluxKontextPipeline trained on the editing toy world's edits.

Starts from the toy world's pipeline (toy/flux-shapes: its VAE, its text encoders with the instructions' words
added, its transformer) and trains the transformer with the rectified-flow loss on (source, instruction, target)
triples of toy/edit_world.py, the source's latent tokens after the noisy target's as FluxKontextPipeline feeds them
(position ids with first axis 1), the loss on the target tokens only. Saves with `save_pretrained`; it loads with
`FluxKontextPipeline.from_pretrained(path)`. `--samples-only` measures a saved pipeline and writes a sample grid.

    python toy/make_edit_toy.py                   # full run (about 6 minutes on one CPU core), then as below
    python toy/make_edit_toy.py --samples-only    # metrics + results/toy_edit_samples.png
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from edit_world import WORDS, draw_edits, edit_prompts, render  # noqa: E402
from edit_world import toy_edit_reward, toy_edit_strict_accuracy, toy_preserve_reward  # noqa: E402
from make_toy import pack  # noqa: E402

EVAL_SEED, EVAL_NOISE_SEED = 1001, 100_000


def with_words(pipe, words):
    """The pipeline's word-level tokenizers and text encoders with `words` added: each old word keeps its
    embedding row (so the encoders say what they said before), each new word gets a fresh random row."""
    from tiny import WORDS as OLD, word_tokenizer
    tok = word_tokenizer(pipe.tokenizer.model_max_length, words=list(OLD) + list(words))
    old_vocab, new_vocab = pipe.tokenizer.get_vocab(), tok.get_vocab()
    gen = torch.Generator().manual_seed(0)
    for encoder in (pipe.text_encoder, pipe.text_encoder_2):
        old = encoder.get_input_embeddings().weight.detach()
        new = torch.randn(len(new_vocab), old.shape[1], generator=gen) * old.std()
        for word, i in new_vocab.items():
            if word in old_vocab:
                new[i] = old[old_vocab[word]]
        encoder.resize_token_embeddings(len(new_vocab))
        encoder.get_input_embeddings().weight.data.copy_(new)
    return tok, word_tokenizer(pipe.tokenizer_2.model_max_length, words=list(OLD) + list(words))


def build(base: str):
    """A FluxKontextPipeline of the toy world's components (the transformer a copy, to be trained)."""
    from diffusers import FluxKontextPipeline, FluxPipeline
    flux = FluxPipeline.from_pretrained(base)
    tok, tok2 = with_words(flux, WORDS)
    return FluxKontextPipeline(scheduler=flux.scheduler, vae=flux.vae, text_encoder=flux.text_encoder,
                               tokenizer=tok, text_encoder_2=flux.text_encoder_2, tokenizer_2=tok2,
                               transformer=flux.transformer)


@torch.no_grad()
def latents(pipe, images):
    """Images [B, 3, 32, 32] in [0, 1] -> normalised packed latents [B, 64, 16] (the VAE's mode, as Kontext's)."""
    cfg = pipe.vae.config
    return pack((pipe.vae.encode(images * 2 - 1).latent_dist.mode() - cfg.shift_factor) * cfg.scaling_factor)


def ids(n_target: int, side: int):
    """Kontext's position ids: the target's (0, h, w), then the source's (1, h, w)."""
    from diffusers import FluxPipeline
    target = FluxPipeline._prepare_latent_image_ids(1, side, side, "cpu", torch.float32)
    source = target.clone()
    source[:, 0] = 1
    return torch.cat([target, source])


def velocity(pipe, x, cond, sigma, emb, pooled, guidance: float = 3.5):
    """The velocity of the target tokens x [B, 64, 16] given the source's tokens cond [B, 64, 16]."""
    n = x.shape[0]
    g = torch.full((n,), guidance) if pipe.transformer.config.guidance_embeds else None
    out = pipe.transformer(hidden_states=torch.cat([x, cond], 1), timestep=torch.as_tensor(sigma).expand(n),
                           guidance=g, pooled_projections=pooled, encoder_hidden_states=emb,
                           txt_ids=torch.zeros(emb.shape[1], 3), img_ids=ids(x.shape[1], 8), return_dict=False)[0]
    return out[:, :x.shape[1]]


def pool_of(pipe, n: int, seed: int, max_length: int):
    """n edits' source and target latents and their instructions' embeddings."""
    edits = draw_edits(n, seed=seed)
    src = torch.stack([render(e["source_objects"]) for e in edits])
    tgt = torch.stack([render(e["target_objects"]) for e in edits])
    z_src = torch.cat([latents(pipe, src[k:k + 256]) for k in range(0, n, 256)])
    z_tgt = torch.cat([latents(pipe, tgt[k:k + 256]) for k in range(0, n, 256)])
    uniq = sorted({e["instruction"] for e in edits}) + [""]
    with torch.no_grad():
        emb, pooled, _ = pipe.encode_prompt(uniq, prompt_2=None, max_sequence_length=max_length)
    index = {p: i for i, p in enumerate(uniq)}
    return z_src, z_tgt, torch.tensor([index[e["instruction"]] for e in edits]), emb, pooled, index[""]


def train(pipe, args, log):
    """Rectified flow on the target latents, x_t = (1 - s) x0 + s eps, s a shifted uniform, the source's tokens
    always present and the instruction dropped to "" for a tenth; an EMA of the weights is what gets saved."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    z_src, z_tgt, which, emb, pooled, empty = pool_of(pipe, args.pool, args.seed + 2, args.max_length)
    log(f"pool: {args.pool} edits, latent std {z_tgt.std():.3f}")
    tr = pipe.transformer.train()
    params = list(tr.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 100)
        b = torch.randint(args.pool, (args.batch_size,), generator=gen)
        t = which[b].clone()
        t[torch.rand(args.batch_size, generator=gen) < args.uncond_prob] = empty
        u = torch.rand(args.batch_size, generator=gen)
        s = (args.shift * u / (1 + (args.shift - 1) * u))[:, None, None]
        eps = torch.randn(z_tgt[b].shape, generator=gen)
        xt = (1 - s) * z_tgt[b] + s * eps
        loss = (velocity(pipe, xt, z_src[b], s.flatten(), emb[t], pooled[t]) - (eps - z_tgt[b])).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - min(args.ema, (1 + step) / (10 + step)))
        if step % 100 == 0 or step == args.steps:
            log(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            with torch.no_grad():
                live = [p.detach().clone() for p in params]
                for p, e in zip(params, ema):
                    p.copy_(e)
                evaluate(pipe, lambda m: log(f"step {step}: {m}"), n=args.eval_num // 2)
                for p, v in zip(params, live):
                    p.copy_(v)
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    tr.eval().requires_grad_(False)


@torch.no_grad()
def sample(pipe, prompts, seeds, steps: int = 16, shift: float = 3.0, max_length: int = 16):
    """Euler ODE edits of each prompt's source, images [B, 3, 32, 32] in [0, 1]."""
    emb, pooled, _ = pipe.encode_prompt([str(p) for p in prompts], prompt_2=None, max_sequence_length=max_length)
    cond = latents(pipe, torch.stack([p.images[0].float() / 255 for p in prompts]))
    c = pipe.transformer.config.in_channels // 4
    x = pack(torch.cat([torch.randn(1, c, 16, 16, generator=torch.Generator().manual_seed(s)) for s in seeds]))
    u = torch.linspace(1, 0, steps + 1)
    sig = shift * u / (1 + (shift - 1) * u)
    for i in range(steps):
        x = x + velocity(pipe, x, cond, sig[i], emb, pooled) * (sig[i + 1] - sig[i])
    z = pipe._unpack_latents(x, 32, 32, pipe.vae_scale_factor)
    z = z / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return (pipe.vae.decode(z).sample / 2 + 0.5).clamp(0, 1)


def rewards(images, prompts) -> dict:
    edit, keep = toy_edit_reward(images, prompts), toy_preserve_reward(images, prompts)
    return dict(edit=edit, preserve=keep, strict=toy_edit_strict_accuracy(images, prompts))


def evaluate(pipe, log, n: int = 256, batch: int = 64) -> dict:
    """Base-model numbers on n held-out (edit, seed) pairs, overall and per kind of edit."""
    prompts, seeds = edit_prompts(n, seed=EVAL_SEED), list(range(EVAL_NOISE_SEED, EVAL_NOISE_SEED + n))
    r = [rewards(sample(pipe, prompts[k:k + batch], seeds[k:k + batch]), prompts[k:k + batch])
         for k in range(0, n, batch)]
    r = {k: torch.cat([x[k] for x in r]) for k in r[0]}
    out = {k: v.mean().item() for k, v in r.items()}
    for verb in ("make", "move", "remove", "add"):
        m = torch.tensor([p.startswith(verb) for p in prompts])
        out[f"edit_{verb}"] = r["edit"][m].mean().item()
    log(" ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return out


def save_samples(pipe, png: str, n: int = 12, cols: int = 4):
    """Source | edit pairs of held-out edits with their scores."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    prompts, seeds = edit_prompts(n, seed=EVAL_SEED), list(range(EVAL_NOISE_SEED, EVAL_NOISE_SEED + n))
    images = sample(pipe, prompts, seeds)
    r = rewards(images, prompts)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, 2 * cols, figsize=(2.0 * 2 * cols, 2.4 * rows))
    for ax in axes.flat:
        ax.axis("off")
    for i in range(n):
        a, b = axes.flat[2 * i], axes.flat[2 * i + 1]
        a.imshow(prompts[i].images[0].permute(1, 2, 0).numpy(), interpolation="nearest")
        b.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
        a.set_title("source", fontsize=7)
        b.set_title(f"{prompts[i]}\nedit {r['edit'][i]:.2f} keep {r['preserve'][i]:.2f} "
                    f"strict {r['strict'][i]:.0f}", fontsize=6)
    fig.suptitle("editing toy base model: source | 16-step ODE edit", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def write_marker(out):
    """toy_world.json: the algorithm files apply their TOY preset with rundir.TOY_EDIT_WORLD to this pipeline."""
    about = {"about": "the editing toy world's pipeline (toy/make_edit_toy.py): --model <this directory> gets each "
             "file's TOY preset with rundir.TOY_EDIT_WORLD", "world": "edit", "resolution": 32,
             "max_sequence_length": 16}
    with open(os.path.join(out, "toy_world.json"), "w") as f:
        json.dump(about, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=os.path.join(HERE, "flux-shapes"), help="the toy world's pipeline")
    ap.add_argument("--out", default=os.path.join(HERE, "flux-kontext-shapes"), help="pipeline directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300, help="(600 gave strict 0.89: little left to learn)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--shift", type=float, default=3.0, help="sigma shift for training and sampling")
    ap.add_argument("--uncond-prob", type=float, default=0.1, help="fraction of empty instructions")
    ap.add_argument("--pool", type=int, default=16384, help="number of pre-encoded training edits")
    ap.add_argument("--ema", type=float, default=0.998, help="EMA decay of the saved transformer weights")
    ap.add_argument("--eval-every", type=int, default=0, help="measure the EMA weights every N steps")
    ap.add_argument("--max-length", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-num", type=int, default=256, help="held-out pairs measured at the end (half before)")
    ap.add_argument("--samples-only", action="store_true", help="load --out, print metrics, write --samples")
    ap.add_argument("--samples", default=os.path.join(os.path.dirname(HERE), "results", "toy_edit_samples.png"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    from diffusers import FluxKontextPipeline
    if args.samples_only:
        pipe = FluxKontextPipeline.from_pretrained(args.out)
    else:
        t0 = time.time()
        pipe = build(args.base)
        for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
            m.eval().requires_grad_(False)
        log("before training:")
        evaluate(pipe, log, n=args.eval_num // 2)
        train(pipe, args, log)
        pipe.save_pretrained(args.out)
        write_marker(args.out)
        log(f"saved {args.out} after {time.time() - t0:.0f}s")
    evaluate(pipe, log, n=args.eval_num)
    save_samples(pipe, args.samples)
    log(f"wrote {args.samples}")


if __name__ == "__main__":
    main()
