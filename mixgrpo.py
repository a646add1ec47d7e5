# MixGRPO (Li et al., 2025, arXiv 2507.21802); docs: docs/mixgrpo.md
"""MixGRPO: mixed ODE-SDE sampling: Flow-GRPO's SDE inside a window of steps that slides along the schedule
during training, deterministic ODE steps outside it, only the window's steps trained; with --flash the steps
after the window are replaced by fewer second-order DPM-Solver++ steps (MixGRPO-Flash).

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
from common import as_reference, shifted_sigmas


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
    rewards: tuple[str, ...] = ("hps", "imagereward", "pickscore")
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
    num_steps: int = 25
    """T, the number of sampling steps during training"""
    eval_steps: int = 50
    """ODE sampling steps for evaluation"""
    group_size: int = 12
    """G, images per prompt (a group never spans ranks)"""
    prompts_per_iteration: int = 32
    """prompts (groups) per iteration over all ranks; a multiple of the world size"""
    micro_batch: int = 3
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    shift: float = 3.0
    """the schedule shift u / (1 + (shift - 1) u) on linspace(1, 0, T + 1)"""
    noise_level: float = 0.7
    """eta, the SDE noise level (Flow-GRPO's form): std_dev_t = eta sqrt(sigma / (1 - sigma))"""
    window_size: int = 4
    """the SDE steps of the sliding window (all trained); the steps outside it are ODE steps"""
    window_stride: int = 1
    """the steps the window moves by every --window-shift-interval iterations (0: fixed, Flash*)"""
    window_shift_interval: int = 25
    """iterations between window moves"""
    window_strategy: Literal["progressive", "random"] = "progressive"
    """the window slides from the first step (GRPOTrainingStates), or starts at random each iteration"""
    flash: bool = False
    """MixGRPO-Flash: the steps after the window by second-order multistep DPM-Solver++"""
    flash_compress: float = 0.4
    """Flash: int((T - L) compress) points after the window's last step L (Flash*: 0.2)"""
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
    learning_rate: float = 1e-5
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    updates_per_iteration: int = 4
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
TOY = {**TOY_WORLD, "learning_rate": 1e-4, "noise_level": 0.7, "prompts_per_iteration": 8,
       "window_shift_interval": 5, "global_std": False, "updates_per_iteration": 1}


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if not 1 <= args.window_size <= args.num_steps - 2:
        fail(f"--window-size {args.window_size} is not allowed; use 1..{args.num_steps - 2} (T - 2)")
    if args.beta > 0 and args.noise_level == 0:
        fail("--beta > 0 needs --noise-level > 0 (the KL divides by the step's variance); pass --beta 0")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def window_steps(args, iteration: int) -> list[int]:
    """The SDE (trained) steps of an iteration: MixGRPO's GRPOTrainingStates as a function of the iteration.
    From step 0 the window moves by the stride every shift interval, shrinks near the last index T - 3 and
    rolls back to 0 after the last start that leaves it non-empty; random: a start in 0..T - 2 - size."""
    last = args.num_steps - 2  # the official max_timesteps: the window stops before it
    if args.window_strategy == "random":  # drawn alike on every rank
        gen = iteration_generator(args.seed, iteration, 0, stream=2)
        start = int(torch.randint(last - args.window_size + 1, (1,), generator=gen))
    else:
        starts = (last - 1) // args.window_stride + 1 if args.window_stride else 1  # 0, s, 2s, ... < last
        start = args.window_stride * (iteration // args.window_shift_interval % starts)
    return list(range(start, min(start + args.window_size, last)))


def flash_points(args, last: int) -> int:
    """Flash's points from sigma_{L+1} to 0 after the window's last step L: int(max((T - L) compress, 1)), at
    least 2 (the official code then stops at sigma_{L+1} > 0 and decodes a noisy latent)."""
    return max(int(max((args.num_steps - last) * args.flash_compress, 1)), 2)


def dpm_solver_step(x, x0, x0_prev, sigma: float, sigma_prev: float, sigma_next: float):
    """Multistep DPM-Solver++ (order 2, "midpoint") on the data predictions x0 = x - sigma v, from sigma to
    sigma_next: x_next = (sigma_next / sigma) x - alpha_next (e^-h - 1) (x0 + (x0 - x0_prev) / (2 r)), with
    lambda = log(alpha / sigma), alpha = 1 - sigma, h = lambda_next - lambda, r = (lambda - lambda_prev) / h;
    first order (DDIM) without x0_prev (or from sigma_prev = 1); the last step, to sigma = 0, lands on x0."""
    if sigma_next == 0:
        return x0
    h = math.log((1 - sigma_next) * sigma / (sigma_next * (1 - sigma)))
    d = x0
    if x0_prev is not None and sigma_prev < 1:  # second order: D0 + D1 / 2
        r = math.log((1 - sigma) * sigma_prev / (sigma * (1 - sigma_prev))) / h
        d = x0 + (x0 - x0_prev) / (2 * r)
    return (sigma_next / sigma) * x - (1 - sigma_next) * math.expm1(-h) * d


def planned_nfe(args, iteration: int = 0) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_* (zero advantages skip some)."""
    window = window_steps(args, iteration)
    steps = window[-1] + flash_points(args, window[-1]) if args.flash else args.num_steps
    trained = len(window)
    return {"rollout": args.group_size * steps,
            "train": trained * args.group_size,
            "reference": trained * args.group_size if args.beta > 0 else 0}


def sde_step(v, x, sigmas, i: int, noise_level: float, *, prev_sample=None, generator=None):
    """One Euler-Maruyama step sigmas[i] -> sigmas[i + 1] (dt < 0) of the marginal-preserving SDE (Eq. 9)
    dx = [v + g^2 / (2 sigma) (x + (1 - sigma) v)] dt + g dW, g = a sqrt(sigma / (1 - sigma)) (std_dev_t):
    x_next (drawn unless `prev_sample` gives it) and its log-probability, in float32; noise level 0 is the
    ODE's Euler step (log-prob 0). Returns (x_next, log_prob, mean, std)."""
    v, x = v.float(), x.float()
    sigma, dt = float(sigmas[i]), float(sigmas[i + 1]) - float(sigmas[i])
    below = float(sigmas[1]) if sigma > 1 - 1e-4 else sigma  # official: sigma = 1 -> sigmas[1] (and 1 - 1e-6)
    g = noise_level * math.sqrt(sigma / (1 - below))  # Flow-GRPO's (MixGRPO's sde_step_with_logprob)
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
    run.weights = {k: w / sum(run.weights.values()) for k, w in run.weights.items()}  # MixGRPO: they sum to 1
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = shifted_sigmas(T, shift=args.shift)  # DanceGRPO's schedule (evaluation: the pipeline's)

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (the SDE in the window, ODE steps elsewhere; Flash: DPM-Solver++ after it)
        window = window_steps(args, iteration)
        last = window[-1]
        noise_levels = [args.noise_level if i in window else 0.0 for i in range(T)]
        schedule = sigmas
        if args.flash:  # after L: flash_points of the shifted linspace from u_{L+1} to 0
            grid = torch.linspace(1 - (last + 1) / T, 0, flash_points(args, last), dtype=torch.float64)[1:]
            tail = (args.shift * grid / (1 + (args.shift - 1) * grid)).float()
            schedule = torch.cat([sigmas[:last + 2], tail])
        prompts = [run.train_prompts[i] for i in torch.randint(len(run.train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, 1, *shape, generator=gen)  # one initial noise per group, as its scripts
        x = x.expand(P, G, *shape).reshape(P * G, *shape).to(run.device)
        latents = [x]
        old_log_probs = []
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=run.sharded):
            x0_prev = None  # the data prediction of the step before (Flash's solver history)
            for i in range(len(schedule) - 1):
                v = velocities(transformer, kind, latents[i], schedule[i], emb, rows=group, chunks=chunks,
                               guidance=args.guidance)
                x0 = latents[i] - schedule[i] * v  # the data prediction x0_hat
                if args.flash and i > last:
                    s = schedule[i - 1:i + 2].tolist()
                    latents.append(dpm_solver_step(latents[i], x0, x0_prev, s[1], s[0], s[2]))
                    x0_prev = x0
                    continue
                x0_prev = x0
                x_next = torch.empty_like(latents[i])
                log_prob = torch.empty(P * G, device=run.device)
                for c in chunks:  # the same micro-batches draw the noise, in order
                    x_next[c], log_prob[c], _, _ = sde_step(v[c], latents[i][c], sigmas, i, noise_levels[i],
                                                            generator=gen)
                latents.append(x_next)
                old_log_probs.append(log_prob)
            images = torch.cat([decode(run.pipe, latents[-1][c]) for c in chunks])

        # ALGO LOGIC: rewards and advantages (each reward z-scored in its group, summed)
        scores = score(run.reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = combined_advantages(all_scores, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                         global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(run.device)

        # ALGO LOGIC: policy update (the PPO-clipped ratio of per-step log-probs at the window's steps)
        stats = Stats("ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl",
                      maxima=("first_ratio_max_dev",))  # means over the terms; the maximum over the ranks
        # every rank's micro-batches in order, split into the mini-batches (DanceGRPO's loop: no shuffle)
        consecutive = torch.tensor_split(torch.arange(len(chunks)), args.updates_per_iteration)
        minibatches = [torch.cat([r * P * G + chunks[m] for r in range(world) for m in ms.tolist()])
                       for ms in consecutive]
        for u, minibatch in enumerate(minibatches):
            terms = micro_batches(minibatch, steps=window, part=run.part,
                                  signal=lambda j, c: args.beta > 0 or (advantages[c] != 0).any())
            for j, c, scale in terms:
                adv = advantages[c]
                emb_c = select(emb, group[c])
                with amp:
                    v = velocity(transformer, kind, latents[j][c], sigmas[j], emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond)
                _, log_prob, mean, std = sde_step(v, latents[j][c], sigmas, j, noise_levels[j],
                                                  prev_sample=latents[j + 1][c])
                ratio = torch.exp(log_prob - old_log_probs[j][c])
                clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
                kl = torch.zeros_like(policy_loss)
                if args.beta > 0:  # the KL of the step means (Flow-GRPO's code)
                    with torch.no_grad(), amp, as_reference(transformer, run.ref_model) as reference:
                        v_ref = velocity(reference, kind, latents[j][c], sigmas[j], emb_c,
                                         guidance=args.guidance)
                    _, _, mean_ref, _ = sde_step(v_ref, latents[j][c], sigmas, j, noise_levels[j],
                                                 prev_sample=latents[j + 1][c])
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
        planned = planned_nfe(args, iteration)["rollout"]  # the window moves
        run.end_iteration(iteration, stats, scores=all_scores, samples=(images[:G], prompts[0], scores),
                          metrics={"perf/nfe_min_per_prompt": planned})
    run.finish()
