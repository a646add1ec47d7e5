# Granular-GRPO (G2RPO, Zhou et al., 2025, arXiv 2510.01982); docs: docs/g2rpo.md
"""G2RPO: one shared ODE trajectory per group; the members take a single SDE step at k, then the ODE again, so
the reward differences come from that step alone (Singular Stochastic Sampling); the advantages of ODE
completions at several strides lambda are summed (Multi-Granularity Advantage Integration).

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (TOY_WORLD, RewardModels, check_common_args, decode, encode_prompts, fail, gather_cat,
                    gathered, iteration_generator, micro_batches, score, select, velocities, velocity)
from rundir import Stats, parse_args, start_run
# algorithm specific
from common import as_reference, ode_complete, shifted_sigmas


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 0
    """seed of the experiment (prompts, noise and model initialisation)"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    threads: int | None = None
    """torch threads per process on a CPU (none: $OMP_NUM_THREADS, else one per core that is not busy)"""
    track: bool = False
    """also log to Weights and Biases (syncs the TensorBoard logs)"""
    wandb_project: str = "flow-rl"
    """the wandb project name"""
    output_dir: str = "runs"
    """logs and checkpoints go to <output_dir>/<run_name>"""
    resume: str | None = None
    """a run directory to continue from its latest checkpoint"""

    # Model
    model: str = "flux-dev"
    """a hub id, a local pipeline directory, or an alias: sd3.5-medium, flux-dev, toy (the toy world)"""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """compute dtype on CUDA; the trainable weights and the SDE math stay float32"""
    resolution: int = 720
    """image height (and width, unless --width) in pixels"""
    width: int | None = None
    """image width in pixels, where it differs from the height"""
    num_frames: int | None = None
    """frames per sample, for models whose samples have them (docs/video.md; none: the model's default)"""
    fps: int = 16
    """frames per second of the exported samples, and of what a reward receives, where samples have frames"""
    condition_size: int | None = None
    """editing models: each source image resized to this many pixels' area (a side of a square) at its aspect
    ratio; 0: as it is; none: as the model's pipeline resizes it (docs/editing.md)"""
    max_sequence_length: int = 512
    """prompt length in tokens (T5's, or the family's text encoder's)"""
    text_cache: str | None = None
    """a directory of text embeddings, each prompt encoded once before training; no text encoder is kept"""
    guidance: float = 3.5
    """classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux)"""
    detach_uncond: bool = False
    """true CFG in the training forwards: no gradient through the unconditional prediction (Flow-GRPO's code
    before 2025-08-19, a482878); by default the gradient flows through both, as in every current code base"""

    # Data and rewards
    prompts: str = "data/hpdv2/train.txt"
    """training prompts, one per line ('toy': the toy world's grammar)"""
    eval_prompts: str = "data/hpdv2/test.txt"
    """held-out evaluation prompts, one per line ('toy': the toy world's grammar)"""
    rewards: tuple[str, ...] = ("hps", "clip")
    """rewards: hps, clip, pickscore, imagereward, aesthetic, unifiedreward, ocr, geneval, deqa, jpeg, toy;
    editing: image_similarity, editreward (docs/editing.md)"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward (none given: all 1)"""
    eval_rewards: tuple[str, ...] = ()
    """more rewards scored at evaluation only, never trained on (e.g. the toy world's toy_strict)"""
    reward_combine: Literal["rewards", "advantages"] = "advantages"
    """normalise the weighted sum of the rewards (Flow-GRPO), or each reward's advantage, then sum"""
    reward_models: tyro.conf.OmitArgPrefixes[RewardModels] = field(default_factory=RewardModels)
    """where each reward model's weights come from"""

    # Sampling
    num_steps: int = 16
    """T, the number of sampling steps during training"""
    eval_steps: int = 50
    """ODE sampling steps for evaluation"""
    group_size: int = 12
    """G, images per prompt (a group never spans ranks)"""
    prompts_per_iteration: int = 16
    """prompts (groups) per iteration over all ranks; a multiple of the world size"""
    micro_batch: int = 12
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    shift: float = 3.0
    """the schedule shift u / (1 + (shift - 1) u) on linspace(1, 0, T + 1)"""
    noise_level: float = 0.7
    """eta, the SDE noise level (Flow-GRPO's form): std_dev_t = eta sqrt(sigma / (1 - sigma))"""
    sde_steps: tuple[int, ...] = tuple(range(8))
    """M: the schedule indices k (0 = the noisiest step) that take the single SDE step and are trained"""
    lambdas: tuple[int, ...] = (1, 2, 3)
    """Lambda: the ODE-completion strides (granularities); (1,) is G2RPO w/o MGAI"""
    global_std: bool = False
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 1e-8
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    clip_range: float = 1e-4
    """PPO ratio clip range (tiny: the log-prob is a per-element mean, sde_step)"""
    beta: float = 0.0
    """KL coefficient against the reference model (0: none, as the paper)"""
    kl_form: Literal["official", "exact"] = "official"
    """KL scale: |mu - mu_ref|^2 / (2 std_dev_t^2) as Flow-GRPO's code, or the exact Gaussian KL"""

    # Optimisation
    full_finetune: bool = True
    """train every transformer weight (FSDP2 across ranks) instead of LoRA adapters"""
    gradient_checkpointing: bool = True
    """recompute each block's activations in the backward pass (a third more compute, less memory)"""
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: int = 64
    """LoRA alpha"""
    learning_rate: float = 2e-6
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    updates_per_iteration: int = 8
    """optimizer steps per iteration: the training terms split into this many mini-batches"""
    ema: bool = False
    """keep an EMA of the trainable weights for evaluation and the exported weights"""
    ema_decay: float = 0.9
    """EMA decay, reached after the warm-up min((1 + s) / (10 + s), decay) of s optimizer steps"""
    ema_every: int = 8
    """EMA update interval in optimizer steps"""
    num_iterations: int = 300
    """number of iterations (rollout + update)"""
    eval_every: int = 30
    """evaluate every N iterations and at the end (0: never)"""
    eval_base: bool = True
    """evaluate the base model before the first iteration of a new run (--no-eval-base: runs that share it)"""
    eval_num: int = 400
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (docs/toy_world.md). Explicit flags still win.
TOY = {**TOY_WORLD, "learning_rate": 1.25e-5, "noise_level": 0.5, "prompts_per_iteration": 4,
       "global_std": False}  # lr 1e-4 / 8: 8 optimizer steps per iteration


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if args.beta > 0 and args.noise_level == 0:
        fail("--beta > 0 needs --noise-level > 0 (the KL divides by the step's variance); pass --beta 0")
    for flag, values, low in (("--sde-steps", args.sde_steps, 0), ("--lambdas", args.lambdas, 1)):
        if not values or min(values) < low or max(values) >= args.num_steps or len(set(values)) < len(values):
            fail(f"{flag} {list(values)} is not allowed; give distinct values in {low}..{args.num_steps - 1}")
    most = len(args.sde_steps)  # one mini-batch per trained k at most (the default: one each)
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(one per trained k at most: --sde-steps gives {most})")


def strided_indices(start: int, end: int, stride: int) -> list[int]:
    """Indices start, start + stride, ... ending exactly at `end` (the last stride may be shorter)."""
    return list(range(start, end, stride)) + [end]


def ode_step(v, x, sigma: float, sigma_next: float):
    """Euler step of the probability-flow ODE dx = v dt (float32)."""
    return x.float() + v.float() * (float(sigma_next) - float(sigma))


def members_of(prompts, group_size: int):
    """The sample rows of a run of consecutive prompts (each prompt's G members follow each other)."""
    return torch.arange(prompts[0] * group_size, (prompts[-1] + 1) * group_size)


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_* (zero advantages skip some)."""
    # per member and k: one first velocity shared by the strides, then ceil((T - k - 1) / lambda) - 1 each
    completions = sum(1 + sum(-(-(args.num_steps - k - 1) // lam) - 1 for lam in args.lambdas)
                      for k in args.sde_steps if k + 1 < args.num_steps)
    return {"rollout": max(args.sde_steps) + 1 + args.group_size * completions,
            "train": len(args.sde_steps),
            "reference": len(args.sde_steps) if args.beta > 0 else 0}


def sde_step(v, x, sigmas, i: int, noise_level: float, *, prev_sample=None, generator=None):
    """One Euler-Maruyama step sigmas[i] -> sigmas[i + 1] (dt < 0) of the marginal-preserving SDE (Eq. 9)
    dx = [v + g^2 / (2 sigma) (x + (1 - sigma) v)] dt + g dW, g = a sqrt(sigma / (1 - sigma)) (std_dev_t):
    x_next (drawn unless `prev_sample` gives it) and its log-probability, in float32; noise level 0 is the
    ODE's Euler step (log-prob 0). Returns (x_next, log_prob, mean, std)."""
    v, x = v.float(), x.float()
    sigma, dt = float(sigmas[i]), float(sigmas[i + 1]) - float(sigmas[i])
    below = float(sigmas[1]) if sigma > 1 - 1e-4 else sigma  # official: sigma = 1 -> sigmas[1] (and 1 - 1e-6)
    g = noise_level * math.sqrt(sigma / (1 - below))  # Flow-GRPO's (G2RPO Eq. 3)
    mean, std = x + (v + g**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt, g * math.sqrt(-dt)
    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, device=generator.device if generator else x.device)
        prev_sample = mean + std * noise.to(x.device) if std > 0 else mean
    prev_sample = prev_sample.float()
    if std == 0:
        return prev_sample, torch.zeros(len(x), device=x.device), mean, std
    # log N(x_next; mean, std^2) averaged over the D elements of a latent (the official code), not summed: the
    # ratio is exp(log density ratio / D), hence a tiny --clip-range (1e-4: e^6.6 in density at SD3's 512 px)
    log_density = (-((prev_sample.detach() - mean) ** 2) / (2 * std**2) - math.log(std)
                   - 0.5 * math.log(2 * math.pi))
    return prev_sample, log_density.mean(dim=tuple(range(1, x.ndim))), mean, std


def group_advantages(rewards, *, eps: float, global_std: bool):
    """GRPO's advantages of rewards [P, G], P groups of a prompt's G images: (r - the group's mean) / (std +
    eps), the sample std (torch's default: DanceGRPO) of the group or of all P G rewards; 0 if all equal."""
    r = rewards.double()
    std = r.std() if global_std else r.std(dim=1, keepdim=True)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + eps)
    flat = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values
    return torch.where(flat, torch.zeros_like(adv), adv).float()


def combined_advantages(rewards: dict, weights: dict, *, mode: str, eps: float, global_std: bool):
    """Several rewards {name: [P, G]}: the advantages of their weighted sum (mode "rewards", Flow-GRPO) or the
    weighted sum of each one's advantages ("advantages")."""
    norm = {"eps": eps, "global_std": global_std}
    if mode == "advantages":
        return sum(weights[k] * group_advantages(r, **norm) for k, r in rewards.items())
    return group_advantages(sum(weights[k] * r for k, r in rewards.items()), **norm)


if __name__ == "__main__":
    args = parse_args(Args, toy=TOY, description=__doc__)
    # TRY NOT TO MODIFY: the process group, the run directory and its logs, the rewards, the model and its
    # trainable weights (LoRA, or FSDP2 across ranks), the reference, the optimizer; --resume restores them
    run = start_run(args, script=__file__, check_args=check_args, planned_nfe=planned_nfe,
                    reference=args.beta > 0)
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = shifted_sigmas(T, shift=args.shift)  # DanceGRPO's schedule (evaluation: the pipeline's)
    M = sorted(args.sde_steps)

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (Singular Stochastic Sampling: an ODE anchor, one SDE step at k, then ODE)
        prompts = [run.train_prompts[i] for i in torch.randint(len(run.train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, *shape, generator=gen).to(run.device)  # one initial noise per group
        anchor_x, anchor_v = {}, {}  # x_k and v(x_k) of each group's ODE anchor
        post, old_log_probs = {}, {}  # the members' latents after their SDE step at k, and its log-prob
        per_k = {}  # the rewards of the completions from k
        chunks = torch.arange(P).split(args.micro_batch)  # prompts per forward at the anchors
        members = [members_of(c, G) for c in chunks]  # the members of each chunk
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=run.sharded):
            for k in range(max(M) + 1):  # the anchor x_T -> x_k, keeping x_k and v(x_k)
                v = velocities(transformer, kind, x, sigmas[k], emb, rows=torch.arange(P), chunks=chunks,
                               guidance=args.guidance)
                anchor_x[k], anchor_v[k] = x, v
                x = ode_step(v, x, sigmas[k], sigmas[k + 1])
            for k in M:  # G SDE steps from the shared x_k (v(x_k) computed once), then ODE at every stride
                steps = [sde_step(anchor_v[k][group[m]], anchor_x[k][group[m]], sigmas, k, args.noise_level,
                                  generator=gen) for m in members]
                post[k] = torch.cat([s[0] for s in steps])
                old_log_probs[k] = torch.cat([s[1] for s in steps])
                paths = [strided_indices(k + 1, T, lam) for lam in args.lambdas for _ in range(P * G)]
                x0 = ode_complete(transformer, kind, post[k], paths, sigmas, emb, guidance=args.guidance,
                                  micro_batch=args.micro_batch, emb_index=group)
                images = torch.cat([decode(run.pipe, z) for z in x0.split(args.micro_batch)])
                completed = [prompts[g] for g in group.repeat(len(args.lambdas))]
                per_k[k] = score(run.reward_fns, images, completed)

        # ALGO LOGIC: advantages per k: z-scores per stride and reward in a group, summed, clipped (Eq. 9-10)
        advantages, by_k = {}, {}
        for k in M:
            by_k[k] = {r: gather_cat(v.view(-1, P, G).to(run.device).transpose(0, 1)).transpose(0, 1).cpu()
                       for r, v in per_k[k].items()}  # [Lambda, P over all ranks, G]
            per_stride = [{r: v[s] for r, v in by_k[k].items()} for s in range(len(args.lambdas))]
            adv = sum(combined_advantages(rewards, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                          global_std=args.global_std) for rewards in per_stride)
            adv = adv.clamp(-args.adv_clip, args.adv_clip)
            advantages[k] = adv[rank * P:(rank + 1) * P].reshape(-1).to(run.device)
        all_scores = {r: torch.cat([by_k[k][r].reshape(-1, G) for k in M]) for r in args.rewards}
        scores = {r: v[:G] for r, v in per_k[M[-1]].items()}  # the first group at the last k (logged)

        # ALGO LOGIC: policy update (the ratio at step k only, v(x_k) once per prompt; the k in mini-batches)
        stats = Stats("ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl",
                      maxima=("first_ratio_max_dev",))  # means over the terms; the maximum over the ranks
        minibatches = torch.tensor_split(torch.tensor(M), args.updates_per_iteration)
        prompts_part = {**run.part, "per_rank": P}  # a micro-batch: prompts at x_k (their members train)
        for u, minibatch in enumerate(minibatches):
            signal = lambda j, a: args.beta > 0 or (advantages[j][members_of(a, G)] != 0).any()  # noqa: E731
            terms = micro_batches(torch.arange(P * world), steps=minibatch.tolist(), part=prompts_part,
                                  signal=signal)
            for j, a, scale in terms:  # j: a trained step k, a: the prompts at the anchor
                c = members_of(a, G)
                adv = advantages[j][c]
                emb_c = select(emb, a)
                rows = group[c] - a[0]  # each member reuses its prompt's v(x_k): they share x_k exactly
                with amp:
                    v = velocity(transformer, kind, anchor_x[j][a], sigmas[j], emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond)[rows]
                _, log_prob, mean, std = sde_step(v, anchor_x[j][a][rows], sigmas, j, args.noise_level,
                                                  prev_sample=post[j][c])
                ratio = torch.exp(log_prob - old_log_probs[j][c])
                clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
                kl = torch.zeros_like(policy_loss)
                if args.beta > 0:  # the KL of the step means (Flow-GRPO's code)
                    with torch.no_grad(), amp, as_reference(transformer, run.ref_model) as reference:
                        v_ref = velocity(reference, kind, anchor_x[j][a], sigmas[j], emb_c,
                                         guidance=args.guidance)
                    _, _, mean_ref, _ = sde_step(v_ref[rows], anchor_x[j][a][rows], sigmas, j,
                                                 args.noise_level, prev_sample=post[j][c])
                    # official: / (2 std_dev_t^2) with std_dev_t^2 = std^2 / |dt|; exact: / (2 std^2)
                    step = float(sigmas[j] - sigmas[j + 1])  # |dt|
                    kl_var = std**2 if args.kl_form == "exact" else std**2 / step
                    kl = ((mean - mean_ref) ** 2).flatten(1).mean(1).mean() / (2 * kl_var)
                loss = policy_loss + args.beta * kl
                (loss * scale).backward()  # scale: this term's share of the mini-batch's mean
                log_ratio = log_prob - old_log_probs[j][c]
                stats.add(scale, terms=len(c), ratio_mean=ratio.sum(), policy_loss=policy_loss * len(c),
                          clipfrac=((ratio - 1).abs() > args.clip_range).sum(), kl=kl * len(c),
                          approx_kl=(0.5 * log_ratio**2).sum())
                if u == 0:  # max |ratio - 1| in the first mini-batch: 0 if sampling and training agree
                    stats.max(scale, first_ratio_max_dev=(ratio.detach() - 1).abs().max())
            stats.step(run.optimizer_step(terms))
            run.ema_step(iteration * args.updates_per_iteration + u + 1)  # as Flow-GRPO: steps 7, 15, ...

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        run.end_iteration(iteration, stats, scores=all_scores, samples=(images[:G], prompts[0], scores))
    run.finish()
