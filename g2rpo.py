# Granular-GRPO (G2RPO, Zhou et al., 2025, arXiv 2510.01982); docs: README.md#g2rpo
"""G2RPO: one shared ODE trajectory per group; the members take a single SDE step at k, then ODE again, so reward
differences come from that step alone; advantages from ODE completions at several strides lambda are summed."""
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from tqdm import tqdm

from common import (NFE, apply_preset, broadcast_object, clipped_policy_loss, combine_advantages, decode, ema_update,
                    encode_prompts, fail, gather_cat, gathered, image_grid, latent_shape, latest_checkpoint, load_pipeline,
                    load_prompt_set, load_rewards, load_state, log_metrics, make_trainable, make_writer, ode_complete,
                    optimizer_step, run_summary, save_eval_grid, save_state, score, sde_step, seed_everything, select,
                    setup_distributed, sigma_schedule, swapped_in, velocity)
from common import ode_step, strided_indices  # algorithm specific


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
    """a run directory (or one of its checkpoints) to continue from its latest checkpoint"""

    # Model
    model: str = "flux-dev"
    """a hub id, a local pipeline directory, or an alias: sd3.5-medium, flux-dev, toy (the embedded toy setting)"""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """compute dtype on CUDA: frozen weights (LoRA) and gathered shards (FSDP2) are in it; autocast only for unsharded
    full fine-tuning; the SDE math is always float32"""
    resolution: int = 720
    """image height and width in pixels"""
    max_sequence_length: int = 512
    """T5 prompt length in tokens"""
    guidance: float = 3.5
    """classifier-free guidance scale (SD3, empty negative prompt) or guidance embedding (Flux)"""
    schedule: Literal["pipeline", "shifted"] = "shifted"
    """noise levels: the pipeline's own scheduler (Flow-GRPO) or shift*u / (1 + (shift-1)*u) on linspace(1, 0, T+1)"""
    shift: float = 3.0
    """the shift of --schedule shifted (the pipeline schedule takes its shift from the scheduler's config)"""

    # Data and rewards
    prompts: str = "data/hpdv2/train.txt"
    """training prompts, one per line ('toy' for the toy world's grammar)"""
    eval_prompts: str = "data/hpdv2/test.txt"
    """held-out evaluation prompts, one per line ('toy' for the toy world's grammar)"""
    rewards: tuple[str, ...] = ("hps", "clip")
    """reward names: hps, clip, pickscore, jpeg, or the toy world's toy_color_position, toy_shape_count"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward (default: all 1)"""
    eval_rewards: tuple[str, ...] = ()
    """extra rewards scored only at evaluation, never trained on (e.g. the toy world's strict metric toy_strict)"""
    reward_combine: Literal["rewards", "advantages"] = "advantages"
    """'rewards': normalise the weighted sum of rewards (Flow-GRPO); 'advantages': normalise each reward, then sum (DanceGRPO)"""
    hps_checkpoint: str | None = None
    """local HPS_v2.1_compressed.pt (default: downloaded from the hub repo xswu/HPSv2)"""
    clip_model: str | None = None
    """open_clip model for the CLIP score: a local directory or 'hf-hub:...' (default: apple/DFN5B-CLIP-ViT-H-14-384)"""
    pickscore_model: str | None = None
    """PickScore CLIPModel directory or hub id (default: yuvalkirstain/PickScore_v1)"""
    pickscore_processor: str | None = None
    """PickScore processor directory or hub id (default: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"""

    # Sampling
    num_steps: int = 16
    """T, the number of sampling steps during training"""
    eval_steps: int = 50
    """ODE sampling steps for evaluation"""
    group_size: int = 12
    """G, images per prompt (a group never spans ranks)"""
    prompts_per_iteration: int = 16
    """prompts (groups) per iteration over all ranks; must be a multiple of the world size"""
    micro_batch: int = 12
    """images per model forward, with the same micro-batches in sampling and training (log-probs match bit for bit)"""

    # Algorithm specific arguments
    noise_level: float = 0.7
    """a (eta): SDE noise level, std_dev_t = a*sqrt(sigma/(1-sigma)) ('flow_grpo') or the constant a ('dance')"""
    noise_form: Literal["flow_grpo", "dance"] = "flow_grpo"
    """SDE diffusion coefficient: Flow-GRPO's sigma-dependent one or DanceGRPO's constant eta"""
    sde_steps: tuple[int, ...] = tuple(range(8))
    """M: the schedule indices k (0 = the first, noisiest step) that take the single SDE step and are trained"""
    lambdas: tuple[int, ...] = (1, 2, 3)
    """Lambda: ODE-completion strides (granularities); (1,) is G2RPO w/o MGAI"""
    global_std: bool = False
    """normalise by the std of all rewards of the iteration instead of each group's"""
    std_unbiased: bool = True
    """use the unbiased (n-1) std (DanceGRPO, G2RPO) instead of the population std (Flow-GRPO)"""
    adv_eps: float = 1e-8
    """added to the std in the advantage denominator"""
    adv_clip: float = 5.0
    """advantages are clipped to +-adv_clip"""
    clip_range: float = 1e-4
    """PPO ratio clip range"""

    # Optimisation
    full_finetune: bool = True
    """train every transformer weight (FSDP2 across ranks) instead of LoRA adapters"""
    gradient_checkpointing: bool = True
    """recompute each transformer block's activations in the backward pass (diffusers' per-block checkpointing): about
    a third more training compute for a fraction of the activation memory"""
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
    updates_per_iteration: int | None = None
    """optimizer steps per iteration: the iteration's training terms split into this many mini-batches (the first is
    on-policy); default: one per trained k, as G2RPO's code"""
    ema: bool = False
    """keep an EMA of the trainable weights for evaluation and the exported weights"""
    ema_decay: float = 0.9
    """EMA decay, reached after a warm-up: min((1 + s) / (10 + s), ema_decay) after s optimizer steps"""
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
    """keep the newest N checkpoints (0: all); a sharded FLUX.1-dev checkpoint with its optimizer is ~190 GB"""
    log_images_every: int = 10
    """log a grid of one group's images every N iterations"""


# The embedded toy setting (--model toy): a ~2M-parameter Flux on 32x32 shapes. Flags passed explicitly still win.
TOY = dict(model="toy", mixed_precision="no", resolution=32, max_sequence_length=16, guidance=3.5, prompts="toy",
           eval_prompts="toy", rewards=("toy_color_position", "toy_shape_count"), eval_rewards=("toy_strict",),
           reward_combine="advantages", num_steps=16, eval_steps=16, group_size=12, micro_batch=48,
           full_finetune=True, gradient_checkpointing=False, ema=False, num_iterations=60, eval_every=20, eval_num=256,
           save_every=20, log_images_every=20,
           learning_rate=1.25e-5, noise_level=0.5, prompts_per_iteration=4)  # 8 optimizer steps per iteration: 1e-4 / 8


def check_args(args, world: int):
    if args.group_size < 2:
        fail(f"--group-size {args.group_size} is not allowed; GRPO needs at least 2 images per prompt")
    if args.noise_level < 0:
        fail(f"--noise-level {args.noise_level} is not allowed; use a value >= 0")
    if args.num_steps < 1 or args.eval_steps < 1:
        fail(f"--num-steps {args.num_steps} / --eval-steps {args.eval_steps}: both must be >= 1")
    if args.prompts_per_iteration < world or args.prompts_per_iteration % world:
        fail(f"--prompts-per-iteration {args.prompts_per_iteration} is not a positive multiple of the world size {world}")
    if args.reward_weights and len(args.reward_weights) != len(args.rewards):
        fail(f"--reward-weights has {len(args.reward_weights)} values for {len(args.rewards)} rewards; give one per reward")
    if args.eval_every and (args.eval_num < world or args.eval_num % world):
        fail(f"--eval-num {args.eval_num} is not a positive multiple of the world size {world}")
    if args.ema_every < 1 or args.keep_checkpoints < 0:
        fail(f"--ema-every {args.ema_every} / --keep-checkpoints {args.keep_checkpoints}: use >= 1 / >= 0")
    if args.ema and args.full_finetune and world > 1:
        fail("--ema is not supported with sharded full fine-tuning (world size > 1); pass --no-ema")
    # algorithm specific
    for flag, values, low in (("--sde-steps", args.sde_steps, 0), ("--lambdas", args.lambdas, 1)):
        if not values or min(values) < low or max(values) >= args.num_steps or len(set(values)) < len(values):
            fail(f"{flag} {list(values)} is not allowed; give distinct values in {low}..{args.num_steps - 1}"
                 + (" (a repeated stride only duplicates identical advantages)" if flag == "--lambdas" else ""))
    most = len(args.sde_steps)  # one per trained k
    args.updates_per_iteration = args.updates_per_iteration or most
    if not 1 <= args.updates_per_iteration <= most:
        fail(f"--updates-per-iteration {args.updates_per_iteration} is not allowed; use 1..{most} (mini-batches per iteration)")


def planned_nfe(args) -> dict:
    """Transformer evaluations per prompt and iteration (a CFG pair counts once): the rollout, the training forwards and
    the reference model's (KL); tested against the measured perf/nfe_*, an upper bound where zero advantages skip some."""
    M, T = sorted(args.sde_steps), args.num_steps
    return {"rollout": max(M) + 1 + args.group_size * sum((k + 1 < T) * (1 + sum(-(-(T - k - 1) // lam) - 1 for lam in
                                                                                 args.lambdas)) for k in M),
            "train": len(M), "reference": 0}


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.model == "toy":
        apply_preset(args, TOY)
    rank, world, device = setup_distributed()
    check_args(args, world)

    # TRY NOT TO MODIFY: run name, logging, seeding
    ckpt = latest_checkpoint(args.resume) if args.resume else None
    if args.resume and ckpt is None:
        fail(f"--resume {args.resume!r} holds no checkpoint; pass a run directory with checkpoints/iter_*")
    run_name = f"{os.path.basename(args.model.rstrip('/'))}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = os.path.dirname(os.path.dirname(ckpt)) if ckpt else broadcast_object(os.path.join(args.output_dir, run_name))
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
    writer = make_writer(run_dir, args, args.track, args.wandb_project, rank, ckpt)
    seed_everything(args.seed, args.torch_deterministic)

    # TRY NOT TO MODIFY: model, rewards, prompts, optimizer
    train_prompts, eval_prompts = load_prompt_set(args.prompts, "train"), load_prompt_set(args.eval_prompts, "test")
    amp = torch.bfloat16 if args.mixed_precision == "bf16" and device.type == "cuda" else None
    pipe, kind = load_pipeline(args.model, device, amp or torch.float32)
    transformer = pipe.transformer
    C, H, W = latent_shape(pipe, kind, args.resolution)
    weights = dict(zip(args.rewards, args.reward_weights or [1.0] * len(args.rewards)))
    reward_fns = load_rewards(dict.fromkeys(args.rewards + args.eval_rewards), device, args.hps_checkpoint,
                              args.clip_model, args.pickscore_model, args.pickscore_processor, dtype=amp or torch.float32)
    eval_fns, reward_fns = reward_fns, {k: reward_fns[k] for k in args.rewards}
    sharded = args.full_finetune and world > 1  # FSDP2 across ranks; LoRA runs average gradients (DDP style)
    params, _ = make_trainable(transformer, kind, args.lora_rank, args.lora_alpha, args.full_finetune, False,
                                    sharded, amp, args.gradient_checkpointing)
    names = [n for n, p in transformer.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                                  eps=1e-8)
    ema = [p.detach().float().clone() for p in params] if args.ema else None
    unsharded_fp32 = amp is not None and args.full_finetune and not sharded  # bf16 compute needs autocast only then
    autocast = lambda: torch.autocast(device.type, dtype=amp, enabled=unsharded_fp32, cache_enabled=False)  # noqa: E731
    start, ema = load_state(ckpt, transformer, optimizer, params, names, sharded, device, args.ema) if ckpt else (0, ema)
    sigmas = sigma_schedule(args.num_steps, args.shift, pipe if args.schedule == "pipeline" else None, kind, H * W // 4)
    eval_sigmas = sigma_schedule(args.eval_steps, args.shift, pipe, kind, H * W // 4)  # evaluation: as the pipeline samples
    P, G, T = args.prompts_per_iteration // world, args.group_size, args.num_steps
    M, L = sorted(args.sde_steps), len(args.lambdas)
    nfe_min = planned_nfe(args)["rollout"]  # per prompt, the closed form (measured: perf/nfe_rollout_per_prompt)

    def evaluate(iteration):
        """ODE samples (noise 0) with eval_steps on fixed held-out prompt/seed pairs, scored by every reward."""
        pairs = list(range(rank, args.eval_num, world))
        prompts = [eval_prompts[k % len(eval_prompts)] for k in pairs]
        noise = torch.stack([torch.randn(C, H, W, generator=torch.Generator().manual_seed(10**6 + k)) for k in pairs])
        emb = encode_prompts(pipe, kind, prompts, args.max_sequence_length, args.guidance)  # before gathering weights
        with swapped_in(params, ema), autocast(), gathered(transformer, sharded):
            x0 = ode_complete(transformer, kind, noise.to(device), [list(range(args.eval_steps + 1))] * len(noise),
                              eval_sigmas, emb, args.guidance, args.micro_batch)
        images = torch.cat([decode(pipe, z) for z in x0.split(args.micro_batch)])
        local = score(eval_fns, images, prompts)
        scores = {k: gather_cat(v.to(device)).cpu() for k, v in local.items()}
        log_metrics(writer, run_dir, iteration, {f"eval/{k}": v.mean() for k, v in scores.items()}, per_sample=scores)
        if writer is not None:  # the same pairs every time: flip through runs/<run>/samples/eval_*.png
            save_eval_grid(run_dir, iteration, images, prompts, local)
        return sum(weights[k] * scores[k].mean() for k in args.rewards).item() / sum(weights.values())  # weighted mean

    t0, headline = time.time(), evaluate(0) if start == 0 and args.eval_every else None  # iteration 0: the base model
    pbar = tqdm(range(start, args.num_iterations), disable=rank != 0, desc="iterations", initial=start,
                total=args.num_iterations)
    for iteration in pbar:
        t_start, nfe_start = time.time(), NFE["count"]
        gen = torch.Generator().manual_seed(args.seed * 100_003 + iteration * 1009 + rank)  # resume-exact randomness

        # ALGO LOGIC: rollout (Singular Stochastic Sampling: shared ODE anchor, one SDE step at k, ODE completions)
        prompts = [train_prompts[i] for i in torch.randint(len(train_prompts), (P,), generator=gen)]
        group = torch.arange(P).repeat_interleave(G)  # sample -> its prompt
        x = torch.randn(P, C, H, W, generator=gen).to(device)  # one initial noise per group
        anchors, post, old_log_probs, per_k = {}, {}, {}, {}
        chunks = torch.arange(P).split(args.micro_batch)  # prompts per forward at the anchors (sampling and training)
        members = [torch.arange(c[0] * G, (c[-1] + 1) * G) for c in chunks]  # the group members of each chunk
        emb = encode_prompts(pipe, kind, prompts, args.max_sequence_length, args.guidance)  # before gathering weights
        with torch.no_grad(), autocast(), gathered(transformer, sharded):  # weights gathered once for the rollout
            for k in range(max(M) + 1):  # the anchor trajectory x_T -> x_k, keeping x_k and v(x_k) for k in M
                v = torch.cat([velocity(transformer, kind, x[c], sigmas[k], select(emb, c), args.guidance) for c in chunks])
                anchors[k] = (x, v)
                x = ode_step(v, x, sigmas[k], sigmas[k + 1])
            for k in M:  # G SDE steps from the shared x_k (v(x_k) computed once), then ODE at every granularity
                steps = [sde_step(anchors[k][1][group[m]], anchors[k][0][group[m]], sigmas, k, args.noise_level,
                                  generator=gen, form=args.noise_form) for m in members]
                post[k], old_log_probs[k] = torch.cat([s[0] for s in steps]), torch.cat([s[1] for s in steps])
                paths = [strided_indices(k + 1, T, lam) for lam in args.lambdas for _ in range(P * G)]  # v(first) shared
                x0 = ode_complete(transformer, kind, post[k], paths, sigmas, emb, args.guidance, args.micro_batch,
                                  emb_index=group)
                images = torch.cat([decode(pipe, z) for z in x0.split(args.micro_batch)])
                per_k[k] = score(reward_fns, images, [prompts[g] for g in group.repeat(L)])  # [L * P * G] each
        nfe_rollout = NFE["count"] - nfe_start
        t_rollout = time.time() - t_start

        # ALGO LOGIC: advantages per k: z-score per granularity and reward within the group, sum, clip (Eq. 9-10)
        by_k = {k: {r: gather_cat(v.view(L, P, G).to(device).transpose(0, 1)).transpose(0, 1).cpu()
                        for r, v in per_k[k].items()} for k in M}  # [L, P_all, G]
        advantages = {k: sum(combine_advantages({r: v[j] for r, v in by_k[k].items()}, weights, args.reward_combine,
                                                args.adv_eps, args.std_unbiased, args.global_std, float("inf")) for j in range(L))
                      .clamp(-args.adv_clip, args.adv_clip)[rank * P:(rank + 1) * P].reshape(-1).to(device) for k in M}
        all_scores = {r: torch.cat([by_k[k][r].reshape(-1, G) for k in M]) for r in args.rewards}
        scores = {r: v[:G] for r, v in per_k[M[-1]].items()}  # the first group at the last k (the images logged below)

        # ALGO LOGIC: policy update (ratio at step k only, v(x_k) once per prompt; the k in M split into mini-batches)
        stats, first_dev, grad_norms = torch.zeros(6, device=device), 0.0, []
        for u, mb in enumerate(torch.tensor_split(torch.tensor(M), args.updates_per_iteration)):
            n_terms = P * G * len(mb)
            for k, c, m in ((k, c, m) for k in mb.tolist() for c, m in zip(chunks, members)):
                if not sharded and (advantages[k][m] == 0).all():
                    continue  # zero advantage: no gradient
                with autocast():
                    v = velocity(transformer, kind, anchors[k][0][c], sigmas[k], select(emb, c), args.guidance)
                rows = group[m] - c[0]  # each member reuses its prompt's v(x_k): all members share x_k bit for bit
                _, log_prob, _, _ = sde_step(v[rows], anchors[k][0][c][rows], sigmas, k, args.noise_level,
                                             prev_sample=post[k][m], form=args.noise_form)
                loss, sums, dev = clipped_policy_loss(log_prob, old_log_probs[k][m], advantages[k][m], args.clip_range)
                (loss * len(m) / n_terms).backward()
                stats += sums
                first_dev = max(first_dev, float(dev)) if u == 0 else first_dev
            grad_norms.append(optimizer_step(params, optimizer, args.max_grad_norm, sharded))
            n_updates = iteration * args.updates_per_iteration + u + 1  # optimizer steps so far
            if ema is not None and (n_updates + 1) % args.ema_every == 0:  # as Flow-GRPO: after steps 7, 15, ...
                ema_update(ema, params, args.ema_decay, n_updates)

        # TRY NOT TO MODIFY: logging, evaluation, checkpoints
        stats = gather_cat(stats[None]).sum(0)
        n = stats[5].clamp(min=1)
        metrics = {f"reward/{k}_mean": v.mean() for k, v in all_scores.items()}
        metrics.update({f"reward/{k}_std": v.std() for k, v in all_scores.items()})
        flat = torch.stack([(v.max(1).values == v.min(1).values) for v in all_scores.values()]).all(0)
        metrics.update({"reward/zero_std_fraction": flat.float().mean(), "train/ratio_mean": stats[0] / n,
                        "train/clipfrac": stats[1] / n, "train/approx_kl": stats[2] / n, "train/policy_loss": stats[3] / n,
                        "train/kl": stats[4] / n, "train/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                        "train/updates": len(grad_norms),
                        "train/first_ratio_max_dev": first_dev, "perf/nfe_rollout_per_prompt": nfe_rollout / P,
                        "perf/nfe_min_per_prompt": nfe_min,
                        "perf/nfe_per_iteration": (NFE["count"] - nfe_start) * world,
                        "perf/rollout_seconds": t_rollout, "perf/seconds_per_iteration": time.time() - t_start})
        log_metrics(writer, run_dir, iteration + 1, metrics)
        pbar.set_postfix({**{k: f"{v.mean():.3f}" for k, v in all_scores.items()}, "eval": f"{headline or float('nan'):.3f}",
                          "ratio-1": f"{first_dev:.0e}"})
        if writer is not None and args.log_images_every and (iteration + 1) % args.log_images_every == 0:
            caption = lambda k: f"{prompts[0][:40]}\n" + " ".join(f"{n}={v[k]:.3f}" for n, v in scores.items())  # noqa: E731
            writer.add_figure("samples", image_grid(images[:G].cpu(), [caption(k) for k in range(G)]), iteration + 1)
        last = iteration + 1 == args.num_iterations
        if args.eval_every and ((iteration + 1) % args.eval_every == 0 or last):
            headline = evaluate(iteration + 1)
        if (args.save_every and (iteration + 1) % args.save_every == 0) or last:
            save_state(os.path.join(run_dir, "checkpoints", f"iter_{iteration + 1}"), iteration + 1, transformer, optimizer,
                       params, names, ema, args, pipe, sharded, args.keep_checkpoints)
    if writer is not None:
        writer.close()
        print(run_summary(run_dir, args, kind, weights, time.time() - t0))
    if world > 1:
        torch.distributed.destroy_process_group()
