"""Make the toy world's learned proxy reward (toy/proxy.py): a small CNN trained on the base model's own samples,
labelled by the exact training reward (toy_color_position + toy_shape_count) / 2.

Samples --train-images and --heldout-images images from the toy pipeline (toy/flux-shapes) for toy prompts with
the RL runs' 16-step schedule, by the ODE or by Flow-GRPO's SDE at the noise levels --noise-levels (cycled over the
images), scores them with the exact rewards, adds a --mismatch share of the training images again under another
prompt (its exact reward), trains ProxyNet from --seed, and writes toy/proxy/proxy.safetensors and
toy/proxy/proxy.json (how it was made and its agreement with the exact reward on the held-out images). Everything is
seeded: the same arguments and thread count give the same weights.

    python toy/make_proxy.py                    # the committed proxy (~30 minutes on 2 CPU cores)
    python toy/make_proxy.py --out /tmp/proxy --train-images 96 --heldout-images 48 --steps 20   # a tiny one
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from proxy import ProxyNet, prompt_features  # noqa: E402
from world import COLOURS, PHRASE, POSITIONS, SHAPES, parse_toy_prompt, toy_prompts  # noqa: E402
from world import toy_color_position_reward, toy_shape_count_reward  # noqa: E402

TRAIN_PROMPT_SEED, HELDOUT_PROMPT_SEED = 2001, 2002  # offset by 1000 * --seed
TRAIN_NOISE_SEED, HELDOUT_NOISE_SEED = 3_000_000, 4_000_000


def gold(images, prompts) -> torch.Tensor:
    """The toy preset's training reward: the two exact rewards with equal weights, as a mean."""
    return (toy_color_position_reward(images, prompts) + toy_shape_count_reward(images, prompts)) / 2


# ---------------------------------------------------------------------------------------------------- data
@torch.no_grad()
def sample(pipe, kind, prompts: list[str], seeds: list[int], noise_levels: list[float], *, steps: int = 16,
           batch: int = 96, guidance: float = 3.5, log=None) -> torch.Tensor:
    """Images [B, 3, 32, 32] in [0, 1]: image k from noise seed seeds[k], by Euler steps of the toy pipeline's
    schedule with Flow-GRPO's SDE at noise level noise_levels[k] (0: the ODE) at every step but the last; its noise
    from seeds[k] too, so an image does not depend on the others in its batch."""
    from common import decode, encode_prompts, latent_shape, pipeline_sigmas, velocity
    shape = latent_shape(pipe, kind, 32)
    sig = pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape).double()
    out, t0 = [], time.time()
    for k in range(0, len(prompts), batch):
        emb = encode_prompts(pipe, kind, prompts[k:k + batch], max_sequence_length=16, cfg=guidance)
        x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds[k:k + batch]])
        a = torch.tensor(noise_levels[k:k + batch], dtype=torch.float32).view(-1, 1, 1, 1)
        gens = [torch.Generator().manual_seed(s + 10 ** 8) for s in seeds[k:k + batch]]  # the SDE's, per image
        for i in range(steps):
            s, dt = float(sig[i]), float(sig[i + 1] - sig[i])
            v = torch.cat([velocity(pipe.transformer, kind, x[c], s, {n: e[c] for n, e in emb.items()},
                                    guidance=guidance) for c in torch.arange(len(x)).split(48)])
            eps = torch.stack([torch.randn(shape, generator=g) for g in gens])
            if i < steps - 1:  # flow_grpo.sde_step: g = a sqrt(sigma / (1 - sigma)), sigma = 1 -> sigmas[1] below
                g = a * math.sqrt(s / (1 - (float(sig[1]) if s == 1 else s)))
                x = x + (v + g ** 2 / (2 * s) * (x + (1 - s) * v)) * dt + g * math.sqrt(-dt) * eps
            else:
                x = x + v * dt
        out.append(decode(pipe, x))
        if log and (k // batch) % 10 == 9:
            log(f"  sampled {k + len(x)}/{len(prompts)} ({time.time() - t0:.0f}s)")
    return torch.cat(out)


def make_data(pipe, kind, n: int, *, prompt_seed: int, noise_seed: int, noise_levels: list[float], log) -> dict:
    prompts = toy_prompts(n, seed=prompt_seed)
    levels = [noise_levels[k % len(noise_levels)] for k in range(n)]
    images = sample(pipe, kind, prompts, list(range(noise_seed, noise_seed + n)), levels, log=log)
    return dict(images=images, prompts=prompts, levels=torch.tensor(levels), labels=gold(images, prompts))


def edit(prompt: str, rng: random.Random, kinds=("colour", "shape", "position")) -> str:
    """The prompt with one thing changed: an object's colour (to one not in the prompt) or shape, or where the
    objects are (one object: another position; two: their positions swapped)."""
    objs = [list(o) for o in parse_toy_prompt(prompt)]
    what, j = rng.choice(kinds), rng.randrange(len(objs))
    if what == "colour":
        objs[j][0] = rng.choice([c for c in COLOURS if c not in [o[0] for o in objs]])
    elif what == "shape":
        objs[j][1] = rng.choice([s for s in SHAPES if s != objs[j][1]])
    elif len(objs) == 1:
        objs[0][2] = rng.choice([q for q in POSITIONS if q != objs[0][2]])
    else:
        objs[0][2], objs[1][2] = objs[1][2], objs[0][2]
    return " and ".join(f"a {c} {s} {PHRASE[q]}" for c, s, q in objs)


def with_edits(data: dict, fraction: float, seed: int, kinds=("colour", "shape", "position")) -> dict:
    """The data plus round(fraction * n) of its images again under an edited prompt (edit), with its exact
    reward: what changes when the prompt asks for something else than the image shows."""
    n = len(data["prompts"])
    m = round(fraction * n)
    if m == 0:
        return data
    rng = random.Random(seed)
    pick = sorted(rng.sample(range(n), m)) if m < n else list(range(n))
    prompts = [edit(data["prompts"][i], rng, kinds) for i in pick]
    images = data["images"][pick]
    return dict(images=torch.cat([data["images"], images]), prompts=data["prompts"] + prompts,
                levels=torch.cat([data["levels"], data["levels"][pick]]),
                labels=torch.cat([data["labels"], gold(images, prompts)]))


# ---------------------------------------------------------------------------------------------------- training
def agreement(pred: torch.Tensor, label: torch.Tensor) -> dict:
    """Pearson and Spearman correlations and the mean squared error of predictions against labels."""
    def pearson(a, b):
        a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
        return (a * b).sum().item() / max((a.square().sum() * b.square().sum()).sqrt().item(), 1e-12)
    rank = lambda v: v.argsort().argsort().double()  # noqa: E731
    return dict(pearson=round(pearson(pred, label), 4), spearman=round(pearson(rank(pred), rank(label)), 4),
                mse=round((pred - label).square().mean().item(), 5), n=len(label))


@torch.no_grad()
def predict(net, images, cond, batch: int = 512) -> torch.Tensor:
    net.eval()
    return torch.cat([net(images[k:k + batch], cond[k:k + batch]) for k in range(0, len(images), batch)])


def train(train_data: dict, heldout: dict, args, log) -> ProxyNet:
    """ProxyNet from args.seed: AdamW on the squared error, cosine learning rate after a warm-up, fixed batches."""
    torch.manual_seed(args.seed)
    net = ProxyNet(width=args.width, hidden=args.hidden)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    x, c, y = train_data["images"], prompt_features(train_data["prompts"]), train_data["labels"]
    hx, hc, hy = heldout["images"], prompt_features(heldout["prompts"]), heldout["labels"]
    gen = torch.Generator().manual_seed(args.seed + 1)
    index = {}
    for i, p in enumerate(train_data["prompts"]):
        index.setdefault(p, []).append(i)
    members = torch.nn.utils.rnn.pad_sequence([torch.tensor(v) for v in index.values()], batch_first=True)
    sizes = torch.tensor([len(v) for v in index.values()])
    groups = torch.arange(len(sizes))[sizes >= 2]  # prompts with two images or more
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        # a batch of whole groups: args.group images of each of batch_size / group prompts (GRPO's view)
        g = groups[torch.randint(len(groups), (args.batch_size // args.group,), generator=gen)]
        pick = (torch.rand(len(g), args.group, generator=gen) * sizes[g, None]).long()
        b = members[g[:, None], pick].flatten()
        net.train()
        pred = net(x[b], c[b])
        loss = (pred - y[b]).square().mean()
        if args.group_weight:  # the squared error of each score's deviation from its group's mean
            dev = lambda v: v.view(-1, args.group) - v.view(-1, args.group).mean(1, keepdim=True)  # noqa: E731
            loss = loss + args.group_weight * (dev(pred) - dev(y[b])).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 500 == 0 or step == args.steps - 1:
            fit = agreement(predict(net, x, c), y)
            held = agreement(predict(net, hx, hc), hy)
            log(f"step {step + 1} loss {loss.item():.4f} train mse {fit['mse']:.4f} held-out mse {held['mse']:.4f} "
                f"pearson {held['pearson']:.3f} ({time.time() - t0:.0f}s)")
    return net.eval().requires_grad_(False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "proxy"), help="directory for proxy.safetensors/.json")
    ap.add_argument("--model", default=os.path.join(HERE, "flux-shapes"), help="the toy pipeline that samples")
    ap.add_argument("--seed", type=int, default=0, help="prompts, noise, initialisation and batches")
    ap.add_argument("--train-images", type=int, default=12288, help="base-model samples to train on")
    ap.add_argument("--heldout-images", type=int, default=1024, help="other samples, for the agreement only")
    ap.add_argument("--noise-levels", type=float, nargs="+", default=[0.0, 0.7, 1.4],
                    help="SDE noise levels, cycled over the images (0: the ODE)")
    ap.add_argument("--edits", type=float, default=1.0, help="share of images added under an edited prompt")
    ap.add_argument("--edit-kinds", nargs="+", default=["colour", "shape", "position"],
                    choices=["colour", "shape", "position"], help="what an edit may change")
    ap.add_argument("--width", type=int, default=24, help="channels of the first conv layer")
    ap.add_argument("--hidden", type=int, default=64, help="width of the prompt MLP and the head")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--group", type=int, default=8, help="images per prompt in a batch (drawn with replacement)")
    ap.add_argument("--group-weight", type=float, default=1.0,
                    help="weight of the error in each image's deviation from its prompt's mean in the batch")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--cache", default=None, help="a .pt file for the sampled data (reused when it matches)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t0 = time.time()
    recipe = dict(model=os.path.abspath(args.model), seed=args.seed, noise_levels=args.noise_levels)
    cached = torch.load(args.cache) if args.cache and os.path.isfile(args.cache) else None
    if cached and cached["recipe"] == recipe and len(cached["train"]["labels"]) >= args.train_images and \
            len(cached["heldout"]["labels"]) >= args.heldout_images:  # the first n of more: the same images
        data = {k: {f: v[:n] for f, v in cached[k].items()} for k, n in (("train", args.train_images),
                                                                         ("heldout", args.heldout_images))}
        log(f"data from {args.cache}")
    else:
        from common import load_pipeline
        pipe, kind = load_pipeline(args.model, "cpu")
        log(f"sampling {args.train_images} training and {args.heldout_images} held-out images "
            f"(noise levels {args.noise_levels}; ~{(args.train_images + args.heldout_images) / 20:.0f}s per core)")
        data = dict(recipe=recipe,
                    train=make_data(pipe, kind, args.train_images, prompt_seed=TRAIN_PROMPT_SEED + 1000 * args.seed,
                                    noise_seed=TRAIN_NOISE_SEED, noise_levels=args.noise_levels, log=log),
                    heldout=make_data(pipe, kind, args.heldout_images,
                                      prompt_seed=HELDOUT_PROMPT_SEED + 1000 * args.seed,
                                      noise_seed=HELDOUT_NOISE_SEED, noise_levels=args.noise_levels, log=log))
        if args.cache:
            torch.save(data, args.cache)
    train_data = with_edits(data["train"], args.edits, seed=5000 + args.seed, kinds=args.edit_kinds)
    for name, d in (("train", train_data), ("held-out", data["heldout"])):
        log(f"{name}: {len(d['labels'])} pairs, exact reward mean {d['labels'].mean():.3f} std {d['labels'].std():.3f}")
    log(f"training ProxyNet for {args.steps} steps")
    net = train(train_data, data["heldout"], args, log)

    held = data["heldout"]
    pred = predict(net, held["images"], prompt_features(held["prompts"]))
    two = torch.tensor([" and " in p for p in held["prompts"]])
    subsets = {"all": torch.ones_like(two)}
    subsets.update({f"noise_{a:g}": held["levels"] == a for a in args.noise_levels})
    subsets.update({"one_object": ~two, "two_objects": two})
    agree = {k: agreement(pred[m], held["labels"][m]) for k, m in subsets.items() if m.any()}
    log("held-out agreement: " + "; ".join(f"{k} pearson {v['pearson']:.3f} spearman {v['spearman']:.3f} "
                                           f"mse {v['mse']:.4f}" for k, v in agree.items()))

    from safetensors.torch import save_file
    os.makedirs(args.out, exist_ok=True)
    weights = os.path.join(args.out, "proxy.safetensors")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, weights)
    about = {
        "about": "the toy world's learned proxy of (toy_color_position + toy_shape_count) / 2 (toy/proxy.py), "
                 "made by toy/make_proxy.py with the arguments below",
        "architecture": dict(width=args.width, hidden=args.hidden),
        "parameters": sum(p.numel() for p in net.parameters()), "bytes": os.path.getsize(weights),
        "arguments": {k: v for k, v in vars(args).items() if k not in ("out", "model", "cache", "threads")},
        "threads": args.threads,
        "data": {"train_pairs": len(train_data["labels"]), "train_label_mean": round(train_data["labels"].mean().item(), 4),
                 "heldout_label_mean": round(held["labels"].mean().item(), 4)},
        "heldout_agreement": agree, "seconds": round(time.time() - t0),
    }
    with open(os.path.join(args.out, "proxy.json"), "w") as f:
        json.dump(about, f, indent=1)
    log(f"wrote {weights} ({about['parameters']:,} parameters, {about['bytes'] / 1e3:.0f} kB) after {about['seconds']}s")


if __name__ == "__main__":
    main()
