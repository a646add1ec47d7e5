# AWM (Xue et al., 2025, arXiv 2509.25050); docs: docs/awm.md
"""AWM (Advantage Weighted Matching): SA-Solver rollouts, Flow-GRPO's advantages, a PPO-clipped ratio of the
log-likelihoods -w(mse(v(x_t, t), eps - x0)) of the final image re-noised at stratified timesteps, two KLs.

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
from common import ema_update, sa_solver, swapped_in


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
    eval_base: bool = True
    """evaluate the base model before the first iteration of a new run (--no-eval-base: runs that share it)"""
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 50
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (docs/toy_world.md). Explicit flags still win.
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


def stratified_indices(end: int, k: int, n: int, *, kind: str = "discrete", generator=None):
    """The trained schedule indices (train_sd3_awm.py:1169-1205, time_type discrete*), n draws [n, k]: one
    uniform index in each of the k strata [b_j, b_j+1) of b = linspace(start, end, k + 1) in float32,
    truncated; "discrete" starts at 0, "discrete_wo_init" at 1, "discrete_with_init" takes 0, k - 1 from 1."""
    first, start = int(kind == "discrete_with_init"), int(kind != "discrete")
    bounds = torch.linspace(start, end, k - first + 1).long()
    u = torch.rand(n, k - first, generator=generator)
    return torch.cat([torch.zeros(n, first, dtype=torch.long), bounds[:-1] + (u * bounds.diff()).long()], 1)


def awm_log_prob(v, target, t: float, *, weighting: str, power: float):
    """AWM's log-likelihood of a re-noised sample (compute_log_prob_awm, train_sd3_awm.py:237-251): minus the
    flow-matching error mse = mean (v - (eps - x0))^2 in float64 under a weighting: "ghuber" -((mse + 1e-10)^p
    - 1e-10^p) t / p, "huber" -(sqrt(mse + 1e-10) - 1e-5) t, "Uniform" -mse, "t" -mse t, "t**2" -mse t^2."""
    mse = ((v.double() - target.double()) ** 2).flatten(1).mean(1)
    if weighting == "ghuber":
        return -((mse + 1e-10) ** power - 1e-10**power) * t / power
    if weighting == "huber":
        return -(torch.sqrt(mse + 1e-10) - 1e-5) * t
    return -mse * {"Uniform": 1.0, "t": t, "t**2": t**2}[weighting]


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
                    reference=args.beta > 0, copies=("kl_ema",))
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = pipeline_sigmas(run.pipe, kind, num_steps=T, shape=run.shape)  # the pipeline's schedule
    n_train = int(T * args.timestep_fraction)
    params, kl_ema = list(run.params.values()), run.copies["kl_ema"]  # the KL-EMA ("ema" adapter)

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (SA-Solver on the schedule; its last step returns the data prediction x0)
        train_steps = list(range(args.train_timesteps))
        prompts = [run.train_prompts[i] for i in torch.randint(len(run.train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, G, *shape, generator=gen).reshape(P * G, *shape).to(run.device)
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=run.sharded):
            v_of = lambda x_t, t: velocities(transformer, kind, x_t, t, emb, rows=group,  # noqa: E731
                                             chunks=chunks, guidance=args.guidance)
            x0 = sa_solver(v_of, x, sigmas, noise_level=args.noise_level, generator=gen)
            images = torch.cat([decode(run.pipe, x0[c]) for c in chunks])

        # ALGO LOGIC: rewards and advantages (one reward per image, broadcast to every trained step)
        scores = score(run.reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = combined_advantages(all_scores, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                         global_std=args.global_std)
        advantages = advantages.clamp(-args.adv_clip, args.adv_clip) / args.adv_clip * args.advantage_max
        advantages = advantages[rank * P:(rank + 1) * P].reshape(-1).to(run.device)
        advantages = advantages.expand(T, -1)  # [T, N]: an advantage per step and sample

        # ALGO LOGIC: policy update (the PPO-clipped ratio of per-step log-probs, the KL to the reference)
        stats = Stats("ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl", "ema_kl",
                      maxima=("first_ratio_max_dev",))  # means over the terms; the maximum over the ranks
        # all ranks' samples, none dropped (AWM), into mini-batches, alike on all ranks
        trained_advantages = torch.ones(1, P * G * world)
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        micro_batches_per_rank = -(-trained_advantages.shape[1] // args.micro_batch)
        minibatches = training_minibatches(trained_advantages, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches_per_rank, generator=same_on_ranks)
        # every term (AWM's code skips none), all drawn before the first step (train:1138-1232): a timestep
        # per stratum and micro-batch, fresh noise per term
        terms = []
        for minibatch in minibatches:
            drawn = micro_batches(minibatch, steps=train_steps, part=run.part)
            n = len(drawn) // len(train_steps)  # this rank's micro-batches
            times = sigmas[stratified_indices(n_train, len(train_steps), n, kind=args.time_type,
                                              generator=gen)]
            terms.append([(j, c, scale, float(times[k % n][j]), torch.randn(x0[c].shape, generator=gen))
                          for k, (j, c, scale) in enumerate(drawn)])
        # the old log-probs of the later mini-batches' terms, before the first step (train:1227-1238)
        old_log_probs = {}
        with torch.no_grad(), amp, gathered(transformer, sharded=run.sharded):
            for u, k in [(u, k) for u in range(1, len(terms)) for k in range(len(terms[u]))]:
                j, c, _, t, eps = terms[u][k]
                x_t = (1 - t) * x0[c] + t * eps.to(run.device)
                v = velocity(transformer, kind, x_t, t, select(emb, group[c]), guidance=args.guidance)
                old_log_probs[u, k] = awm_log_prob(v, eps.to(run.device) - x0[c], t, weighting=args.weighting,
                                                   power=args.ghuber_power)
        for u, minibatch_terms in enumerate(terms):
            for k, (j, c, scale, t, eps) in enumerate(minibatch_terms):
                adv = advantages[j][c]
                emb_c = select(emb, group[c])
                eps = eps.to(run.device)
                x_t = (1 - t) * x0[c] + t * eps  # the final image re-noised
                if args.ema_beta > 0:  # before the policy's forward: the KL-EMA is swapped in in place
                    with torch.no_grad(), amp, swapped_in(params, kl_ema):
                        v_ema = velocity(transformer, kind, x_t, t, emb_c, guidance=args.guidance)
                with amp:
                    v = velocity(transformer, kind, x_t, t, emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond)
                log_prob = awm_log_prob(v, eps - x0[c], t, weighting=args.weighting, power=args.ghuber_power)
                # the first mini-batch's old log-prob is this forward's (train:1282-1284): a ratio of 1
                old_log_prob = log_prob.detach() if u == 0 else old_log_probs[u, k]
                ratio = torch.exp(log_prob - old_log_prob)
                clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
                kl = torch.zeros_like(policy_loss)
                if args.beta > 0:  # the mean squared velocity difference (AWM's code)
                    with torch.no_grad(), amp, as_reference(transformer, run.ref_model) as reference:
                        v_ref = velocity(reference, kind, x_t, t, emb_c,
                                         guidance=args.guidance)
                    kl = ((v.double() - v_ref.double()) ** 2).mean()
                ema_kl = ((v.double() - v_ema.double()) ** 2).mean() if args.ema_beta > 0 else kl * 0
                loss = policy_loss + args.beta * kl + args.ema_beta * ema_kl
                (loss * scale).backward()  # scale: this term's share of the mini-batch's mean
                log_ratio = log_prob - old_log_prob
                stats.add(scale, terms=len(c), ratio_mean=ratio.sum(), policy_loss=policy_loss * len(c),
                          clipfrac=((ratio - 1).abs() > args.clip_range).sum(), kl=kl * len(c),
                          approx_kl=(0.5 * log_ratio**2).sum(), ema_kl=ema_kl * len(c))
                if u == 0:  # max |ratio - 1| in the first mini-batch: 0 if sampling and training agree
                    stats.max(scale, first_ratio_max_dev=(ratio.detach() - 1).abs().max())
            stats.step(run.optimizer_step(minibatch_terms))
        steps = (iteration + 1) * args.updates_per_iteration  # optimizer steps so far
        run.ema_step(steps)  # once per iteration (train:1391-1392)
        # the KL-EMA after the iteration, by the optimizer steps so far (official: after the eval EMA)
        d = min(args.kl_ema_decay, 1e-3 * steps if args.kl_ema_decay_type == "linear" else 1.0)
        ema_update(kl_ema, params, d, steps, warmup=False)

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        kept = sum(map(len, minibatches)) / (P * G * world)  # the share of the samples trained on
        run.end_iteration(iteration, stats, scores=all_scores, metrics={"train/kept_fraction": kept},
                          samples=(images[:G], prompts[0], scores))
    run.finish()
