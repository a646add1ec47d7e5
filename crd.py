# CRD, Centered Reward Distillation (Zhu et al., 2026, arXiv 2603.14128); docs: docs/crd.md
"""CRD: a sampling model's ODE rollouts; on freshly noised images (the forward process) the implicit reward,
the old model's flow-matching error minus the policy's, centred within its prompt, matches the centred reward.

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (TOY_WORLD, RewardModels, as_reference, check_common_args, decode, encode_prompts, fail,
                    gather_cat, gathered, iteration_generator, micro_batches, pipeline_sigmas, score, select,
                    velocities, velocity)
from rundir import Stats, parse_args, start_run
# algorithm specific
import torch.nn.functional as F

from common import ema_update, swapped_in


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
    max_sequence_length: int = 256
    """prompt length in tokens (T5's, or the family's text encoder's)"""
    text_cache: str | None = None
    """a directory of text embeddings, each prompt encoded once before training; no text encoder is kept"""
    guidance: float = 1.0
    """classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux)"""
    detach_uncond: bool = False
    """true CFG in the training forwards: no gradient through the unconditional prediction (Flow-GRPO's code
    before 2025-08-19, a482878); by default the gradient flows through both, as in every current code base"""

    # Data and rewards
    prompts: str = "data/ocr/train.txt"
    """training prompts, one per line ('toy': the toy world's grammar)"""
    eval_prompts: str = "data/ocr/test.txt"
    """held-out evaluation prompts, one per line ('toy': the toy world's grammar)"""
    rewards: tuple[str, ...] = ("ocr",)
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
    micro_batch: int = 24
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    train_timesteps: int = 20
    """K, timesteps per group, one per stratum of the sampling steps with sigma >= 1 - fraction"""
    timestep_fraction: float = 0.99
    """the timesteps are drawn from the sampling steps with sigma >= 1 - fraction"""
    global_std: bool = True
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 0.0
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    crd_beta: float = 1.0
    """beta of the loss (beta R_theta - R)^2 between the centred implicit reward and the centred reward"""
    crd_loss: Literal["mse", "bce"] = "mse"
    """that squared error, or the cross-entropy of sigmoid(beta R_theta) against sigmoid(R)"""
    weight_temp: float = -1.0
    """the centring: -1 a group's mean; T > 0 the mean of centrings by softmax(r / T) and softmax(-r / T)"""
    adaptive_weights: bool = True
    """each flow-matching error over its detached mean absolute error, as DiffusionNFT's (adaptive_logp)"""
    old_decay: str = "0-0.25-0.005-0.999"
    """the old model's EMA decay after each iteration: start-value-slope-end or a preset (DECAYS)"""
    sampling_decay: str = "75-0.0-0.0075-0.999"
    """the sampling model's EMA decay after each iteration, in the same form (this one: preset 2)"""
    beta: float = 0.1
    """KL coefficient against the reference model (LoRA off, or a frozen copy when fully fine-tuning)"""
    kl_cfg: float = 4.5
    """the reference's guidance in the KL (its CFG: the anchor is the guided model)"""
    reward_adaptive_kl: bool = True
    """each sample's KL weighted by 1e-4 / beta + r (1 - 1e-4 / beta): from 1e-4 at r = 0 to beta at r = 1"""

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
    updates_per_iteration: int = 2
    """optimizer steps per iteration: the training terms split into this many mini-batches"""
    ema: bool = True
    """keep an EMA of the trainable weights for evaluation and the exported weights"""
    ema_decay: float = 0.995
    """EMA decay, reached after the warm-up min((1 + s) / (10 + s), decay) of s optimizer steps"""
    ema_every: int = 20
    """EMA update interval in optimizer steps"""
    num_iterations: int = 300
    """number of iterations (rollout + update)"""
    eval_every: int = 20
    """evaluate every N iterations and at the end (0: never)"""
    eval_base: bool = True
    """evaluate the base model before the first iteration of a new run (--no-eval-base: runs that share it)"""
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 20
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (docs/toy_world.md). Explicit flags still win.
TOY = {**TOY_WORLD, "learning_rate": 1e-4, "prompts_per_iteration": 8, "global_std": False,
       "train_timesteps": 8, "kl_cfg": 3.5, "updates_per_iteration": 1}  # the toy samples at its guidance 3.5
# the snapshots' decay presets (crd.py:50-64): (start, value, slope, end), d = value before `start` optimizer
# steps, then min(value + (steps - start) slope, end)
DECAYS = {"0": (0, 0.0, 0.0, 0.0), "1": (0, 0.0, 0.001, 0.5), "2": (75, 0.0, 0.0075, 0.999),
          "3": (0, 1.0, 0.0, 1.0), "4": (0, 0.0, 0.02, 0.99), "5": (0, 0.0, 0.01, 0.5),
          "6": (0, 0.0, 0.0075, 0.999)}
DECAYS.update({"none": DECAYS["0"], "slow": DECAYS["1"], "medium": DECAYS["2"], "offline": DECAYS["3"],
               "fast": DECAYS["4"], "moderate": DECAYS["5"]})


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    for flag, spec in (("--old-decay", args.old_decay), ("--sampling-decay", args.sampling_decay)):
        if decay_schedule(spec) is None:
            fail(f"{flag} {spec!r} is not allowed; use start-value-slope-end (e.g. 0-0.25-0.005-0.999) or a "
                 f"preset: {', '.join(DECAYS)}")
    if args.micro_batch % args.group_size:
        fail(f"--micro-batch {args.micro_batch} is not allowed; use a multiple of --group-size "
             f"{args.group_size} (a group is centred within one forward)")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_*."""
    trained = args.train_timesteps * args.group_size
    return {"rollout": args.group_size * args.num_steps,
            "train": trained,
            "old": trained,
            "reference": trained if args.beta > 0 else 0}


def decay_schedule(spec: str):
    """(start, value, slope, end) of a preset of DECAYS or of "start-value-slope-end" (crd.py:67-98); else
    None."""
    if spec in DECAYS:
        return DECAYS[spec]
    try:
        start, value, slope, end = (float(part) for part in spec.split("-"))
    except ValueError:
        return None
    return (int(start), value, slope, end) if all(map(math.isfinite, (start, value, slope, end))) else None


def snapshot_decay(steps: int, spec: str) -> float:
    """A snapshot's EMA decay after `steps` optimizer steps (compute_decay, crd.py:100-102)."""
    start, value, slope, end = decay_schedule(spec)
    return value if steps < start else min(value + (steps - start) * slope, end)


def stratified_steps(sigmas, k: int, n: int, *, fraction: float, generator):
    """K training timesteps for each of n groups, schedule indices [n, K] (TimeSampler.discrete,
    noise_schedule.py:185-259, as crd.py:242-259 calls it): of the indices 0..last with 1000 sigma >=
    1000 (1 - fraction) - 1e-3, the strata [b_i, b_i+1) of b = linspace(0, last, K + 1) truncated, one uniform
    index in each (b_i if it is empty)."""
    last = int(torch.nonzero(sigmas[:-1] * 1000 >= 1000 * (1 - fraction) - 1e-3).max())
    bounds = torch.linspace(0, last, k + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(n, k, generator=generator) * (upper - lower)).long()


def centred_reward_loss(r_theta, reward, group, *, beta: float, loss: str, temperature: float):
    """CRD's loss per sample (_compute_crd_loss, crd.py:522-629) of implicit rewards r_theta [B] and rewards
    in [0, 1] [B] of whole groups (group [B]: each sample's group, labels < B), each centred by a weighted
    mean over its group (the implicit one's detached): (beta Rc_theta - Rc)^2 ("mse") or the cross-entropy of
    sigmoid(beta Rc_theta) against sigmoid(Rc) ("bce"). Weights: uniform (temperature < 0); else the mean of
    two centrings, by softmax(r / T) and softmax(-r / T) (T > 0), or by softmax(r) over the r > 0 and over the
    r < 0 (T = 0; an empty pool: uniform, as the second always is: crd.py compares the rewards in [0, 1] with
    0)."""
    reward = reward.to(r_theta.dtype)

    def centred(scores):  # the weights: softmax of the scores within each group (-inf: left out)
        zeros = torch.zeros(len(group), dtype=scores.dtype, device=scores.device)  # a slot per group label
        top = (zeros - math.inf).scatter_reduce(0, group, scores, "amax")[group]
        w = torch.where(top == -math.inf, 1.0, torch.exp(scores - top))  # a group with none: uniform
        def mean(z):  # each sample's group mean, weighted by w
            return (zeros.index_add(0, group, w * z) / zeros.index_add(0, group, w))[group]
        rc, rc_theta = reward - mean(reward), r_theta - mean(r_theta.detach())
        if loss == "bce":
            return F.binary_cross_entropy_with_logits(beta * rc_theta, torch.sigmoid(rc), reduction="none")
        return (beta * rc_theta - rc) ** 2
    if temperature < 0:
        return centred(torch.zeros_like(reward))
    if temperature == 0:
        return sum(0.5 * centred(torch.where(sign * reward > 0, reward, -math.inf)) for sign in (1, -1))
    return sum(0.5 * centred(sign * reward / temperature) for sign in (1, -1))


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
                    reference=args.beta > 0, copies=("old", "sampling"))
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = pipeline_sigmas(run.pipe, kind, num_steps=T, shape=run.shape)  # the pipeline's schedule
    params, old, sampling = list(run.params.values()), run.copies["old"], run.copies["sampling"]

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, 0)  # every rank draws all ranks' prompts and noise

        # ALGO LOGIC: rollout (the sampling model's Euler ODE, without CFG by default)
        train_steps = list(range(args.train_timesteps))
        draws = torch.randint(len(run.train_prompts), (P * world,), generator=gen)
        prompts = [run.train_prompts[i] for i in draws]
        prompts = prompts[rank * P:(rank + 1) * P]  # this rank's: 1 and N processes train the same samples
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(world * P * G, *shape, generator=gen)[rank * P * G:][:P * G].to(run.device)
        latents = [x]
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=max(args.guidance, args.kl_cfg))  # the negatives of the KL's reference
        with torch.no_grad(), amp, swapped_in(params, sampling), gathered(transformer, sharded=run.sharded):
            for i in range(T):
                v = velocities(transformer, kind, latents[i], sigmas[i], emb, rows=group, chunks=chunks,
                               guidance=args.guidance)
                latents.append(latents[i] + float(sigmas[i + 1] - sigmas[i]) * v.float())  # the Euler step
            images = torch.cat([decode(run.pipe, latents[-1][c]) for c in chunks])

        # ALGO LOGIC: rewards and advantages (one reward per image, broadcast to every trained step)
        scores = score(run.reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = combined_advantages(all_scores, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                         global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip)
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(run.device)
        r = (advantages / args.adv_clip / 2 + 0.5).clamp(0, 1)  # the reward in [0, 1] (crd.py:785-791)

        # ALGO LOGIC: policy update (the centred implicit reward matched to the centred reward, the KL)
        stats = Stats("policy_loss", "kl", "implicit_reward", "old_deviation")  # means over the terms
        # whole groups of every rank, in order, into mini-batches (crd.py:653-658: no shuffling)
        groups, parts = torch.arange(P * G * world).view(world, P, G), args.updates_per_iteration
        minibatches = [groups[:, i].flatten() for i in torch.arange(P).tensor_split(parts)]
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        # K stratified timesteps per group (crd.py:214-261), drawn alike on every rank
        timesteps = stratified_steps(sigmas, len(train_steps), P * world, fraction=args.timestep_fraction,
                                     generator=same_on_ranks)[rank * P:][:P][group]
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
                target = eps[j][c].to(run.device) - x0  # the flow-matching velocity (crd.py:736)
                with torch.no_grad(), amp, swapped_in(params, old):  # before the graph needs the weights
                    v_old = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance).float()
                with amp:
                    v = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond).float()
                # the implicit reward (crd.py:753-777): the old model's error minus the policy's, each over
                # its detached mean absolute error in float64 (adaptive_logp)
                dims = tuple(range(1, 1 + len(shape)))
                weight = lambda w: (w.detach().double() - target).abs().mean(  # noqa: E731
                    dims, keepdim=True).clip(min=1e-5) if args.adaptive_weights else 1.0
                r_theta = -((v - target) ** 2 / weight(v) - (v_old - target) ** 2 / weight(v_old)).mean(dims)
                within = torch.arange(len(c), device=r_theta.device) // G  # the micro-batch's whole groups
                losses = centred_reward_loss(r_theta, r[c], within, beta=args.crd_beta, loss=args.crd_loss,
                                             temperature=args.weight_temp)
                policy_loss = losses.mean() * args.adv_clip / args.crd_beta  # crd.py:806-808
                kl = kl_loss = torch.zeros_like(r_theta)
                if args.beta > 0:  # the velocities' KL to the CFG-guided reference (crd.py:742-751, 810-824)
                    with torch.no_grad(), amp, as_reference(transformer, run.ref_model) as reference:
                        v_ref = velocity(reference, kind, x_t, sigma, emb_c, guidance=args.kl_cfg)
                    kl = ((v - v_ref.float()) ** 2).mean(dims)
                    low = 1e-4 / args.beta  # reward-adaptive: each KL weighted 1e-4 at r = 0, beta at r = 1
                    kl_loss = (low + r[c] * (1 - low) if args.reward_adaptive_kl else 1.0) * kl
                loss = policy_loss + args.beta * kl_loss.mean()
                (loss * scale).backward()  # scale: this term's share of the mini-batch's mean
                stats.add(scale, terms=len(c), policy_loss=policy_loss * len(c), kl=kl.sum(),
                          implicit_reward=r_theta.sum(), old_deviation=((v - v_old) ** 2).mean(dims).sum())
            stats.step(run.optimizer_step(terms))
            run.ema_step(iteration * args.updates_per_iteration + u + 1)
        # the old and the sampling models after the iteration: m <- d m + (1 - d) policy (crd.py:373-430)
        steps = (iteration + 1) * args.updates_per_iteration
        decay = {name: snapshot_decay(steps, spec) for name, spec in (("old", args.old_decay),
                                                                      ("sampling", args.sampling_decay))}
        for name, d in decay.items():
            ema_update(run.copies[name], params, d, steps, warmup=False)

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        kept = sum(map(len, minibatches)) / (P * G * world)  # the share of the samples trained on
        run.end_iteration(iteration, stats, scores=all_scores, samples=(images[:G], prompts[0], scores),
                          metrics={"train/kept_fraction": kept, "train/old_decay": decay["old"],
                                   "train/sampling_decay": decay["sampling"]})
    run.finish()
