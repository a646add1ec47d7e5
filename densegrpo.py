# DenseGRPO (arXiv 2601.20218); docs: docs/densegrpo.md
"""DenseGRPO: Flow-GRPO's SDE trajectories, each step rewarded by the change of the reward of the ODE
completion of the latent across it; per-step noise levels psi(t) calibrated to the reward (Algorithm 1).

The defaults are the paper's setting; --model toy trains the embedded toy model on a CPU."""
import math
import os
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (TOY_WORLD, RewardModels, as_reference, check_common_args, check_output_path, decode,
                    encode_prompts, fail, gather_cat, gathered, iteration_generator, micro_batches,
                    pipeline_sigmas, score, select, training_minibatches, velocities, velocity)
from rundir import Stats, parse_args, start_run
# algorithm specific
from common import ode_complete
from rundir import load_psi, psi_path, save_psi


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
    noise_level: float = 0.7
    """a, the SDE noise level: std_dev_t = a sqrt(sigma / (1 - sigma)) (none at an untrained last step)"""
    psi: str | None = None
    """a JSON file of per-step noise levels psi(t) from --calibrate (none: --noise-level at every step)"""
    dense_ode_steps: int | Literal["t"] = "t"
    """n, the ODE steps that complete a latent x_t for its reward (t: all remaining steps)"""
    dense_baseline: bool = False
    """the paper's "Dense Reward (Baseline)": normalise R_{t-1} itself, not R_{t-1} - R_t"""
    calibrate: bool = False
    """run the reward-aware exploration calibration (Algorithm 1) instead of training"""
    psi_out: str | None = None
    """where --calibrate writes psi (none given: <run dir>/psi.json)"""
    eps1: float = 2.0
    """calibration: psi(t) rises where the imbalance of the signs of Delta R_t is below eps1"""
    calibration_rule: Literal["group", "pooled"] = "group"
    """calibration: count the signs per group and average over prompts, or pool all trajectories"""
    eps2: float = 0.01
    """calibration: the step by which psi(t) moves"""
    psi_range: tuple[float, float] = (0.1, 1.5)
    """calibration: psi is clamped to this range"""
    timestep_fraction: float = 0.99
    """the first int(T * fraction) sampling steps are trained"""
    global_std: bool = False
    """normalise by the std of all the iteration's rewards instead of each group's"""
    adv_eps: float = 1e-4
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    clip_range: float = 1e-4
    """PPO ratio clip range"""
    beta: float = 0.01
    """KL coefficient against the reference model (LoRA off, or a frozen copy when fully fine-tuning)"""
    kl_form: Literal["official", "exact"] = "official"
    """KL scale: |mu - mu_ref|^2 / (2 std_dev_t^2) as Flow-GRPO's code, or the exact Gaussian KL"""

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
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (docs/toy_world.md). Explicit flags still win.
TOY = {**TOY_WORLD, "learning_rate": 1e-4, "prompts_per_iteration": 4, "global_std": False, "beta": 0.04,
       "noise_level": 0.5, "timestep_fraction": 0.5, "updates_per_iteration": 1}


def check_args(args, world: int):
    check_common_args(args, world)
    # algorithm specific
    if int(args.num_steps * args.timestep_fraction) < 1:
        fail(f"--timestep-fraction {args.timestep_fraction} trains no step of {args.num_steps}; raise it")
    if args.dense_ode_steps != "t" and not 1 <= args.dense_ode_steps <= args.num_steps:
        fail(f"--dense-ode-steps {args.dense_ode_steps} is not allowed; use 1..{args.num_steps} or t")
    trained = int(args.num_steps * args.timestep_fraction)
    if args.psi is not None and not any(load_psi(args.psi, args.num_steps)[:trained]):
        fail(f"--psi {args.psi!r} is 0 at every trained step (the first {trained}): none has noise to train")
    if not args.psi_range[0] < args.psi_range[1]:
        fail("--psi-range {} {} is not allowed; give the lower bound first".format(*args.psi_range))
    if args.psi_out:
        check_output_path(args.psi_out, flag="--psi-out", directory=False)
    if args.noise_level == 0:  # the images of a group differ by their initial noise: no log-prob to train
        fail("--noise-level 0.0 is not allowed; use a value > 0 (a step without noise has no log-prob)")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


def spaced_indices(start: int, end: int, n: int) -> list[int]:
    """Exactly min(n, end - start) steps from `start` to `end`, as evenly spaced as integers allow."""
    n = min(n, end - start)
    return [start + -(-j * (end - start) // n) for j in range(n + 1)]


def dense_rewards(latent_rewards, *, baseline: bool = False):
    """Latent rewards R(x_i) [T + 1, N] along each trajectory (i = 0 the noise, T the image) -> step rewards
    Delta R_i = R(x_{i+1}) - R(x_i) [T, N] (float64: they telescope exactly), or R(x_{i+1}) (baseline)."""
    r = latent_rewards.double()
    return r[1:] if baseline else r[1:] - r[:-1]


def calibrate_step(psi: list, delta_r, *, eps1: float, eps2: float, psi_range, groups: int, active=None):
    """Algorithm 1, one iteration: psi(t) += eps2 where |#(Delta R_t > 0) - #(Delta R_t < 0)| < eps1, else
    -= eps2, clamped. delta_r [N, T] holds `groups` groups of equal size: the signed count per group, averaged
    over the groups (1: the count over all N). Steps not `active` (taken without noise) stay."""
    sign = (delta_r > 0).double() - (delta_r < 0).double()
    imbalance = sign.view(groups, -1, sign.shape[1]).sum(1).mean(0).abs()
    old = torch.tensor(psi, dtype=torch.float64)
    new = (old + eps2 * (2 * (imbalance < eps1).double() - 1)).clamp(*psi_range)
    keep = torch.zeros(len(psi), dtype=torch.bool) if active is None else ~torch.tensor(active)
    return torch.where(keep, old, new).tolist()


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training
    forwards and the reference model's; tested against the measured perf/nfe_* (zero advantages skip some)."""
    T = args.num_steps
    n = T if args.dense_ode_steps == "t" else args.dense_ode_steps
    trained = int(T * args.timestep_fraction)
    return {"rollout": args.group_size * (T + sum(min(n, T - i) - 1 for i in range(T))),
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


if __name__ == "__main__":
    args = parse_args(Args, toy=TOY, description=__doc__)
    # TRY NOT TO MODIFY: the process group, the run directory and its logs, the rewards, the model and its
    # trainable weights (LoRA, or FSDP2 across ranks), the reference, the optimizer; --resume restores them
    run = start_run(args, script=__file__, check_args=check_args, planned_nfe=planned_nfe,
                    reference=args.beta > 0)
    transformer, kind, rank, world, amp = run.transformer, run.kind, run.rank, run.world, run.amp
    P, G, T, shape = args.prompts_per_iteration // world, args.group_size, args.num_steps, run.shape
    sigmas = pipeline_sigmas(run.pipe, kind, num_steps=T, shape=run.shape)  # the pipeline's schedule
    n_train = int(T * args.timestep_fraction)
    psi = [args.noise_level] * T if args.psi is None else load_psi(args.psi, T)  # psi(t) replaces a
    history = []  # psi after each calibration iteration
    n = T if args.dense_ode_steps == "t" else args.dense_ode_steps
    paths = [spaced_indices(i, T, n) for i in range(T)]  # ODE_n(x_i): min(n, T - i) steps

    for iteration in run.iterations(evaluate_base=not args.calibrate):
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (the SDE with psi(t) at every step), then ODE completions of every latent
        train_steps = list(range(n_train))
        noise_levels = [psi[i] if i < T - 1 or i in train_steps else 0.0 for i in range(T)]
        train_steps = [j for j in train_steps if noise_levels[j] > 0]  # psi(t) = 0: no log-prob to train
        prompts = [run.train_prompts[i] for i in torch.randint(len(run.train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, G, *shape, generator=gen).reshape(P * G, *shape).to(run.device)
        latents = [x]
        old_log_probs = []
        sampler_velocities = []
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(run.pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=run.sharded):
            for i in range(T):
                v = velocities(transformer, kind, latents[i], sigmas[i], emb, rows=group, chunks=chunks,
                               guidance=args.guidance)
                steps = [sde_step(v[c], latents[i][c], sigmas, i, noise_levels[i], generator=gen)
                         for c in chunks]  # the same micro-batches draw the noise, in order
                latents.append(torch.cat([x_next for x_next, *_ in steps]))
                old_log_probs.append(torch.cat([log_prob for _, log_prob, *_ in steps]))
                sampler_velocities.append(v)
            # every latent x_0 .. x_{T-1} completed by the ODE, the sampler's v(x_i) its first step
            x0 = ode_complete(transformer, kind, torch.cat(latents[:T]), [p for p in paths for _ in group],
                              sigmas, emb, guidance=args.guidance, micro_batch=args.micro_batch,
                              v_first=torch.cat(sampler_velocities), emb_index=group.repeat(T))
            x0 = torch.cat([x0, latents[T]])  # the final latent is already clean: R_0
            rows = group.repeat(T + 1)
            parts = [score(run.reward_fns, decode(run.pipe, x0[c]), [prompts[g] for g in rows[c]])
                     for c in torch.arange(len(x0)).split(args.micro_batch)]
            images = decode(run.pipe, latents[-1][:G])

        # ALGO LOGIC: dense rewards Delta R_t = R(x_{t-1}) - R(x_t) per step, and per-step advantages
        latent_rewards = {k: torch.cat([p[k] for p in parts]).view(T + 1, P * G) for k in run.reward_fns}
        dense = {k: dense_rewards(v, baseline=args.dense_baseline) for k, v in latent_rewards.items()}
        scores = {k: v[T] for k, v in latent_rewards.items()}  # the final images' rewards
        all_scores = {k: gather_cat(v.view(P, G).to(run.device)).cpu() for k, v in scores.items()}
        advantages = []
        for i in range(T):
            step_rewards = {k: gather_cat(d[i].view(P, G).to(run.device)).cpu() for k, d in dense.items()}
            adv = combined_advantages(step_rewards, run.weights, mode=args.reward_combine, eps=args.adv_eps,
                                      global_std=args.global_std)
            adv = adv.clamp(-args.adv_clip, args.adv_clip)
            advantages.append(adv[rank * P:(rank + 1) * P].reshape(-1))
        advantages = torch.stack(advantages).to(run.device)
        if args.calibrate:  # Algorithm 1 on every trajectory of every rank; no update
            weighted = sum(run.weights[k] * dense_rewards(v) for k, v in latent_rewards.items())
            delta_r = gather_cat(weighted.T.contiguous().to(run.device)).cpu()
            groups = P * world if args.calibration_rule == "group" else 1  # the group rule, or all pooled
            psi = calibrate_step(psi, delta_r, eps1=args.eps1, eps2=args.eps2, psi_range=args.psi_range,
                                 groups=groups, active=[a > 0 for a in noise_levels])
            history.append(psi)
            run.log(iteration + 1, {**{f"psi/step_{i}": p for i, p in enumerate(psi)},
                                    "perf/nfe_per_iteration": run.nfe()})  # psi, and the NFE for the summary
            if rank == 0:
                save_psi(psi_path(args, run.run_dir), psi=psi, iteration=iteration + 1, history=history)
            continue

        # ALGO LOGIC: policy update (the PPO-clipped ratio of per-step log-probs, the KL to the reference)
        stats = Stats("ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl",
                      maxima=("first_ratio_max_dev",))  # means over the terms; the maximum over the ranks
        # all ranks' samples but those of A = 0 at every step (train_sd3.py), shuffled alike on all ranks
        trained_advantages = gather_cat(advantages[train_steps].T.contiguous()).T
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        micro_batches_per_rank = -(-trained_advantages.shape[1] // args.micro_batch)
        minibatches = training_minibatches(trained_advantages, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches_per_rank, generator=same_on_ranks)
        for u, minibatch in enumerate(minibatches):
            terms = micro_batches(minibatch, steps=train_steps, part=run.part,
                                  signal=lambda j, c: args.beta > 0 or (advantages[j][c] != 0).any())
            for j, c, scale in terms:
                adv = advantages[j][c]
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
            run.ema_step(iteration * args.updates_per_iteration + u + 1)

        # TRY NOT TO MODIFY: logging, evaluation, sample grids, checkpoints
        kept = sum(map(len, minibatches)) / (P * G * world)  # the share of the samples trained on
        psi_metrics = {f"psi/step_{i}": p for i, p in enumerate(psi)}
        run.end_iteration(iteration, stats, scores=all_scores, samples=(images[:G], prompts[0], scores),
                          metrics={"train/kept_fraction": kept, **psi_metrics})
    if args.calibrate and rank == 0:
        where = os.path.abspath(psi_path(args, run.run_dir))
        print(f"psi(t) after the last calibration iteration: {where} (train with --psi {where})")
    run.finish()
