# Diffusion-DPO (Wallace et al., 2024, arXiv 2311.12908), online as train_sd3_dpo.py of Flow-GRPO; docs/dpo.md
"""Online Diffusion-DPO: the best and the worst of each prompt's G SDE samples (the reference's) a pair,
re-noised alike; -log sigmoid(-beta/2 (the winner's flow-matching error - the loser's, each minus the
reference's)).

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (TOY_WORLD, RewardModels, check_common_args, decode, encode_prompts, fail,
                    gather_cat, gathered, iteration_generator, micro_batches, pipeline_sigmas, score, select,
                    training_minibatches, velocities, velocity)
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
    max_sequence_length: int = 128
    """prompt length in tokens (T5's, or the family's text encoder's)"""
    text_cache: str | None = None
    """a directory of text embeddings, each prompt encoded once before training; no text encoder is kept"""
    guidance: float = 4.5
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
    num_steps: int = 40
    """T, the number of sampling steps during training"""
    eval_steps: int = 40
    """ODE sampling steps for evaluation"""
    group_size: int = 24
    """G, images per prompt (a group never spans ranks)"""
    prompts_per_iteration: int = 8
    """prompts (groups) per iteration over all ranks; a multiple of the world size"""
    micro_batch: int = 12
    """latents per model forward; sampling and training use the same micro-batches"""

    # Algorithm specific arguments
    noise_level: float = 0.7
    """a, the SDE noise level: std_dev_t = a sqrt(sigma / (1 - sigma)) (none at the last step; 0: an ODE)"""
    timestep_fraction: float = 0.99
    """each pair trains int(T * fraction) times, each time at a fresh noise level and noise"""
    global_std: bool = True
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 1e-4
    """added to the std in the advantage denominator"""
    beta_dpo: float = 100.0
    """beta, the DPO temperature of -log sigmoid(-beta/2 ((mse_w - mse_ref_w) - (mse_l - mse_ref_l)))"""
    flow_shift: float = 3.0
    """trained noise levels: shift s / (1 + (shift - 1) s), s = 1 - int(1000 sigmoid(z)) / 1000, z normal"""
    rollout_model: Literal["reference", "policy"] = "reference"
    """who samples the pairs: the reference (Flow-GRPO's script) or the policy (Flow-Factory, verl-omni)"""
    ref_update_step: int = 10_000_000
    """the reference becomes a copy of the policy every N optimizer steps (40: Flow-GRPO's OnlineDPO)"""

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
TOY = {**TOY_WORLD, "learning_rate": 3e-5, "prompts_per_iteration": 8, "global_std": False,
       "beta_dpo": 1000.0, "noise_level": 0.7, "timestep_fraction": 0.99,
       "updates_per_iteration": 1}  # the sweep: docs/dpo.md


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if int(args.num_steps * args.timestep_fraction) < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of {args.num_steps}; raise it")
    if args.micro_batch < 2:  # a pair's two images in one forward
        fail(f"--micro-batch {args.micro_batch} is not allowed; use a value >= 2 (a pair's two images)")
    per_rank = args.prompts_per_iteration // world  # one pair per prompt
    most = -(-per_rank // (args.micro_batch // 2))  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_*."""
    trained = int(args.num_steps * args.timestep_fraction)
    return {"rollout": args.group_size * args.num_steps,
            "train": 2 * trained,  # one pair per prompt
            "reference": 2 * trained}


def sde_step(v, x, sigmas, i: int, noise_level: float, *, prev_sample=None, generator=None):
    """One Euler-Maruyama step sigmas[i] -> sigmas[i + 1] (dt < 0) of the marginal-preserving SDE (Eq. 9)
    dx = [v + g^2 / (2 sigma) (x + (1 - sigma) v)] dt + g dW, g = a sqrt(sigma / (1 - sigma)) (std_dev_t):
    x_next (drawn unless `prev_sample` gives it) and its log-probability, in float32; noise level 0 is the
    ODE's Euler step (log-prob 0). Returns (x_next, log_prob, mean, std)."""
    v, x = v.float(), x.float()
    sigma, dt = float(sigmas[i]), float(sigmas[i + 1]) - float(sigmas[i])
    below = float(sigmas[1]) if sigma > 1 - 1e-4 else sigma  # official: sigma = 1 -> sigmas[1] (and 1 - 1e-6)
    g = noise_level * math.sqrt(sigma / (1 - below))
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


def dpo_pairs(preference):
    """Each group's pair (train_sd3_dpo.py:726, stat_tracking.py:38-52, type "dpo") of preference [P, G]: the
    indices of its first maximum and first minimum; a group of equal values pairs image 1 over image 0."""
    winner, loser = preference.argmax(dim=1), preference.argmin(dim=1)
    tie = winner == loser
    return torch.where(tie, 1, winner), torch.where(tie, 0, loser)


def logit_normal_sigmas(n: int, *, shift: float, generator):
    """n noise levels of training terms (train_sd3_dpo.py:882-894): u = sigmoid(N(0, 1)) (diffusers'
    compute_density_for_timestep_sampling, logit_normal), the index int(1000 u) of a static-shift scheduler's
    1000 training sigmas: shift s / (1 + (shift - 1) s), s = (1000 - index) / 1000, in float32."""
    index = (torch.sigmoid(torch.randn(n, generator=generator)) * 1000).long()
    s = (1000 - index).float() / 1000
    return shift * s / (1 + (shift - 1) * s)


if __name__ == "__main__":
    args = parse_args(Args, toy=TOY, description=__doc__)
    # TRY NOT TO MODIFY: the process group, the run directory and its logs, the rewards, the model and its
    # trainable weights (LoRA, or FSDP2 across ranks), the reference, the optimizer; --resume restores them
    run = start_run(args, script=__file__, check_args=check_args, planned_nfe=planned_nfe,
                    reference=False, copies=("ref",))
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = pipeline_sigmas(run.pipe, kind, num_steps=T, shape=run.shape)  # the pipeline's schedule
    n_train = int(T * args.timestep_fraction)
    params, ref = list(run.params.values()), run.copies["ref"]  # the reference (the "ref" adapter)

    for iteration in run.iterations():
        gen = iteration_generator(args.seed, iteration, rank)
        done = iteration * args.updates_per_iteration  # optimizer steps so far
        if done > 0 and done % args.ref_update_step == 0:  # OnlineDPO: copy_learner_to_ref (train:615-616)
            ema_update(ref, params, 0.0, done, warmup=False)

        # ALGO LOGIC: rollout (the SDE at every sampling step but the last, by the reference: train:619-632)
        train_steps = list(range(n_train))
        noise_levels = [args.noise_level if i < T - 1 else 0.0 for i in range(T)]
        prompts = [run.train_prompts[i] for i in torch.randint(len(run.train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, G, *shape, generator=gen).reshape(P * G, *shape).to(run.device)
        latents = [x]
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        sampler = ref if args.rollout_model == "reference" else None
        with torch.no_grad(), amp, swapped_in(params, sampler), gathered(transformer, sharded=run.sharded):
            for i in range(T):
                v = velocities(transformer, kind, latents[i], sigmas[i], emb, rows=group, chunks=chunks,
                               guidance=args.guidance)
                steps = [sde_step(v[c], latents[i][c], sigmas, i, noise_levels[i], generator=gen)
                         for c in chunks]  # the same micro-batches draw the noise, in order
                latents.append(torch.cat([x_next for x_next, *_ in steps]))
            images = torch.cat([decode(run.pipe, latents[-1][c]) for c in chunks])
        emb = {k: v for k, v in emb.items() if not k.startswith("neg_")}  # trained without CFG (train:898)

        # ALGO LOGIC: rewards and pairs (each group's best and worst image, train:726 and 756-829)
        scores = score(run.reward_fns, images, [prompts[g] for g in group])
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = combined_advantages(all_scores, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                         global_std=args.global_std)
        winner, loser = dpo_pairs(advantages[rank * P:(rank + 1) * P])
        winner, loser = torch.arange(P) * G + winner, torch.arange(P) * G + loser  # sample indices

        # ALGO LOGIC: policy update (the DPO loss of each pair's flow-matching errors against the reference's)
        stats = Stats("policy_loss", "implicit_acc", "inside_term", "model_w_err", "model_l_err", "ref_w_err",
                      "ref_l_err")  # means over the terms
        # all ranks' pairs shuffled into mini-batches alike on every rank
        trained_pairs = torch.ones(1, P * world)  # every pair trains
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        part = {**run.part, "per_rank": P, "micro_batch": args.micro_batch // 2}  # pairs, two images each
        micro_batches_per_rank = -(-trained_pairs.shape[1] // part["micro_batch"])
        minibatches = training_minibatches(trained_pairs, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches_per_rank, generator=same_on_ranks)
        # per term and pair a noise level and a noise, the winner's and the loser's alike (train:876-895)
        train_sigmas = logit_normal_sigmas(n_train * P, shift=args.flow_shift, generator=gen).view(n_train, P)
        noise = torch.randn(n_train, P, *shape, generator=gen)
        for u, minibatch in enumerate(minibatches):
            terms = micro_batches(minibatch, steps=train_steps, part=part)
            for j, c, scale in terms:
                rows = torch.cat([winner[c], loser[c]])  # the winners, then the losers
                emb_c = select(emb, group[rows])
                sigma = train_sigmas[j][c].repeat(2).to(run.device)
                t, eps = sigma.view(-1, *[1] * len(shape)), torch.cat([noise[j][c]] * 2).to(run.device)
                x0 = latents[T][rows]  # the samples
                x_t = (1 - t) * x0 + t * eps  # the forward process, fresh noise
                with torch.no_grad(), amp, swapped_in(params, ref):  # before the graph needs the weights
                    v_ref = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance)
                with amp:
                    v = velocity(transformer, kind, x_t, sigma, emb_c, guidance=args.guidance,
                                 detach_uncond=args.detach_uncond)
                # each image's flow-matching error against the target noise - x0, in float64 (train:916-919)
                error = lambda w: ((w.double() - (eps - x0).double()) ** 2).flatten(1).mean(1)  # noqa: E731
                mse, mse_ref = error(v), error(v_ref)
                w_diff, l_diff = (mse - mse_ref).chunk(2)  # the winners', the losers' (train:921-927)
                inside_term = -0.5 * args.beta_dpo * (w_diff - l_diff)
                policy_loss = -F.logsigmoid(inside_term).mean()  # train:928-931
                (policy_loss * scale).backward()  # scale: this term's share of the mini-batch's mean
                (model_w_err, model_l_err), (ref_w_err, ref_l_err) = mse.chunk(2), mse_ref.chunk(2)
                stats.add(scale, terms=len(c), policy_loss=policy_loss * len(c),
                          inside_term=inside_term.sum(), implicit_acc=(inside_term > 0).sum(),
                          model_w_err=model_w_err.sum(), model_l_err=model_l_err.sum(),
                          ref_w_err=ref_w_err.sum(), ref_l_err=ref_l_err.sum())
            stats.step(run.optimizer_step(terms))
            run.ema_step(iteration * args.updates_per_iteration + u + 1)

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        kept = 2 * sum(map(len, minibatches)) / (P * G * world)  # the share of the samples trained on
        run.end_iteration(iteration, stats, scores=all_scores, metrics={"train/kept_fraction": kept},
                          samples=(images[:G], prompts[0], scores))
    run.finish()
