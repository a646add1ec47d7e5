"""The run directory (runs/<run_name>) the algorithm files write, and what reads it back: plain functions, in
the order of a run.

1. The run directory and its logs: run_directory, make_writer (TensorBoard, wandb), read_jsonl, log_metrics
2. Checkpoints: iteration_of, latest_checkpoint, resume_checkpoint, save_state (atomic; diffusers exports),
   load_state
3. Sample grids and the end-of-run summary: image_grid, save_eval_grid, paired_change, run_summary
4. DenseGRPO's psi(t) file (--calibrate writes it, --psi reads it): psi_path, save_psi, load_psi

Only the algorithm files, evaluate.py and the scripts import it; it imports common.py (never the other way).
"""
import contextlib
import json
import math
import os
import shutil
import sys
import textwrap

import torch
import torch.distributed as dist

from common import MODEL_ALIASES, broadcast_object, fail, is_main_rank, loggable, swapped_in


# ======== 1. The run directory and its logs ========
def run_directory(args, *, checkpoint: str | None) -> str:
    """The resumed checkpoint's run, or <output_dir>/<model>__<exp_name>__<seed>__<time> (made by rank 0)."""
    import time
    if checkpoint:
        return os.path.dirname(os.path.dirname(checkpoint))
    model_name = os.path.basename(args.model.rstrip("/"))
    run_name = f"{model_name}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = broadcast_object(os.path.join(args.output_dir, run_name))
    if is_main_rank():
        os.makedirs(run_dir, exist_ok=True)
    return run_dir


def make_writer(run_dir: str, args, *, resume_iteration: int | None = None):
    """Rank 0's TensorBoard writer (wandb syncs it with --track), the arguments as text; resuming after N
    drops what the killed run logged after N (metrics.jsonl rows, eval_<i>.*, TensorBoard events)."""
    from torch.utils.tensorboard import SummaryWriter
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if resume_iteration is not None and os.path.isfile(metrics):
        rows = [r for r in read_jsonl(metrics) if r["iteration"] <= resume_iteration]
        with open(metrics, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for d in (run_dir, os.path.join(run_dir, "samples")):
            for name in os.listdir(d) if os.path.isdir(d) else []:
                if name.startswith("eval_") and (iteration_of(name) or 0) > resume_iteration:
                    os.remove(os.path.join(d, name))
    config = loggable(args)
    if args.track:
        import wandb
        wandb.init(project=args.wandb_project, sync_tensorboard=True, config=config,
                   name=os.path.basename(run_dir), save_code=True)
    writer = SummaryWriter(run_dir, purge_step=None if resume_iteration is None else resume_iteration + 1)
    table = "\n".join(f"|{k}|{v}|" for k, v in config.items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file, without a last line that a killed process left half written."""
    rows = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def log_metrics(writer, run_dir: str, step: int, metrics: dict, per_sample: dict | None = None):
    """On rank 0: scalars to TensorBoard and a line to <run_dir>/metrics.jsonl; `per_sample` (every evaluation
    pair's reward, for paired comparisons) to <run_dir>/eval_<step>.json."""
    for k, v in metrics.items():
        writer.add_scalar(k, v, step)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iteration": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    if per_sample is not None:
        with open(os.path.join(run_dir, f"eval_{step}.json"), "w") as f:
            json.dump({k: v.tolist() for k, v in per_sample.items()}, f)


# ======== 2. Checkpoints: atomic saves, exports, resuming ========
def iteration_of(name: str) -> int | None:
    """N of a checkpoint 'iter_<N>' or an evaluation file 'eval_<N>.json' / 'eval_<N>.png', else None."""
    stem = os.path.basename(os.path.normpath(name)).split(".")[0]
    prefix, _, number = stem.partition("_")
    return int(number) if prefix in ("iter", "eval") and number.isdigit() else None


def latest_checkpoint(path: str):
    """The newest complete <run>/checkpoints/iter_<N> of a run directory (or `path` if it is one), or None."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "run.json")):
        if iteration_of(path) is None or os.path.basename(os.path.dirname(path)) != "checkpoints":
            fail(f"--resume {path!r} is not a run's checkpoints/iter_<N>; pass the run directory")
        return path
    root = os.path.join(path, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    done = [d for d in names if iteration_of(d) is not None and not d.endswith(".tmp")]
    return os.path.join(root, max(done, key=iteration_of)) if done else None


FIXED_ON_RESUME = ("model", "full_finetune", "lora_rank", "lora_alpha", "ema")  # trainable weights' layout


def resume_checkpoint(path: str, *, args, world: int, script: str) -> tuple[str, int]:
    """The checkpoint to resume (chosen on rank 0: every rank reads the same one) and its iteration, checked
    before any model loads: same algorithm file, model, trainable weights, world size if sharded. Prints the
    arguments that differ from the checkpoint's: the new values apply (e.g. --learning-rate)."""
    ckpt = broadcast_object(latest_checkpoint(path) if is_main_rank() else None)
    if ckpt is None:
        fail(f"--resume {path!r} holds no checkpoint; pass a run directory with checkpoints/iter_*")
    try:
        with open(os.path.join(ckpt, "run.json")) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"checkpoint {ckpt!r} cannot be read ({type(e).__name__} in run.json); resume from another one")
    if saved["script"] != script:
        fail(f"checkpoint {ckpt!r} was made by {saved['script']}, not {script}; resume it with that file")
    now = loggable(args)  # as run.json holds them
    for key in FIXED_ON_RESUME:
        if saved["args"].get(key) != now[key]:
            fail(f"checkpoint {ckpt!r} has --{key.replace('_', '-')} {saved['args'].get(key)}, this run "
                 f"{now[key]}; the trainable weights must match to resume")
    sharded = args.full_finetune and world > 1
    if saved["sharded"] != sharded or (sharded and saved["world"] != world):
        how = "sharded" if saved["sharded"] else "unsharded"
        fail(f"checkpoint {ckpt!r} was saved by {saved['world']} process(es) ({how}); resume it with that "
             f"world size, not {world}")
    changed = [f"{k} {saved['args'].get(k)} -> {v}" for k, v in now.items()
               if k != "resume" and saved["args"].get(k) != v]
    if changed and is_main_rank():
        print("resuming with changed arguments: " + ", ".join(changed))
    return ckpt, saved["iteration"]


def save_state(path: str, *, iteration: int, transformer, optimizer, params: dict, ema, args, pipe,
               sharded: bool, keep: int = 0, extra: dict | None = None):
    """Atomic checkpoint at `path` (path.tmp, renamed): run.json (iteration, script, world size, arguments),
    state.pt (unsharded: trainable weights, optimizer, EMA, `extra` {name: a list shaped like params}, e.g. an
    old policy) or dcp/ (sharded: each rank's shards by torch.distributed.checkpoint, `extra` too), exports
    (the EMA if any): lora/ (diffusers `pipe.load_lora_weights`, with alpha) or transformer/
    (`<Transformer>.from_pretrained`; sharded: a file per rank and an index)."""
    from safetensors.torch import save_file
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    barrier = dist.barrier if dist.is_initialized() else lambda: None
    tmp = path + ".tmp"
    export = os.path.join(tmp, "transformer")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(export)
    barrier()
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_state, optim_state = get_state_dict(transformer, optimizer)
        extra_state = {k: dict(zip(params, v)) for k, v in (extra or {}).items()}
        dcp.save({"model": model_state, "optim": optim_state, "extra": extra_state},
                 checkpoint_id=os.path.join(tmp, "dcp"))
        files = [f"diffusion_pytorch_model-{r + 1:05d}-of-{world:05d}.safetensors" for r in range(world)]
        weight_map, mine = {}, {}
        for k, (name, t) in enumerate(transformer.state_dict().items()):  # one tensor at a time, every rank
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            weight_map[name] = files[k % world]
            if k % world == rank:
                mine[name] = full.detach().cpu().contiguous()
        save_file(mine, os.path.join(export, files[rank]))
        if rank == 0:
            config = json.loads(transformer.to_json_string())
            config["_class_name"] = config["_class_name"].removeprefix("FSDP")  # the class FSDP2 wrapped
            with open(os.path.join(export, "config.json"), "w") as f:
                json.dump(config, f, indent=1)
            with open(os.path.join(export, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    elif rank == 0:
        state = {"trainable": {n: p.detach().cpu().clone() for n, p in params.items()},
                 "optimizer": optimizer.state_dict(),
                 "ema": dict(zip(params, (e.cpu() for e in ema))) if ema else None,
                 "extra": {k: dict(zip(params, (t.cpu() for t in v))) for k, v in (extra or {}).items()}}
        torch.save(state, os.path.join(tmp, "state.pt"))
        with swapped_in(list(params.values()), ema):
            if args.full_finetune:
                transformer.save_config(export)
                weights = {k: v.detach().contiguous().cpu() for k, v in transformer.state_dict().items()}
                save_file(weights, os.path.join(export, "diffusion_pytorch_model.safetensors"))
            else:
                from peft.utils import get_peft_model_state_dict
                os.rmdir(export)
                adapter = transformer.peft_config["default"].to_dict()  # its alpha: loaded at full strength
                lora = get_peft_model_state_dict(transformer)
                type(pipe).save_lora_weights(os.path.join(tmp, "lora"), lora,
                                             transformer_lora_adapter_metadata=adapter)
    barrier()
    if rank == 0:
        run = {"iteration": iteration, "script": os.path.basename(sys.argv[0]), "world": world,
               "sharded": sharded, "args": loggable(args)}
        with open(os.path.join(tmp, "run.json"), "w") as f:
            json.dump(run, f, indent=1)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        root = os.path.dirname(path)
        done = sorted((d for d in os.listdir(root) if iteration_of(d) is not None and not d.endswith(".tmp")),
                      key=iteration_of)
        for d in done[:-keep] if keep else []:  # a sharded FLUX.1-dev checkpoint is ~190 GB
            shutil.rmtree(os.path.join(root, d))
    barrier()


def load_state(path: str, *, transformer, optimizer, params: dict, sharded: bool, device, ema: bool,
               learning_rate: float, weight_decay: float, extra: dict | None = None):
    """Restores what save_state wrote (sharded: same world size), with this run's learning rate and weight
    decay in the optimizer, and the lists of `extra` in place. Returns the EMA (a list), or None."""
    extra = extra or {}
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        shards = dict(zip(("model", "optim"), get_state_dict(transformer, optimizer)))
        shards["extra"] = {k: dict(zip(params, v)) for k, v in extra.items()}
        dcp.load(shards, checkpoint_id=os.path.join(path, "dcp"))  # each rank reads its own shards in place
        set_state_dict(transformer, optimizer, model_state_dict=shards["model"],
                       optim_state_dict=shards["optim"])
        saved_ema = None
    else:
        try:  # weights_only: a pickle cannot run code
            state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            fail(f"checkpoint {path!r} cannot be read ({type(e).__name__} in state.pt); resume another one")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state["trainable"][n])
        optimizer.load_state_dict(state["optimizer"])
        saved_ema = state["ema"]
        with torch.no_grad():
            for k, values in extra.items():
                for n, t in zip(params, values):
                    t.copy_(state["extra"][k][n])
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = learning_rate, weight_decay
    return [saved_ema[n].to(device) for n in params] if ema else None


# ======== 3. Sample grids and the end-of-run summary ========
def image_grid(images, captions, ncols: int = 6, path: str | None = None, title: str = ""):
    """Matplotlib figure of images [B, 3, H, W] in [0, 1] under their captions, saved to `path` if given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ncols = min(ncols, len(images))
    rows = math.ceil(len(images) / ncols)
    lines = max(c.count("\n") + 1 for c in captions)
    fig, axes = plt.subplots(rows, ncols, figsize=(2.4 * ncols, (2.3 + 0.15 * lines) * rows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, img, cap in zip(axes.flat, images, captions):
        ax.imshow(img.permute(1, 2, 0).float().cpu().numpy())
        ax.set_title(cap, fontsize=7)
    fig.suptitle(title, fontsize=9)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return fig


def save_eval_grid(run_dir: str, iteration: int, images, prompts: list, scores: dict, n: int = 12):
    """runs/<run>/samples/eval_<iteration>.png: the first n evaluation pairs, their prompts and rewards."""
    captions = ["\n".join(textwrap.wrap(p, 34) + [f"{k} {v[i]:.3f}" for k, v in scores.items()])
                for i, p in enumerate(prompts[:n])]
    image_grid(images[:n].cpu(), captions, path=os.path.join(run_dir, "samples", f"eval_{iteration}.png"),
               title=f"iteration {iteration}: ODE samples of fixed prompt / seed pairs")


def paired_change(before: list, after: list) -> tuple[float, float]:
    """The mean change over the same pairs and its paired standard error."""
    a, b = torch.tensor(before, dtype=torch.float64), torch.tensor(after, dtype=torch.float64)
    return float((b - a).mean()), float((b - a).std() / math.sqrt(len(a)))


def run_summary(run_dir: str, *, args, kind: str, weights: dict, seconds: float) -> str:
    """What a run did (metrics.jsonl, eval_<i>.json): each reward at the first and last evaluation with the
    change's paired standard error, time, NFE, sample grids, the checkpoint and how diffusers loads it."""
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "perf/nfe_per_iteration" in r]
    nfe = sum(r["perf/nfe_per_iteration"] for r in rows)
    took = f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"
    out = [f"\n{args.exp_name} on {args.model}: {len(rows)} iteration{'s' * (len(rows) != 1)} in {took}, "
           f"{nfe:,.0f} transformer evaluations (NFE)"]
    if getattr(args, "calibrate", False):  # DenseGRPO's Algorithm 1: psi, no update
        psi = os.path.abspath(psi_path(args, run_dir))
        out.append(f"psi(t) after the last calibration iteration: {psi} (train with --psi {psi})")
    names = os.listdir(run_dir)
    evals = sorted(iteration_of(f) for f in names if f.startswith("eval_") and f.endswith(".json"))
    if len(evals) > 1:
        e0, e1 = (json.load(open(os.path.join(run_dir, f"eval_{i}.json"))) for i in (evals[0], evals[-1]))
        for e in (e0, e1):  # the training objective on held-out pairs: the weighted mean of the rewards
            e["training reward"] = [sum(weights[k] * e[k][j] for k in weights) / sum(weights.values())
                                    for j in range(len(e[args.rewards[0]]))]
        pairs = len(e1[args.rewards[0]])
        out.append(f"Evaluation on {pairs} fixed prompt/seed pairs (ODE, {args.eval_steps} steps), iteration "
                   f"{evals[0]} -> {evals[-1]}, change +- paired standard error:")
        for name in ["training reward", *[k for k in e1 if k != "training reward"]]:
            d, se = paired_change(e0[name], e1[name])
            verdict = "improved" if d > 2 * se else "got worse" if d < -2 * se else "no change beyond 2 SE"
            means = f"{sum(e0[name]) / len(e0[name]):.4f} -> {sum(e1[name]) / len(e1[name]):.4f}"
            out.append(f"  {name:>20}: {means} ({d:+.4f} +- {se:.4f}, {d / se if se > 0 else 0:+.1f} SE): "
                       f"{verdict}")
    samples = os.path.abspath(os.path.join(run_dir, "samples"))
    grids = sorted(os.listdir(samples), key=iteration_of) if os.path.isdir(samples) else []
    if grids:
        out.append(f"Sample grids in {samples}: {', '.join(grids)}")
    ckpt = latest_checkpoint(run_dir)
    if ckpt:
        ckpt, model = os.path.abspath(ckpt), MODEL_ALIASES.get(args.model, args.model)
        pipe_cls, tr_cls = ("Flux", "Flux") if kind == "flux" else ("StableDiffusion3", "SD3")
        if args.full_finetune:
            transformer = f"{tr_cls}Transformer2DModel.from_pretrained({os.path.join(ckpt, 'transformer')!r})"
            load = f"pipe = {pipe_cls}Pipeline.from_pretrained({model!r}, transformer={transformer})"
        else:
            load = (f"pipe = {pipe_cls}Pipeline.from_pretrained({model!r}); "
                    f"pipe.load_lora_weights({os.path.join(ckpt, 'lora')!r})")
        call = (f"pipe('a red circle on the left', height={args.resolution}, width={args.resolution}, "
                f"num_inference_steps={args.eval_steps}, guidance_scale={args.guidance}, "
                f"max_sequence_length={args.max_sequence_length})")
        out += [f"Checkpoint: {ckpt} (continue with --resume {os.path.abspath(run_dir)}); in diffusers:",
                f"  from diffusers import {pipe_cls}Pipeline, {tr_cls}Transformer2DModel", f"  {load}",
                f"  image = {call}.images[0]"]
    return "\n".join(out)


# ======== 4. DenseGRPO's psi(t) file ========
def psi_path(args, run_dir: str) -> str:
    """Where --calibrate writes psi(t): --psi-out, else <run dir>/psi.json."""
    return args.psi_out or os.path.join(run_dir, "psi.json")


def save_psi(path: str, *, psi: list, iteration: int, history: list):
    """psi(t) after `iteration` calibration iterations (--calibrate), with psi after each one before it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"psi": psi, "num_steps": len(psi), "iteration": iteration, "history": history}, f)
    os.replace(tmp, path)  # a stopped run never leaves half a file for --psi


def load_psi(path: str, num_steps: int) -> list[float]:
    """psi(t) from a JSON file written by --calibrate ({"psi": [...]}, or a bare list), one value per step."""
    try:
        with open(path) as f:
            psi = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        fail(f"--psi file {path!r} cannot be read as JSON ({type(e).__name__}); write one with --calibrate")
    psi = psi.get("psi") if isinstance(psi, dict) else psi
    if not isinstance(psi, list) or not all(type(p) in (int, float) and 0 <= p <= 10 for p in psi):  # NaN too
        fail(f"--psi {path!r} holds no list of noise levels in [0, 10]; expected {{\"psi\": [one per step]}}")
    if len(psi) != num_steps:
        fail(f"--psi {path!r} has {len(psi)} values; --num-steps {num_steps} needs one per step")
    return [float(p) for p in psi]
