# MixGRPO (Li et al., 2025, arXiv 2507.21802); docs: README.md#mixgrpo
"""MixGRPO: mixed ODE-SDE sampling: Flow-GRPO's SDE inside a window of steps that slides along the schedule
during training, deterministic ODE steps outside it, only the window's steps trained; with --flash the steps
after the window are replaced by fewer second-order DPM-Solver++ steps (MixGRPO-Flash).

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro
from tqdm import tqdm

from common import (NFE, TOY_WORLD, RewardModels, check_common_args, close_distributed, combine_advantages,
                    decode, ema_update, encode_prompts, evaluate_policy, fail, gather_cat, gathered,
                    iteration_generator, latent_shape, load_pipeline, load_prompt_set, load_rewards,
                    make_trainable, max_over_ranks, optimizer_step, parse_args, pipeline_sigmas, score,
                    sde_step, seed_everything, select, setup_distributed, sum_over_ranks, swapped_in,
                    velocities, velocity)
from rundir import (image_grid, load_state, log_metrics, make_writer, resume_checkpoint, run_directory,
                    run_summary, save_eval_grid, save_state)
# algorithm specific
from common import as_reference, sde_mean_std, shifted_sigmas


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 0
    """seed of the experiment (prompts, noise and model initialisation)"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
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
    """image height and width in pixels"""
    max_sequence_length: int = 512
    """T5 prompt length in tokens"""
    guidance: float = 3.5
    """classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux)"""

    # Data and rewards
    prompts: str = "data/hpdv2/train.txt"
    """training prompts, one per line ('toy': the toy world's grammar)"""
    eval_prompts: str = "data/hpdv2/test.txt"
    """held-out evaluation prompts, one per line ('toy': the toy world's grammar)"""
    rewards: tuple[str, ...] = ("hps", "imagereward", "pickscore")
    """rewards: hps, clip, pickscore, imagereward, aesthetic, unifiedreward, ocr, geneval, deqa, jpeg, toy"""
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
    """PPO ratio clip range"""
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
    eval_num: int = 400
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (README: the toy world). Explicit flags still win.
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


if __name__ == "__main__":
    args = parse_args(Args, toy=TOY, description=__doc__)
    rank, world, device = setup_distributed()
    is_main = rank == 0
    check_args(args, world)
    ckpt, start = None, 0
    if args.resume:
        script = os.path.basename(__file__)
        ckpt, start = resume_checkpoint(args.resume, args=args, world=world, script=script)

    # the prompts before the run directory: a missing prompt file leaves nothing behind
    train_prompts = load_prompt_set(args.prompts, split="train", rewards=args.rewards)
    eval_prompts = load_prompt_set(args.eval_prompts, split="test",
                                   rewards=args.rewards + args.eval_rewards)

    # TRY NOT TO MODIFY: run name (runs/<model>__<exp_name>__<seed>__<time>), logging, seeding
    run_dir = run_directory(args, checkpoint=ckpt)
    if is_main:
        writer = make_writer(run_dir, args, resume_iteration=start if ckpt else None)
    seed_everything(args.seed, deterministic=args.torch_deterministic)

    # TRY NOT TO MODIFY: model, rewards, prompts, optimizer
    use_bf16 = args.mixed_precision == "bf16" and device.type == "cuda"
    compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    # the rewards first: a reward file that cannot be read fails before the large model loads
    weights = dict(zip(args.rewards, args.reward_weights or [1.0] * len(args.rewards)))
    weights = {k: w / sum(weights.values()) for k, w in weights.items()}  # MixGRPO: the weights sum to 1
    eval_fns = load_rewards(args.rewards + args.eval_rewards, device, models=args.reward_models,
                            dtype=compute_dtype)
    reward_fns = {k: eval_fns[k] for k in args.rewards}
    pipe, kind = load_pipeline(args.model, device, dtype=compute_dtype)
    transformer = pipe.transformer
    C, H, W = latent_shape(pipe, kind, args.resolution)
    # FSDP2 across ranks; LoRA runs average their gradients (DDP style)
    sharded = args.full_finetune and world > 1
    params, ref_model = make_trainable(
        transformer, kind, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        full_finetune=args.full_finetune, reference=args.beta > 0, sharded=sharded,
        compute_dtype=compute_dtype, checkpointing=args.gradient_checkpointing)
    optimizer = torch.optim.AdamW(params.values(), lr=args.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=args.weight_decay, eps=1e-8)
    ema = [p.detach().float().clone() for p in params.values()] if args.ema else None
    if ckpt:
        ema = load_state(ckpt, transformer=transformer, optimizer=optimizer, params=params,
                         sharded=sharded, device=device, ema=args.ema, learning_rate=args.learning_rate,
                         weight_decay=args.weight_decay)
    # bf16 autocast only for unsharded full fine-tuning: LoRA and FSDP2 already compute in bf16
    use_autocast = use_bf16 and args.full_finetune and not sharded
    amp = torch.autocast(device.type, dtype=compute_dtype, enabled=use_autocast, cache_enabled=False)
    P, G, T = args.prompts_per_iteration // world, args.group_size, args.num_steps
    # training samples with the shifted schedule, evaluation with the pipeline's own
    sigmas = shifted_sigmas(T, shift=args.shift)
    eval_sigmas = pipeline_sigmas(pipe, kind, num_steps=args.eval_steps, image_tokens=H * W // 4)

    def evaluate(iteration):
        """ODE samples of the fixed held-out prompt/seed pairs, scored by every reward."""
        with swapped_in(list(params.values()), ema):
            scores, images, prompts, local = evaluate_policy(
                transformer, pipe=pipe, kind=kind, prompts=eval_prompts, rewards=eval_fns,
                num_pairs=args.eval_num, sigmas=eval_sigmas, guidance=args.guidance,
                max_sequence_length=args.max_sequence_length, micro_batch=args.micro_batch,
                shape=(C, H, W), sharded=sharded, rank=rank, world=world, device=device, autocast=amp)
        if is_main:
            means = {f"eval/{k}": v.mean() for k, v in scores.items()}
            log_metrics(writer, run_dir, iteration, means, per_sample=scores)
            save_eval_grid(run_dir, iteration, images, prompts, local)
        weighted = sum(weights[k] * scores[k].mean() for k in args.rewards) / sum(weights.values())
        return iteration, weighted.item()

    t0 = time.time()
    # iteration 0: the base model
    last_eval = evaluate(0) if start == 0 and args.eval_every else None
    bar = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}"
    pbar = tqdm(range(start, args.num_iterations), disable=not is_main, initial=start,
                total=args.num_iterations, bar_format=bar)
    for iteration in pbar:
        t_start, cpu_start = time.time(), time.process_time()
        nfe_start = NFE["count"]
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (the SDE in the window, ODE steps elsewhere; Flash: DPM-Solver++ after it)
        window = window_steps(args, iteration)
        last = window[-1]
        noise_levels = [args.noise_level if i in window else 0.0 for i in range(T)]
        schedule = sigmas
        if args.flash:  # after L: flash_points of the shifted linspace from u_{L+1} to 0
            u = torch.linspace(1 - (last + 1) / T, 0, flash_points(args, last), dtype=torch.float64)[1:]
            tail = (args.shift * u / (1 + (args.shift - 1) * u)).float()
            schedule = torch.cat([sigmas[:last + 2], tail])
        nfe_min = planned_nfe(args, iteration)["rollout"]
        prompts = [train_prompts[i] for i in torch.randint(len(train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, 1, C, H, W, generator=gen)  # one initial noise per group, as its scripts
        x = x.expand(P, G, C, H, W).reshape(P * G, C, H, W).to(device)
        latents = [x]
        old_log_probs = []
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=sharded):
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
                log_prob = torch.empty(P * G, device=device)
                for c in chunks:  # the same micro-batches draw the noise, in order
                    x_next[c], log_prob[c], _, _ = sde_step(v[c], latents[i][c], sigmas, i,
                                                            noise_levels[i], generator=gen)
                latents.append(x_next)
                old_log_probs.append(log_prob)
            images = torch.cat([decode(pipe, latents[-1][c]) for c in chunks])
        nfe_rollout = NFE["count"] - nfe_start
        t_rollout = time.time() - t_start

        # ALGO LOGIC: rewards and advantages (each reward z-scored in its group, summed)
        scores = score(reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(device)).cpu() for k, v in scores.items()}
        advantages = combine_advantages(all_scores, weights, mode=args.reward_combine, eps=args.adv_eps,
                                        unbiased=True, global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(device)

        # ALGO LOGIC: policy update (the PPO-clipped ratio of per-step log-probs at the window's steps)
        sums = dict.fromkeys(["terms", "ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl"], 0.0)
        first_ratio_dev = 0.0  # max |ratio - 1| in the first mini-batch: 0 if sampling and training agree
        grad_norms = []
        minibatches = torch.tensor_split(torch.arange(len(chunks)), args.updates_per_iteration)
        for u, minibatch in enumerate(minibatches):
            n_terms = sum(len(chunks[m]) for m in minibatch) * len(window)
            has_gradient = False
            for j in window:
                for m in minibatch.tolist():
                    c = chunks[m]
                    adv = advantages[c]
                    signal = args.beta > 0 or bool((adv != 0).any())
                    if not signal and not sharded:
                        continue  # no gradient (sharded runs run it: every rank joins the collectives)
                    has_gradient = has_gradient or signal
                    emb_c = select(emb, group[c])
                    with amp:
                        v = velocity(transformer, kind, latents[j][c], sigmas[j], emb_c,
                                     guidance=args.guidance)
                    _, log_prob, mean, std = sde_step(v, latents[j][c], sigmas, j, noise_levels[j],
                                                      prev_sample=latents[j + 1][c])
                    ratio = torch.exp(log_prob - old_log_probs[j][c])
                    clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                    policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
                    kl = torch.zeros_like(policy_loss)
                    if args.beta > 0:  # the KL of the step means (Flow-GRPO's code)
                        with torch.no_grad(), amp, as_reference(transformer, ref_model) as reference:
                            v_ref = velocity(reference, kind, latents[j][c], sigmas[j], emb_c,
                                             guidance=args.guidance)
                        mean_ref, _, _ = sde_mean_std(v_ref, latents[j][c], sigmas, j, noise_levels[j])
                        # official: / (2 std_dev_t^2) with std_dev_t^2 = std^2 / |dt|; exact: / (2 std^2)
                        step = float(sigmas[j] - sigmas[j + 1])  # |dt|
                        kl_var = std**2 if args.kl_form == "exact" else std**2 / step
                        kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)).mean() / (2 * kl_var)
                    loss = policy_loss + args.beta * kl
                    (loss * len(c) / n_terms).backward()
                    log_ratio = (log_prob - old_log_probs[j][c]).detach()
                    sums["terms"] += len(c)
                    sums["ratio_mean"] += ratio.detach().sum()
                    sums["clipfrac"] += ((ratio.detach() - 1).abs() > args.clip_range).sum()
                    sums["approx_kl"] += (0.5 * log_ratio**2).sum()
                    sums["policy_loss"] += policy_loss.detach() * len(c)
                    sums["kl"] += kl.detach() * len(c)
                    if u == 0:
                        first_ratio_dev = max(first_ratio_dev, (ratio.detach() - 1).abs().max().item())
            norm = optimizer_step(params, optimizer, max_grad_norm=args.max_grad_norm, sharded=sharded,
                                  has_gradient=has_gradient)
            if norm is not None:
                grad_norms.append(norm)
            n_updates = iteration * args.updates_per_iteration + u + 1  # optimizer steps planned so far
            if ema is not None and (n_updates + 1) % args.ema_every == 0:  # as Flow-GRPO: steps 7, 15, ...
                ema_update(ema, list(params.values()), args.ema_decay, n_updates)

        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        nfe = NFE["count"] - nfe_start
        totals = sum_over_ranks({**sums, "nfe": nfe, "nfe_rollout": nfe_rollout})
        n = max(totals["terms"], 1)
        metrics = {f"reward/{k}_mean": v.mean() for k, v in all_scores.items()}
        metrics.update({f"reward/{k}_std": v.std() for k, v in all_scores.items()})
        flat = torch.stack([v.max(1).values == v.min(1).values for v in all_scores.values()]).all(0)
        metrics["reward/zero_std_fraction"] = flat.float().mean()
        # means over the iteration's trained terms
        metrics.update({f"train/{k}": totals[k] / n for k in sums if k != "terms"})
        metrics["train/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["train/updates"] = len(grad_norms)
        metrics["train/first_ratio_max_dev"] = max_over_ranks(first_ratio_dev)
        metrics["perf/nfe_rollout_per_prompt"] = totals["nfe_rollout"] / (P * world)
        metrics["perf/nfe_min_per_prompt"] = nfe_min
        metrics["perf/nfe_per_iteration"] = totals["nfe"]
        metrics["perf/rollout_seconds"] = t_rollout
        metrics["perf/seconds_per_iteration"] = time.time() - t_start
        metrics["perf/cpu_seconds_per_iteration"] = time.process_time() - cpu_start  # this process
        if is_main:
            log_metrics(writer, run_dir, iteration + 1, metrics)
        last = iteration + 1 == args.num_iterations
        if args.eval_every and ((iteration + 1) % args.eval_every == 0 or last):
            last_eval = evaluate(iteration + 1)
        train_reward = sum(weights[k] * all_scores[k].mean() for k in args.rewards) / sum(weights.values())
        shown = "-" if last_eval is None else f"{last_eval[1]:.3f}@{last_eval[0]}"
        ratio_dev = metrics["train/first_ratio_max_dev"]
        pbar.set_postfix_str(f"train {train_reward:.3f} eval {shown} |r-1| {ratio_dev:.0e}")
        if is_main and args.log_images_every and (iteration + 1) % args.log_images_every == 0:
            captions = [f"{prompts[0][:40]}\n" + " ".join(f"{k}={v[i]:.3f}" for k, v in scores.items())
                        for i in range(G)]
            writer.add_figure("samples", image_grid(images[:G].cpu(), captions), iteration + 1)
        if (args.save_every and (iteration + 1) % args.save_every == 0) or last:
            save_state(os.path.join(run_dir, "checkpoints", f"iter_{iteration + 1}"), iteration=iteration + 1,
                       transformer=transformer, optimizer=optimizer, params=params, ema=ema, args=args,
                       pipe=pipe, sharded=sharded, keep=args.keep_checkpoints)
    if is_main:
        writer.close()
        print(run_summary(run_dir, args=args, kind=kind, weights=weights, seconds=time.time() - t0))
    close_distributed()
