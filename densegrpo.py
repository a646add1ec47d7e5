# DenseGRPO (arXiv 2601.20218); docs: README.md#densegrpo
"""DenseGRPO: Flow-GRPO's SDE trajectories, each step rewarded by the change of the reward of the ODE
completion of the latent across it; per-step noise levels psi(t) calibrated to the reward (Algorithm 1).

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
from common import max_over_ranks, ode_complete, sde_mean_std, sde_step, spaced_indices
from rundir import load_psi, psi_path, save_psi


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
    guidance: float = 4.5
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
    eval_num: int = 512
    """held-out prompt/seed pairs per evaluation"""
    save_every: int = 30
    """checkpoint every N iterations and at the end (0: only at the end)"""
    keep_checkpoints: int = 3
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# --model toy: a ~2M-parameter Flux on 32x32 shapes (README: the toy world). Explicit flags still win.
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
    if args.noise_level == 0:  # the images of a group differ by their initial noise: no log-prob to train
        fail("--noise-level 0.0 is not allowed; use a value > 0 (a step without noise has no log-prob)")
    per_rank = args.prompts_per_iteration // world * args.group_size
    most = -(-per_rank // args.micro_batch)  # one mini-batch per micro-batch at most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} "
             f"(mini-batches per iteration)")


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
    # training samples with the pipeline's own schedule (Flow-GRPO), evaluation too
    sigmas = pipeline_sigmas(pipe, kind, num_steps=T, image_tokens=H * W // 4)
    eval_sigmas = pipeline_sigmas(pipe, kind, num_steps=args.eval_steps, image_tokens=H * W // 4)
    n_train = int(T * args.timestep_fraction)
    psi = [args.noise_level] * T if args.psi is None else load_psi(args.psi, T)  # psi(t) replaces a
    history = []  # psi after each calibration iteration
    n = T if args.dense_ode_steps == "t" else args.dense_ode_steps
    paths = [spaced_indices(i, T, n) for i in range(T)]  # ODE_n(x_i): min(n, T - i) steps
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
    last_eval = evaluate(0) if start == 0 and args.eval_every and not args.calibrate else None
    bar = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}"
    pbar = tqdm(range(start, args.num_iterations), disable=not is_main, initial=start,
                total=args.num_iterations, bar_format=bar)
    for iteration in pbar:
        t_start, cpu_start = time.time(), time.process_time()
        nfe_start = NFE["count"]
        gen = iteration_generator(args.seed, iteration, rank)

        # ALGO LOGIC: rollout (the SDE with psi(t) at every step), then ODE completions of every latent
        train_steps = list(range(n_train))
        noise_levels = [psi[i] if i < T - 1 or i in train_steps else 0.0 for i in range(T)]
        train_steps = [j for j in train_steps if noise_levels[j] > 0]  # psi(t) = 0: no log-prob to train
        prompts = [train_prompts[i] for i in torch.randint(len(train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, G, C, H, W, generator=gen).reshape(P * G, C, H, W).to(device)
        latents = [x]
        old_log_probs = []
        sampler_velocities = []
        chunks = torch.arange(P * G).split(args.micro_batch)
        emb = encode_prompts(pipe, kind, prompts, max_sequence_length=args.max_sequence_length,
                             cfg=args.guidance)
        with torch.no_grad(), amp, gathered(transformer, sharded=sharded):
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
            parts = [score(reward_fns, decode(pipe, x0[c]), [prompts[g] for g in rows[c]])
                     for c in torch.arange(len(x0)).split(args.micro_batch)]
            images = decode(pipe, latents[-1][:G])
        nfe_rollout = NFE["count"] - nfe_start
        t_rollout = time.time() - t_start

        # ALGO LOGIC: dense rewards Delta R_t = R(x_{t-1}) - R(x_t) per step, and per-step advantages
        latent_rewards = {k: torch.cat([p[k] for p in parts]).view(T + 1, P * G) for k in reward_fns}
        dense = {k: dense_rewards(v, baseline=args.dense_baseline) for k, v in latent_rewards.items()}
        scores = {k: v[T] for k, v in latent_rewards.items()}  # the final images' rewards
        all_scores = {k: gather_cat(v.view(P, G).to(device)).cpu() for k, v in scores.items()}
        advantages = []
        for i in range(T):
            step_rewards = {k: gather_cat(d[i].view(P, G).to(device)).cpu() for k, d in dense.items()}
            adv = combine_advantages(step_rewards, weights, mode=args.reward_combine, eps=args.adv_eps,
                                     unbiased=False, global_std=args.global_std)
            adv = adv.clamp(-args.adv_clip, args.adv_clip)
            advantages.append(adv[rank * P:(rank + 1) * P].reshape(-1))
        advantages = torch.stack(advantages).to(device)
        if args.calibrate:  # Algorithm 1 on every trajectory of every rank; no update
            weighted = sum(weights[k] * dense_rewards(v) for k, v in latent_rewards.items())
            delta_r = gather_cat(weighted.T.contiguous().to(device)).cpu()
            groups = P * world if args.calibration_rule == "group" else 1  # the group rule, or all pooled
            psi = calibrate_step(psi, delta_r, eps1=args.eps1, eps2=args.eps2, psi_range=args.psi_range,
                                 groups=groups, active=[a > 0 for a in noise_levels])
            history.append(psi)
            nfe = sum_over_ranks({"nfe": NFE["count"] - nfe_start})["nfe"]
            if is_main:  # psi, and the NFE for the summary
                psi_metrics = {f"psi/step_{i}": p for i, p in enumerate(psi)}
                log_metrics(writer, run_dir, iteration + 1, {**psi_metrics, "perf/nfe_per_iteration": nfe})
                save_psi(psi_path(args, run_dir), psi=psi, iteration=iteration + 1, history=history)
            continue

        # ALGO LOGIC: policy update (the PPO-clipped ratio of per-step log-probs, the KL to the reference)
        sums = dict.fromkeys(["terms", "ratio_mean", "clipfrac", "approx_kl", "policy_loss", "kl"], 0.0)
        first_ratio_dev = 0.0  # max |ratio - 1| in the first mini-batch: 0 if sampling and training agree
        grad_norms = []
        # all ranks' samples but those of A = 0 at every step (train_sd3.py), shuffled alike on all ranks
        trained_advantages = gather_cat(advantages[train_steps].T.contiguous()).T
        same_on_ranks = iteration_generator(args.seed, iteration, 0, stream=1)
        micro_batches = -(-trained_advantages.shape[1] // args.micro_batch)  # as many as one process has
        minibatches = training_minibatches(trained_advantages, updates=args.updates_per_iteration,
                                           micro_batches=micro_batches, generator=same_on_ranks)
        for u, minibatch in enumerate(minibatches):
            has_gradient = False
            chunks = rank_chunks(minibatch, rank=rank, world=world, per_rank=P * G,
                                 micro_batch=args.micro_batch, sharded=sharded)  # this rank's part of it
            for j in train_steps:
                for c, weight in chunks:
                    adv = advantages[j][c]
                    signal = weight > 0 and (args.beta > 0 or bool((adv != 0).any()))
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
                    (loss * weight / len(train_steps)).backward()  # the mean over the mini-batch's terms
                    if weight == 0:
                        continue  # a sharded rank's extra forward: it joins the collectives, adds no term
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
            if ema is not None and (n_updates + 1) % args.ema_every == 0:
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
        metrics["train/kept_fraction"] = sum(map(len, minibatches)) / (P * G * world)  # of the samples
        metrics["train/first_ratio_max_dev"] = max_over_ranks(first_ratio_dev)
        metrics["perf/nfe_rollout_per_prompt"] = totals["nfe_rollout"] / (P * world)
        metrics["perf/nfe_min_per_prompt"] = nfe_min
        metrics["perf/nfe_per_iteration"] = totals["nfe"]
        metrics.update({f"psi/step_{i}": p for i, p in enumerate(psi)})
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
