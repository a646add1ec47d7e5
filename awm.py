# AWM (Xue et al., 2025, arXiv 2509.25050); docs: README.md#awm
"""AWM (Advantage Weighted Matching): SA-Solver rollouts, Flow-GRPO's advantages, a PPO-clipped ratio of the
log-likelihoods -w(mse(v(x_t, t), eps - x0)) of the final image re-noised at stratified timesteps, two KLs.

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
from common import flow_matching_log_prob, max_over_ranks, sa_solver, stratified_indices


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
    num_steps: int = 14
    """T, the number of sampling steps during training"""
    eval_steps: int = 40
    """ODE sampling steps for evaluation"""
    group_size: int = 24
    """G, images per prompt (a group never spans ranks)"""
    prompts_per_iteration: int = 24
    """prompts (groups) per iteration over all ranks; a multiple of the world size"""
    micro_batch: int = 12
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    noise_level: float = 0.0
    """SA-Solver's stochasticity tau on the steps to 0.3 <= t <= 0.9 (0: a deterministic sampler)"""
    train_timesteps: int = 6
    """timesteps per sample, one per stratum, shared by a micro-batch, drawn anew for each micro-batch"""
    time_type: Literal["discrete", "discrete_wo_init", "discrete_with_init"] = "discrete"
    """strata of the schedule indices [0, int(T fraction)) (_wo_init: from 1; _with_init: 0, then from 1)"""
    timestep_fraction: float = 0.9
    """the first int(T * fraction) sampling steps are trained"""
    global_std: bool = True
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 1e-4
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    advantage_max: float = 1.0
    """the clipped advantages are scaled to +-advantage_max"""
    weighting: Literal["ghuber", "huber", "Uniform", "t", "t**2"] = "ghuber"
    """log-prob of an mse at t: -((mse + 1e-10)^p - 1e-10^p) t / p, -(sqrt(mse + 1e-10) - 1e-5) t, -mse t^k"""
    ghuber_power: float = 0.25
    """p of the ghuber weighting"""
    clip_range: float = 1.0
    """PPO ratio clip range"""
    beta: float = 1e-4
    """KL coefficient against the reference model (LoRA off, or a frozen copy when fully fine-tuning)"""
    ema_beta: float = 1.0
    """KL coefficient, mean (v - v_ema)^2, against the KL-EMA of the weights (beta's: mean (v - v_ref)^2)"""
    kl_ema_decay: float = 0.3
    """the KL-EMA after each iteration: d kl_ema + (1 - d) weights"""
    kl_ema_decay_type: Literal["linear", "constant"] = "linear"
    """d = min(kl_ema_decay, 0.001 x optimizer steps) (linear) or kl_ema_decay (constant)"""

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
    ema_decay: float = 0.99
    """EMA decay, reached after the warm-up min((1 + s) / (10 + s), decay) of s optimizer steps"""
    ema_every: int = 1
    """EMA update interval in optimizer steps"""
    num_iterations: int = 300
    """number of iterations (rollout + update)"""
    eval_every: int = 50
    """evaluate every N iterations and at the end (0: never)"""
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 50
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (README: the toy world). Explicit flags still win.
TOY = {**TOY_WORLD, "learning_rate": 1e-4, "prompts_per_iteration": 8, "global_std": False, "beta": 0.04,
       "ema_beta": 1.0}


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if int(args.num_steps * args.timestep_fraction) < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of {args.num_steps}; raise it")
    most = int(args.num_steps * args.timestep_fraction) - (args.time_type == "discrete_wo_init")
    if args.train_timesteps > most:
        fail(f"--train-timesteps {args.train_timesteps} is not allowed with --time-type {args.time_type}; "
             f"use 1..{most} (one per trainable step)")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_* (zero advantages skip some)."""
    trained, n = args.train_timesteps, args.prompts_per_iteration * args.group_size
    # "old": the old log-probs of the terms of every mini-batch after the first, one forward each
    return {"rollout": args.group_size * args.num_steps,
            "train": trained * args.group_size,
            "reference": trained * args.group_size if args.beta > 0 else 0,
            "ema": trained * args.group_size if args.ema_beta > 0 else 0,
            "old": trained * (n - -(-n // args.updates_per_iteration)) / args.prompts_per_iteration}


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
    kl_ema = [p.detach().clone() for p in params.values()]  # the KL-EMA ("ema" adapter), not the eval EMA
    if ckpt:
        ema = load_state(ckpt, transformer=transformer, optimizer=optimizer, params=params,
                         sharded=sharded, device=device, ema=args.ema, learning_rate=args.learning_rate,
                         weight_decay=args.weight_decay, extra={"kl_ema": kl_ema})
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

    def awm_log_prob(v, target, t: float):
        """A training term's log-prob: minus the weighted flow-matching error (compute_log_prob_awm)."""
        mse = ((v.double() - target.double()) ** 2).mean(dim=(1, 2, 3))  # mean (v - (eps - x0))^2, float64
        return flow_matching_log_prob(mse, t, args.weighting, args.ghuber_power)

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

        # ALGO LOGIC: rollout (SA-Solver on the schedule; its last step returns the data prediction x0)
        train_steps = list(range(args.train_timesteps))
        prompts = [train_prompts[i] for i in torch.randint(len(train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, G, C, H, W, generator=gen).reshape(P * G, C, H, W).to(device)
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=sharded):
            v_of = lambda x_t, t: velocities(transformer, kind, x_t, t, emb, rows=group,  # noqa: E731
                                             chunks=chunks, guidance=args.guidance)
            x0 = sa_solver(v_of, x, sigmas, noise_level=args.noise_level, generator=gen)
            images = torch.cat([decode(pipe, x0[c]) for c in chunks])
        nfe_rollout = NFE["count"] - nfe_start
        t_rollout = time.time() - t_start

        # ALGO LOGIC: rewards and advantages (one reward per image, broadcast to every trained step)
        scores = score(reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(device)).cpu() for k, v in scores.items()}
        advantages = combine_advantages(all_scores, weights, mode=args.reward_combine, eps=args.adv_eps,
                                        unbiased=False, global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip) / args.adv_clip * args.advantage_max
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(device)
        advantages = advantages.expand(T, -1)  # [T, N]: an advantage per step and sample

        # ALGO LOGIC: policy update (the PPO-clipped ratio of per-step log-probs, the KL to the reference)
        sums = dict.fromkeys(["terms", "ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl"], 0.0)
        sums["ema_kl"] = 0.0
        first_ratio_dev = 0.0  # max |ratio - 1| in the first mini-batch: 0 if sampling and training agree
        grad_norms = []
        # all ranks' samples, none dropped (AWM), into mini-batches, alike on all ranks
        trained_advantages = torch.ones(1, P * G * world)
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        micro_batches = -(-trained_advantages.shape[1] // args.micro_batch)  # as many as one process has
        minibatches = training_minibatches(trained_advantages, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches, generator=same_on_ranks)
        # the training terms, all drawn before the first step (train:1138-1232): in each mini-batch a timestep
        # per stratum and micro-batch, and fresh noise per (timestep, micro-batch)
        terms = []
        for minibatch in minibatches:
            chunks = rank_chunks(minibatch, rank=rank, world=world, per_rank=P * G,
                                 micro_batch=args.micro_batch, sharded=sharded)  # this rank's part of it
            times = sigmas[stratified_indices(n_train, len(train_steps), len(chunks), kind=args.time_type,
                                              generator=gen)]  # a timestep per stratum and micro-batch
            terms.append([[(c, weight, float(times[m][j]), torch.randn(x0[c].shape, generator=gen))
                           for m, (c, weight) in enumerate(chunks)] for j in train_steps])
        # the old log-probs of the later mini-batches' terms, computed before the first step (train:1227-1238)
        old_log_probs = {}
        with torch.no_grad(), amp, gathered(transformer, sharded=sharded):
            for u, j in [(u, j) for u in range(1, len(terms)) for j in train_steps]:
                for m, (c, weight, t, eps) in enumerate(terms[u][j]):
                    x_t = (1 - t) * x0[c] + t * eps.to(device)
                    v = velocity(transformer, kind, x_t, t, select(emb, group[c]), guidance=args.guidance)
                    old_log_probs[u, j, m] = awm_log_prob(v, eps.to(device) - x0[c], t)
        for u, minibatch_terms in enumerate(terms):
            has_gradient = False
            for j in train_steps:
                for m, (c, weight, t, eps) in enumerate(minibatch_terms[j]):
                    adv = advantages[j][c]
                    signal = weight > 0 and (args.beta > 0 or args.ema_beta > 0 or bool((adv != 0).any()))
                    if not signal and not sharded:
                        continue  # no gradient (sharded runs run it: every rank joins the collectives)
                    has_gradient = has_gradient or signal
                    emb_c = select(emb, group[c])
                    eps = eps.to(device)
                    x_t = (1 - t) * x0[c] + t * eps
                    if args.ema_beta > 0:  # before the policy's forward: the KL-EMA is swapped in in place
                        with torch.no_grad(), amp, swapped_in(list(params.values()), kl_ema):
                            v_ema = velocity(transformer, kind, x_t, t, emb_c, guidance=args.guidance)
                    with amp:
                        v = velocity(transformer, kind, x_t, t, emb_c,
                                     guidance=args.guidance)
                    log_prob = awm_log_prob(v, eps - x0[c], t)
                    # the first mini-batch's old log-prob is this forward's (train:1282-1284): a ratio of 1
                    old_log_prob = log_prob.detach() if u == 0 else old_log_probs[u, j, m]
                    ratio = torch.exp(log_prob - old_log_prob)
                    clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                    policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
                    kl = torch.zeros_like(policy_loss)
                    if args.beta > 0:  # the mean squared velocity difference (AWM's code)
                        with torch.no_grad(), amp, as_reference(transformer, ref_model) as reference:
                            v_ref = velocity(reference, kind, x_t, t, emb_c,
                                             guidance=args.guidance)
                        kl = ((v.double() - v_ref.double()) ** 2).mean()
                    ema_kl = ((v.double() - v_ema.double()) ** 2).mean() if args.ema_beta > 0 else kl * 0
                    loss = policy_loss + args.beta * kl + args.ema_beta * ema_kl
                    (loss * weight / len(train_steps)).backward()  # the mean over the mini-batch's terms
                    if weight == 0:
                        continue  # a sharded rank's extra forward: it joins the collectives, adds no term
                    log_ratio = (log_prob - old_log_prob).detach()
                    sums["terms"] += len(c)
                    sums["ratio_mean"] += ratio.detach().sum()
                    sums["clipfrac"] += ((ratio.detach() - 1).abs() > args.clip_range).sum()
                    sums["approx_kl"] += (0.5 * log_ratio**2).sum()
                    sums["policy_loss"] += policy_loss.detach() * len(c)
                    sums["kl"] += kl.detach() * len(c)
                    sums["ema_kl"] += ema_kl.detach() * len(c)
                    if u == 0:
                        first_ratio_dev = max(first_ratio_dev, (ratio.detach() - 1).abs().max().item())
            norm = optimizer_step(params, optimizer, max_grad_norm=args.max_grad_norm, sharded=sharded,
                                  has_gradient=has_gradient)
            if norm is not None:
                grad_norms.append(norm)
        n_updates = (iteration + 1) * args.updates_per_iteration  # optimizer steps planned so far
        if ema is not None and (n_updates + 1) % args.ema_every == 0:  # once per iteration (train:1391-1392)
            ema_update(ema, list(params.values()), args.ema_decay, n_updates)
        # the KL-EMA after the iteration, by the optimizer steps so far (official: after the eval EMA)
        d = min(args.kl_ema_decay, 1e-3 * n_updates if args.kl_ema_decay_type == "linear" else 1.0)
        ema_update(kl_ema, list(params.values()), d, n_updates, warmup=False)

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
                       pipe=pipe, sharded=sharded, keep=args.keep_checkpoints, extra={"kl_ema": kl_ema})
    if is_main:
        writer.close()
        print(run_summary(run_dir, args=args, kind=kind, weights=weights, seconds=time.time() - t0))
    close_distributed()
