# Granular-GRPO (G2RPO, Zhou et al., 2025, arXiv 2510.01982); docs: README.md#g2rpo
"""G2RPO: one shared ODE trajectory per group; the members take a single SDE step at k, then the ODE again, so
the reward differences come from that step alone (Singular Stochastic Sampling); the advantages of ODE
completions at several strides lambda are summed (Multi-Granularity Advantage Integration).

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
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
from common import as_reference, ode_complete, ode_step, sde_mean_std, shifted_sigmas, strided_indices


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
    rewards: tuple[str, ...] = ("hps", "clip")
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
    eval_num: int = 400
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (README: the toy world). Explicit flags still win.
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


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_* (zero advantages skip some)."""
    # per member and k: one first velocity shared by the strides, then ceil((T - k - 1) / lambda) - 1 each
    completions = sum(1 + sum(-(-(args.num_steps - k - 1) // lam) - 1 for lam in args.lambdas)
                      for k in args.sde_steps if k + 1 < args.num_steps)
    return {"rollout": max(args.sde_steps) + 1 + args.group_size * completions,
            "train": len(args.sde_steps),
            "reference": len(args.sde_steps) if args.beta > 0 else 0}


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
    M = sorted(args.sde_steps)
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
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (Singular Stochastic Sampling: an ODE anchor, one SDE step at k, then ODE)
        prompts = [train_prompts[i] for i in torch.randint(len(train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, C, H, W, generator=gen).to(device)  # one initial noise per group
        anchor_x, anchor_v = {}, {}  # x_k and v(x_k) of each group's ODE anchor
        post, old_log_probs = {}, {}  # the members' latents after their SDE step at k, and its log-prob
        per_k = {}  # the rewards of the completions from k
        chunks = torch.arange(P).split(args.micro_batch)  # prompts per forward at the anchors
        members = [torch.arange(c[0] * G, (c[-1] + 1) * G) for c in chunks]  # the members of each chunk
        emb = encode_prompts(pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=sharded):
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
                images = torch.cat([decode(pipe, z) for z in x0.split(args.micro_batch)])
                per_k[k] = score(reward_fns, images, [prompts[g] for g in group.repeat(len(args.lambdas))])
        nfe_rollout = NFE["count"] - nfe_start
        t_rollout = time.time() - t_start

        # ALGO LOGIC: advantages per k: z-scores per stride and reward in a group, summed, clipped (Eq. 9-10)
        advantages, by_k = {}, {}
        for k in M:
            by_k[k] = {r: gather_cat(v.view(-1, P, G).to(device).transpose(0, 1)).transpose(0, 1).cpu()
                       for r, v in per_k[k].items()}  # [Lambda, P over all ranks, G]
            per_stride = [{r: v[s] for r, v in by_k[k].items()} for s in range(len(args.lambdas))]
            adv = sum(combine_advantages(rewards, weights, mode=args.reward_combine, eps=args.adv_eps,
                                         unbiased=True, global_std=args.global_std) for rewards in per_stride)
            adv = adv.clamp(-args.adv_clip, args.adv_clip)
            advantages[k] = adv[rank * P:(rank + 1) * P].reshape(-1).to(device)
        all_scores = {r: torch.cat([by_k[k][r].reshape(-1, G) for k in M]) for r in args.rewards}
        scores = {r: v[:G] for r, v in per_k[M[-1]].items()}  # the first group at the last k (logged)

        # ALGO LOGIC: policy update (the ratio at step k only, v(x_k) once per prompt; the k in mini-batches)
        sums = dict.fromkeys(["terms", "ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl"], 0.0)
        first_ratio_dev = 0.0  # max |ratio - 1| in the first mini-batch: 0 if sampling and training agree
        grad_norms = []
        minibatches = torch.tensor_split(torch.tensor(M), args.updates_per_iteration)
        for u, minibatch in enumerate(minibatches):
            n_terms = P * G * len(minibatch)
            has_gradient = False
            for j in minibatch.tolist():  # j: a trained step k
                for a, c in zip(chunks, members):  # a: the prompts at the anchor, c: their members
                    adv = advantages[j][c]
                    signal = args.beta > 0 or bool((adv != 0).any())
                    if not signal and not sharded:
                        continue  # no gradient (sharded runs run it: every rank joins the collectives)
                    has_gradient = has_gradient or signal
                    emb_c = select(emb, a)
                    rows = group[c] - a[0]  # each member reuses its prompt's v(x_k): they share x_k exactly
                    with amp:
                        v = velocity(transformer, kind, anchor_x[j][a], sigmas[j], emb_c,
                                     guidance=args.guidance)[rows]
                    _, log_prob, mean, std = sde_step(v, anchor_x[j][a][rows], sigmas, j, args.noise_level,
                                                      prev_sample=post[j][c])
                    ratio = torch.exp(log_prob - old_log_probs[j][c])
                    clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                    policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
                    kl = torch.zeros_like(policy_loss)
                    if args.beta > 0:  # the KL of the step means (Flow-GRPO's code)
                        with torch.no_grad(), amp, as_reference(transformer, ref_model) as reference:
                            v_ref = velocity(reference, kind, anchor_x[j][a], sigmas[j], emb_c,
                                             guidance=args.guidance)
                        mean_ref, _, _ = sde_mean_std(v_ref[rows], anchor_x[j][a][rows], sigmas, j,
                                                      args.noise_level)
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
