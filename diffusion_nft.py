# DiffusionNFT (Zheng et al., 2025, arXiv 2509.16117); docs: docs/diffusion_nft.md
"""DiffusionNFT: an old policy's ODE rollouts; on freshly noised images (the forward process) r, the group
advantage as a probability, pulls (1 - b) v_old + b v to the data and 1 - r (1 + b) v_old - b v; old: an EMA.

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (TOY_WORLD, RewardModels, as_reference, check_common_args, decode, encode_prompts, fail,
                    gather_cat, gathered, iteration_generator, micro_batches, pipeline_sigmas, score, select,
                    training_minibatches, velocities, velocity)
from rundir import Stats, parse_args, start_run
# algorithm specific
from common import dpm2_step, ema_update, swapped_in


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
    guidance: float = 1.0
    """classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux)"""
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
    """the old policy's EMA after each iteration: 0, 1, or 2 (OCR) (docs/diffusion_nft.md: the old policy)"""
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
    eval_base: bool = True
    """evaluate the base model before the first iteration of a new run (--no-eval-base: runs that share it)"""
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (docs/toy_world.md). Explicit flags still win.
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
                    reference=args.beta > 0, copies=("old",))
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = pipeline_sigmas(run.pipe, kind, num_steps=T, shape=run.shape)  # the pipeline's schedule
    n_train = int(T * args.timestep_fraction)
    params, old = list(run.params.values()), run.copies["old"]  # the old policy, shaped like the weights

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, 0)  # every rank draws all ranks' prompts and noise

        # ALGO LOGIC: rollout (the old policy's deterministic ODE, without CFG by default)
        train_steps = list(range(n_train))
        draws = torch.randint(len(run.train_prompts), (P * world,), generator=gen)
        prompts = [run.train_prompts[i] for i in draws]
        prompts = prompts[rank * P:(rank + 1) * P]  # this rank's: 1 and N processes train the same samples
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(world * P * G, *shape, generator=gen)[rank * P * G:][:P * G].to(run.device)
        latents = [x]
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, swapped_in(params, old), gathered(transformer, sharded=run.sharded):
            x0 = None
            for i in range(T):
                v = velocities(transformer, kind, latents[i], sigmas[i], emb, rows=group, chunks=chunks,
                               guidance=args.guidance)
                x_next, x0 = dpm2_step(v, latents[i], sigmas, i, x0_prev=x0)
                latents.append(x_next)
            images = torch.cat([decode(run.pipe, latents[-1][c]) for c in chunks])

        # ALGO LOGIC: rewards and advantages (one reward per image, broadcast to every trained step)
        scores = score(run.reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = combined_advantages(all_scores, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                         global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(run.device)
        r = (advantages / args.adv_clip / 2 + 0.5).clamp(0, 1)  # the optimality probability

        # ALGO LOGIC: policy update (the implicit positive and negative policies on the forward process)
        stats = Stats("policy_loss", "kl", "old_deviation")  # means over the terms
        # all ranks' samples shuffled into mini-batches alike on every rank, each one's timesteps too
        trained_advantages = torch.ones(1, P * G * world)  # a loss for every sample, even at A = 0
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        micro_batches_per_rank = -(-trained_advantages.shape[1] // args.micro_batch)
        minibatches = training_minibatches(trained_advantages, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches_per_rank, generator=same_on_ranks)
        timesteps = torch.rand(P * G * world, T, generator=same_on_ranks).argsort(1)[rank * P * G:][:P * G]
        for u, minibatch in enumerate(minibatches):
            terms = micro_batches(minibatch, steps=train_steps, part=run.part)  # every sample has a loss
            # the forward process's noise of each step, drawn alike on all ranks
            eps = [torch.randn(P * G * world, *shape, generator=same_on_ranks)[rank * P * G:][:P * G].clone()
                   for _ in train_steps]
            for j, c, scale in terms:
                emb_c = select(emb, group[c])
                sigma = sigmas[timesteps[c, j]].to(run.device)
                t = sigma.view(-1, *[1] * len(shape))
                x0 = latents[T][c]  # the sample
                x_t = (1 - t) * x0 + t * eps[j][c].to(run.device)  # the forward process, fresh noise
                with torch.no_grad(), amp, swapped_in(params, old):  # before the graph needs the weights
                    v_old = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance).float()
                with amp:
                    v = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond).float()
                # the implicit policies (Eq. 8) in x0 space, each error over its own mean (train_nft_sd3.py)
                losses, dims = [], tuple(range(1, 1 + len(shape)))
                for v_implicit in (args.nft_beta * v + (1 - args.nft_beta) * v_old,
                                   (1 + args.nft_beta) * v_old - args.nft_beta * v):
                    x0_hat = x_t - t * v_implicit
                    error = (x0_hat.detach().double() - x0).abs().mean(dims, keepdim=True).clip(min=1e-5)
                    losses.append(((x0_hat - x0) ** 2 / error).mean(dims))
                nft_loss = (r[c] * losses[0] + (1 - r[c]) * losses[1]) / args.nft_beta  # per sample
                # x adv_clip (official): r - 1/2 = A / (2 adv_clip) weighs L+ - L-, so this weighs it by A / 2
                policy_loss = (nft_loss * args.adv_clip).mean()
                kl = torch.zeros_like(policy_loss)
                if args.beta > 0:  # the KL of the velocities (DiffusionNFT's code)
                    with torch.no_grad(), amp, as_reference(transformer, run.ref_model) as reference:
                        v_ref = velocity(reference, kind, x_t, sigma, emb_c,
                                         guidance=args.guidance)
                    kl = ((v - v_ref.float()) ** 2).mean(dims).mean()
                loss = policy_loss + args.beta * kl
                (loss * scale).backward()  # scale: this term's share of the mini-batch's mean
                stats.add(scale, terms=len(c), policy_loss=policy_loss * len(c), kl=kl * len(c),
                          old_deviation=((v - v_old) ** 2).mean(dims).sum())
            stats.step(run.optimizer_step(terms))
            run.ema_step(iteration * args.updates_per_iteration + u + 1)
        # the old policy follows after the iteration: old <- d old + (1 - d) current (return_decay)
        steps = (iteration + 1) * args.updates_per_iteration
        decay = [0.0, min(0.001 * steps, 0.5), 0.0 if steps < 75 else min(0.0075 * (steps - 75), 0.999)]
        ema_update(old, params, decay[args.decay_type], steps, warmup=False)

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        kept = sum(map(len, minibatches)) / (P * G * world)  # the share of the samples trained on
        run.end_iteration(iteration, stats, scores=all_scores, samples=(images[:G], prompts[0], scores),
                          metrics={"train/kept_fraction": kept, "train/old_decay": decay[args.decay_type]})
    run.finish()
