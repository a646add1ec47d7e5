# DiffusionNFT (Zheng et al., 2025, arXiv 2509.16117); docs: README.md#diffusionnft
"""DiffusionNFT: an old policy's ODE rollouts; on freshly noised images (the forward process) r, the group
advantage as a probability, pulls (1 - b) v_old + b v to the data and 1 - r (1 + b) v_old - b v; old: an EMA.

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro
from tqdm import tqdm

from common import (NFE, TOY_WORLD, RewardModels, as_reference, check_common_args, close_distributed,
                    combine_advantages, decode, ema_update, encode_prompts, evaluate_policy, fail, gather_cat,
                    gathered, iteration_generator, latent_shape, load_pipeline, load_prompt_set, load_rewards,
                    make_trainable, optimizer_step, parse_args, pipeline_sigmas, rank_chunks, score,
                    seed_everything, select, setup_distributed, sum_over_ranks, swapped_in,
                    training_minibatches, velocities, velocity)
from rundir import (image_grid, load_state, log_metrics, make_writer, resume_checkpoint, run_directory,
                    run_summary, save_eval_grid, save_state)
# algorithm specific
from common import dpm2_step


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
    model: str = "sd3.5-medium"
    """a hub id, a local pipeline directory, or an alias: sd3.5-medium, flux-dev, toy (the toy world)"""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """compute dtype on CUDA; the trainable weights and the SDE math stay float32"""
    resolution: int = 512
    """image height and width in pixels"""
    max_sequence_length: int = 128
    """T5 prompt length in tokens"""
    guidance: float = 1.0
    """classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux)"""

    # Data and rewards
    prompts: str = "data/pickscore/train.txt"
    """training prompts, one per line ('toy': the toy world's grammar)"""
    eval_prompts: str = "data/pickscore/test.txt"
    """held-out evaluation prompts, one per line ('toy': the toy world's grammar)"""
    rewards: tuple[str, ...] = ("pickscore",)
    """rewards: hps, clip, pickscore, imagereward, aesthetic, unifiedreward, ocr, geneval, deqa, jpeg, toy"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward (none given: all 1)"""
    eval_rewards: tuple[str, ...] = ()
    """more rewards scored at evaluation only, never trained on (e.g. the toy world's toy_strict)"""
    reward_combine: Literal["rewards", "advantages"] = "rewards"
    """normalise the weighted sum of the rewards (Flow-GRPO), or each reward's advantage, then sum"""
    reward_models: tyro.conf.OmitArgPrefixes[RewardModels] = field(default_factory=RewardModels)
    """where each reward model's weights come from"""

    # Sampling
    num_steps: int = 10
    """T, the number of sampling steps during training"""
    eval_steps: int = 40
    """ODE sampling steps for evaluation"""
    group_size: int = 24
    """G, images per prompt (a group never spans ranks)"""
    prompts_per_iteration: int = 48
    """prompts (groups) per iteration over all ranks; a multiple of the world size"""
    micro_batch: int = 12
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    timestep_fraction: float = 0.99
    """each sample trains on int(T * fraction) of the T sampling timesteps, drawn at random"""
    global_std: bool = True
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 1e-4
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    nft_beta: float = 1.0
    """b, the implicit policies' step: v+ = (1 - b) v_old + b v, v- = (1 + b) v_old - b v (OCR: 0.1)"""
    decay_type: int = 1
    """the old policy's EMA after each iteration: 0, 1, or 2 (OCR) (README: DiffusionNFT, the old policy)"""
    beta: float = 1e-4
    """KL coefficient against the reference model (LoRA off, or a frozen copy when fully fine-tuning)"""

    # Optimisation
    full_finetune: bool = False
    """train every transformer weight (FSDP2 across ranks) instead of LoRA adapters"""
    gradient_checkpointing: bool = True
    """recompute each block's activations in the backward pass (a third more compute, less memory)"""
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: int = 64
    """LoRA alpha"""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    updates_per_iteration: int = 1
    """optimizer steps per iteration: the training terms split into this many mini-batches"""
    ema: bool = True
    """keep an EMA of the trainable weights for evaluation and the exported weights"""
    ema_decay: float = 0.9
    """EMA decay, reached after the warm-up min((1 + s) / (10 + s), decay) of s optimizer steps"""
    ema_every: int = 1
    """EMA update interval in optimizer steps"""
    num_iterations: int = 300
    """number of iterations (rollout + update)"""
    eval_every: int = 10
    """evaluate every N iterations and at the end (0: never)"""
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (README: the toy world). Explicit flags still win.
TOY = {**TOY_WORLD, "learning_rate": 1e-4, "prompts_per_iteration": 8, "global_std": False, "beta": 0.04,
       "timestep_fraction": 0.5}


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if int(args.num_steps * args.timestep_fraction) < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of {args.num_steps}; raise it")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_*."""
    trained = int(args.num_steps * args.timestep_fraction)
    return {"rollout": args.group_size * args.num_steps,
            "train": trained * args.group_size,
            "old": trained * args.group_size,
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
    old = [p.detach().clone() for p in params.values()]  # the old policy, shaped (sharded) like the weights
    if ckpt:
        ema = load_state(ckpt, transformer=transformer, optimizer=optimizer, params=params,
                         sharded=sharded, device=device, ema=args.ema, learning_rate=args.learning_rate,
                         weight_decay=args.weight_decay, extra={"old": old})
    # bf16 autocast only for unsharded full fine-tuning: LoRA and FSDP2 already compute in bf16
    use_autocast = use_bf16 and args.full_finetune and not sharded
    amp = torch.autocast(device.type, dtype=compute_dtype, enabled=use_autocast, cache_enabled=False)
    P, G, T = args.prompts_per_iteration // world, args.group_size, args.num_steps
    # training samples with the pipeline's own schedule (Flow-GRPO), evaluation too
    sigmas = pipeline_sigmas(pipe, kind, num_steps=T, image_tokens=H * W // 4)
    eval_sigmas = pipeline_sigmas(pipe, kind, num_steps=args.eval_steps, image_tokens=H * W // 4)
    n_train = int(T * args.timestep_fraction)
    nfe_min = planned_nfe(args)["rollout"]

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
        gen = iteration_generator(args.seed, iteration, 0)  # every rank draws all ranks' prompts and noise

        # ALGO LOGIC: rollout (the old policy's deterministic ODE, without CFG by default)
        train_steps = list(range(n_train))
        prompts = [train_prompts[i] for i in torch.randint(len(train_prompts), (P * world,), generator=gen)]
        prompts = prompts[rank * P:(rank + 1) * P]  # this rank's: 1 and N processes train the same samples
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(world * P * G, C, H, W, generator=gen)[rank * P * G:][:P * G].to(device)
        latents = [x]
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        weights_now = list(params.values())
        with torch.no_grad(), amp, swapped_in(weights_now, old), gathered(transformer, sharded=sharded):
            x0 = None
            for i in range(T):
                v = velocities(transformer, kind, latents[i], sigmas[i], emb, rows=group, chunks=chunks,
                               guidance=args.guidance)
                x_next, x0 = dpm2_step(v, latents[i], sigmas, i, x0_prev=x0)
                latents.append(x_next)
            images = torch.cat([decode(pipe, latents[-1][c]) for c in chunks])
        nfe_rollout = NFE["count"] - nfe_start
        t_rollout = time.time() - t_start

        # ALGO LOGIC: rewards and advantages (one reward per image, broadcast to every trained step)
        scores = score(reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(device)).cpu() for k, v in scores.items()}
        advantages = combine_advantages(all_scores, weights, mode=args.reward_combine, eps=args.adv_eps,
                                        unbiased=False, global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(device)
        r = (advantages / args.adv_clip / 2 + 0.5).clamp(0, 1)  # the optimality probability; the loss x clip

        # ALGO LOGIC: policy update (the implicit positive and negative policies on the forward process)
        sums = dict.fromkeys(["terms", "policy_loss", "kl", "old_deviation"], 0.0)
        grad_norms = []
        # all ranks' samples shuffled into mini-batches alike on every rank, each one's timesteps too
        trained_advantages = torch.ones(1, P * G * world)  # a loss for every sample, even at A = 0
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        micro_batches = -(-trained_advantages.shape[1] // args.micro_batch)  # as many as one process has
        minibatches = training_minibatches(trained_advantages, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches, generator=same_on_ranks)
        timesteps = torch.rand(P * G * world, T, generator=same_on_ranks).argsort(1)[rank * P * G:][:P * G]
        for u, minibatch in enumerate(minibatches):
            has_gradient = False
            chunks = rank_chunks(minibatch, rank=rank, world=world, per_rank=P * G,
                                 micro_batch=args.micro_batch, sharded=sharded)  # this rank's part of it
            for j in train_steps:
                eps = torch.randn(P * G * world, C, H, W, generator=same_on_ranks)[rank * P * G:][:P * G]
                for c, weight in chunks:
                    signal = weight > 0  # every sample has a loss, at A = 0 too
                    if not signal and not sharded:
                        continue  # no gradient (sharded runs run it: every rank joins the collectives)
                    has_gradient = has_gradient or signal
                    emb_c = select(emb, group[c])
                    sigma = sigmas[timesteps[c, j]].to(device)
                    t = sigma.view(-1, 1, 1, 1)
                    x0 = latents[T][c]  # the sample
                    x_t = (1 - t) * x0 + t * eps[c].to(device)  # the forward process, fresh noise
                    with torch.no_grad(), amp, swapped_in(weights_now, old):  # before the graph needs them
                        v_old = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance).float()
                    with amp:
                        v = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance).float()
                    # the implicit policies (Eq. 8) in x0 space, adaptive weights (train_nft_sd3.py): [L+, L-]
                    losses, dims = [], (1, 2, 3)
                    for v_implicit in (args.nft_beta * v + (1 - args.nft_beta) * v_old,
                                       (1 + args.nft_beta) * v_old - args.nft_beta * v):
                        x0_hat = x_t - t * v_implicit
                        w = (x0_hat.detach().double() - x0).abs().mean(dims, keepdim=True).clip(min=1e-5)
                        losses.append(((x0_hat - x0) ** 2 / w).mean(dims))
                    nft_loss = (r[c] * losses[0] + (1 - r[c]) * losses[1]) / args.nft_beta  # per sample
                    policy_loss = (nft_loss * args.adv_clip).mean()
                    kl = torch.zeros_like(policy_loss)
                    if args.beta > 0:  # the KL of the velocities (DiffusionNFT's code)
                        with torch.no_grad(), amp, as_reference(transformer, ref_model) as reference:
                            v_ref = velocity(reference, kind, x_t, sigma, emb_c,
                                             guidance=args.guidance)
                        kl = ((v - v_ref.float()) ** 2).mean(dims).mean()
                    loss = policy_loss + args.beta * kl
                    (loss * weight / len(train_steps)).backward()  # the mean over the mini-batch's terms
                    if weight == 0:
                        continue  # a sharded rank's extra forward: it joins the collectives, adds no term
                    sums["terms"] += len(c)
                    sums["policy_loss"] += policy_loss.detach() * len(c)
                    sums["kl"] += kl.detach() * len(c)
                    sums["old_deviation"] += ((v - v_old) ** 2).detach().mean(dims).sum()
            norm = optimizer_step(params, optimizer, max_grad_norm=args.max_grad_norm, sharded=sharded,
                                  has_gradient=has_gradient)
            if norm is not None:
                grad_norms.append(norm)
            n_updates = iteration * args.updates_per_iteration + u + 1  # optimizer steps planned so far
            if ema is not None and (n_updates + 1) % args.ema_every == 0:
                ema_update(ema, list(params.values()), args.ema_decay, n_updates)
        # the old policy follows after the iteration: old <- d old + (1 - d) current (return_decay)
        steps = (iteration + 1) * args.updates_per_iteration
        decay = [0.0, min(0.001 * steps, 0.5), 0.0 if steps < 75 else min(0.0075 * (steps - 75), 0.999)]
        ema_update(old, weights_now, decay[args.decay_type], steps, warmup=False)

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
        metrics["train/kept_fraction"] = sum(map(len, minibatches)) / (P * G * world)  # of the samples
        metrics["train/old_decay"] = decay[args.decay_type]
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
        pbar.set_postfix_str(f"train {train_reward:.3f} eval {shown}")
        if is_main and args.log_images_every and (iteration + 1) % args.log_images_every == 0:
            captions = [f"{prompts[0][:40]}\n" + " ".join(f"{k}={v[i]:.3f}" for k, v in scores.items())
                        for i in range(G)]
            writer.add_figure("samples", image_grid(images[:G].cpu(), captions), iteration + 1)
        if (args.save_every and (iteration + 1) % args.save_every == 0) or last:
            save_state(os.path.join(run_dir, "checkpoints", f"iter_{iteration + 1}"), iteration=iteration + 1,
                       transformer=transformer, optimizer=optimizer, params=params, ema=ema, args=args,
                       pipe=pipe, sharded=sharded, keep=args.keep_checkpoints, extra={"old": old})
    if is_main:
        writer.close()
        print(run_summary(run_dir, args=args, kind=kind, weights=weights, seconds=time.time() - t0))
    close_distributed()
