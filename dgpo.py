# DGPO (Luo et al., 2025, arXiv 2510.08425, ICLR 2026); docs: docs/dgpo.md
"""DGPO (Direct Group Preference Optimization): DPM-Solver++ ODE rollouts, Flow-GRPO's advantages, final
images re-noised at shared timesteps: flow-matching errors weighted by A and their group's sigmoid DPO margin.

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (TOY_WORLD, RewardModels, as_reference, check_common_args, decode, encode_prompts, fail,
                    gather_cat, gathered, iteration_generator, micro_batches, score, select, velocities,
                    velocity)
from rundir import Stats, parse_args, start_run
# algorithm specific
from common import dpm_schedule, dpm_solver, ema_update, swapped_in


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
    model: str = "sd3.5-medium"
    """a hub id, a local pipeline directory, or an alias: sd3.5-medium, flux-dev, toy (the toy world)"""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """compute dtype on CUDA; the trainable weights and the SDE math stay float32"""
    resolution: int = 512
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
    max_sequence_length: int = 128
    """prompt length in tokens (T5's, or the family's text encoder's)"""
    text_cache: str | None = None
    """a directory of text embeddings, each prompt encoded once before training; no text encoder is kept"""
    guidance: float = 4.5
    """the rollout's classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux);
    training forwards are conditional (no negative prompt)"""
    detach_uncond: bool = False
    """true CFG in the training forwards: no gradient through the unconditional prediction (Flow-GRPO's code
    before 2025-08-19, a482878); by default the gradient flows through both, as in every current code base"""

    # Data and rewards
    prompts: str = "data/pickscore/train.txt"
    """training prompts, one per line ('toy': the toy world's grammar)"""
    eval_prompts: str = "data/pickscore/test.txt"
    """held-out evaluation prompts, one per line ('toy': the toy world's grammar)"""
    rewards: tuple[str, ...] = ("pickscore",)
    """rewards: hps, clip, pickscore, imagereward, aesthetic, unifiedreward, ocr, geneval, deqa, jpeg, toy;
    editing: image_similarity, editreward (docs/editing.md)"""
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
    prompts_per_iteration: int = 8
    """prompts (groups) per iteration over all ranks; a multiple of the world size"""
    micro_batch: int = 24
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    flow_shift: float = 3.0
    """the shift of the rollout's DPM-Solver++(2M) schedule (dpm_schedule)"""
    train_timesteps: int = 4
    """M, distinct steps of the first trunc_steps + 1, drawn per iteration and shared by every sample"""
    trunc_steps: int = 6
    """the last trainable sampling step (6 of 10: sigma >= 0.666)"""
    beta_dpo: float = 10.0
    """the DPO temperature of a group's margin beta_dpo / G sum A (mse - mse_ref)"""
    ema_reference: bool = False
    """the DPO margin against the EMA reference instead of the base model (TDM-R1's dynamic reference)"""
    global_std: bool = True
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 1e-4
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    clip_range: float = 5e-2
    """PPO ratio clip range"""
    beta: float = 1e-3
    """KL coefficient against the reference model (LoRA off, or a frozen copy when fully fine-tuning)"""
    switch_ema_ref: int = 200
    """the rollouts sample with the EMA reference once more than this many optimizer steps are done"""

    # Optimisation
    full_finetune: bool = False
    """train every transformer weight (FSDP2 across ranks) instead of LoRA adapters"""
    gradient_checkpointing: bool = True
    """recompute each block's activations in the backward pass (a third more compute, less memory)"""
    lora_rank: int = 64
    """LoRA rank"""
    lora_alpha: int = 128
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
    ema_every: int = 8
    """EMA update interval in optimizer steps"""
    num_iterations: int = 300
    """number of iterations (rollout + update)"""
    eval_every: int = 60
    """evaluate every N iterations and at the end (0: never)"""
    eval_base: bool = True
    """evaluate the base model before the first iteration of a new run (--no-eval-base: runs that share it)"""
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 60
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (docs/toy_world.md). Explicit flags still win.
TOY = {**TOY_WORLD, "learning_rate": 1e-4, "prompts_per_iteration": 8, "global_std": False, "beta": 0.04,
       "trunc_steps": 9}  # 9 of 16 steps: sigma >= 0.70, as 6 of 10 in the paper's setting


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if args.trunc_steps >= args.num_steps:
        fail(f"--trunc-steps {args.trunc_steps} is not allowed; use 0..{args.num_steps - 1} (sampling steps)")
    if args.train_timesteps > args.trunc_steps + 1:
        fail(f"--train-timesteps {args.train_timesteps} is not allowed with --trunc-steps "
             f"{args.trunc_steps}; use 1..{args.trunc_steps + 1} (distinct steps)")
    if args.micro_batch % args.group_size:
        fail(f"--micro-batch {args.micro_batch} is not allowed; use a multiple of --group-size "
             f"{args.group_size} (a group's DPO margin needs its errors in one forward)")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards, the reference model's (its KL, the DPO margin's) and the EMA reference's (the clip); tested
    against the measured perf/nfe_*."""
    trained = args.train_timesteps * args.group_size
    return {"rollout": args.group_size * args.num_steps,
            "train": trained,
            "reference": trained if args.beta > 0 or not args.ema_reference else 0,
            "ema_ref": trained}


def group_advantages(rewards, *, eps: float, global_std: bool):
    """GRPO's advantages (Eq. 4) of rewards [P, G], P groups of a prompt's G images: (r - the group's mean) /
    (std + eps), the population std of the group or of all P G rewards (global_std); 0 for equal rewards."""
    r = rewards.double()
    std = r.std(unbiased=False) if global_std else r.std(dim=1, keepdim=True, unbiased=False)
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
                    reference=args.beta > 0 or not args.ema_reference, copies=("ema_ref",))
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas, model_sigmas = dpm_schedule(T, shift=args.flow_shift)  # DGPO's schedule (for every family)
    params, ema_ref = list(run.params.values()), run.copies["ema_ref"]  # the EMA reference (train:629)

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (an ODE with CFG; after switch_ema_ref steps the EMA reference's, train:799-800)
        train_steps = list(range(args.train_timesteps))
        prompts = [run.train_prompts[i] for i in torch.randint(len(run.train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, G, *shape, generator=gen).reshape(P * G, *shape).to(run.device)
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        sampler = ema_ref if iteration * args.updates_per_iteration > args.switch_ema_ref else None
        with torch.no_grad(), amp, swapped_in(params, sampler), gathered(transformer, sharded=run.sharded):
            v_of = lambda x_t, t: velocities(transformer, kind, x_t, t, emb, rows=group,  # noqa: E731
                                             chunks=chunks, guidance=args.guidance)
            x0 = dpm_solver(v_of, x, sigmas, model_sigmas)
            images = torch.cat([decode(run.pipe, x0[c]) for c in chunks])
        emb = {k: v for k, v in emb.items() if not k.startswith("neg_")}  # training without CFG (train:312)

        # ALGO LOGIC: rewards and advantages (one reward per image, broadcast to every trained step)
        scores = score(run.reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = combined_advantages(all_scores, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                         global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)  # train:1127-1131
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(run.device)
        advantages = advantages.expand(T, -1)  # [T, N]: an advantage per step and sample

        # ALGO LOGIC: policy update (errors weighted by A sigmoid(their group's DPO margin), clipped; the KL)
        stats = Stats("ratio_mean", "clipfrac", "policy_loss", "kl", "dpo_weight", "mse")  # means over terms
        # whole groups of every rank, in order, into mini-batches (the official trains its sampling batches)
        groups, parts = torch.arange(P * G * world).view(world, P, G), args.updates_per_iteration
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        minibatches = [groups[:, i].flatten() for i in torch.arange(P).tensor_split(parts)]
        # M distinct steps of the first trunc_steps + 1 (train:1062-1064), a noise per group and step (:1102)
        times = model_sigmas[torch.randperm(args.trunc_steps + 1, generator=same_on_ranks)]  # the first M
        noise = torch.randn(len(train_steps), P, *shape, generator=gen)
        terms = []
        for minibatch in minibatches:
            drawn = micro_batches(minibatch, steps=train_steps, part=run.part)
            terms.append([(j, c, scale, float(times[j]), noise[j][group[c]]) for j, c, scale in drawn])
        for u, minibatch_terms in enumerate(terms):
            for k, (j, c, scale, t, eps) in enumerate(minibatch_terms):
                adv = advantages[j][c]
                emb_c = select(emb, group[c])
                eps = eps.to(run.device)
                x_t = (1 - t) * x0[c] + t * eps  # the final image re-noised
                with torch.no_grad(), amp, swapped_in(params, ema_ref):  # before the policy's graph (:1116)
                    v_ema = velocity(transformer, kind, x_t, t, emb_c, guidance=args.guidance)
                with amp:
                    v = velocity(transformer, kind, x_t, t, emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond)
                if args.beta > 0 or not args.ema_reference:  # the base model (kl_cfg 1: conditional)
                    with torch.no_grad(), amp, as_reference(transformer, run.ref_model) as reference:
                        v_ref = velocity(reference, kind, x_t, t, emb_c,
                                         guidance=args.guidance)
                # each image's flow-matching error (train:1132)
                error = lambda w: ((eps - x0[c] - w.double()) ** 2).flatten(1).mean(1)  # noqa: E731
                mse, mse_ema = error(v), error(v_ema)
                mse_ref = mse_ema if args.ema_reference else error(v_ref)  # use_ema_ref (train:1122-1124)
                # the clip (clip_dsm, train:1133-1144): detached once past 1 +- eps in the direction of A
                ratio = torch.exp(mse_ema - mse)
                clipped = torch.where(adv > 0, ratio > 1 + args.clip_range, ratio < 1 - args.clip_range)
                dsm = torch.where(clipped, mse.detach(), mse)
                # times A sigmoid(S_g), S_g = beta_dpo / G sum_g A (mse - mse_ref) detached (train:162-193)
                margin = torch.zeros(P, dtype=mse.dtype, device=mse.device).index_add_(
                    0, group[c].to(mse.device), adv * args.beta_dpo * (mse - mse_ref).detach() / G)
                weight = torch.sigmoid(margin)[group[c]]
                policy_loss = (weight * adv * dsm).mean()
                kl = ((v.double() - v_ref.double()) ** 2).mean() if args.beta > 0 else policy_loss * 0
                loss = policy_loss + args.beta * kl  # train:1150-1156
                (loss * scale).backward()  # scale: this term's share of the mini-batch's mean
                stats.add(scale, terms=len(c), ratio_mean=ratio.sum(), clipfrac=clipped.sum(), mse=mse.sum(),
                          policy_loss=policy_loss * len(c), kl=kl * len(c), dpo_weight=weight.sum())
            stats.step(run.optimizer_step(minibatch_terms))
            steps = iteration * args.updates_per_iteration + u + 1  # optimizer steps so far
            run.ema_step(steps)  # after every step (official: once per micro-batch, train:1214-1215)
            # the EMA reference after every step, d = min(0.3, 0.001 x the steps before it) (train:1175-1177)
            ema_update(ema_ref, params, min(0.3, 1e-3 * (steps - 1)), steps, warmup=False)

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        kept = sum(map(len, minibatches)) / (P * G * world)  # the share of the samples trained on
        run.end_iteration(iteration, stats, scores=all_scores, metrics={"train/kept_fraction": kept},
                          samples=(images[:G], prompts[0], scores))
    run.finish()
