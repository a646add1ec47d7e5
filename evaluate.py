# Evaluation of the base model and trained checkpoints; docs: this docstring
"""Score the base model and any number of checkpoints on the same prompt/seed pairs with any set of metrics:
ODE samples with the pipeline's own schedule, every pair's scores in <out>/scores.json, and a Markdown table
(<out>/table.md, also printed) of each metric's mean +- standard error and each entry's paired change from the
first entry +- its paired standard error. Under torchrun the pairs are split contiguously over the ranks.

Pairs: the first --num-prompts prompts (P of them) times --seeds-per-prompt (N); pair k = 0 .. P N - 1 is
prompt k mod P with noise seed 10^6 (seed + 1) + k, so --seed 0 gives a training run's evaluation pairs
(rundir.Run.evaluate: --eval-num P N pairs of its --eval-prompts, noise seed 10^6 + k) and, in float32,
reproduces its eval_<N>.json exactly at its settings (in bf16 up to rounding: training keeps its trainable
weights in float32, evaluate.py runs a checkpoint as diffusers loads it, in bf16). The defaults are G2RPO's
and MixGRPO's evaluation of FLUX.1-dev: 1024 px, 50 steps, guidance 3.5, 512 T5 tokens. --model toy evaluates
the embedded toy world on a CPU.

G2RPO, Table 1 (400 HPDv2 test prompts, FLUX.1-dev; HPS-v2.1, CLIP, PickScore, ImageReward, UnifiedReward):
    torchrun --nproc_per_node 8 evaluate.py --model flux-dev --checkpoints runs/<g2rpo run> \\
        --prompts data/hpdv2/test.txt --resolution 1024 --steps 50 --guidance 3.5 \\
        --metrics hps clip pickscore imagereward unifiedreward --unifiedreward-url http://127.0.0.1:17140 \\
        --out results/g2rpo_table1

DenseGRPO, DrawBench (its 200 prompts, one per line; SD3.5-M at Flow-GRPO's and DenseGRPO's 512 px, 40
steps, guidance 4.5, 128 tokens; PickScore, aesthetic, ImageReward, UnifiedReward, DeQA-Score from Flow-GRPO's
reward server; docs/rewards.md, GenEval, OCR and DeQA-Score, has the task metrics' commands):
    torchrun --nproc_per_node 8 evaluate.py --model sd3.5-medium --checkpoints runs/<densegrpo run> \\
        --prompts data/drawbench/test.txt --resolution 512 --steps 40 --guidance 4.5 \\
        --max-sequence-length 128 \\
        --metrics pickscore aesthetic imagereward unifiedreward deqa \\
        --unifiedreward-url http://127.0.0.1:17140 \\
        --out results/densegrpo_drawbench

The toy world (base model against a toy run's newest checkpoint, 64 prompts x 4 seeds):
    python evaluate.py --model toy --checkpoints runs/<toy run>"""
import errno
import functools
import gc
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro

from common import (ARG_RANGES, MODEL_ALIASES, RewardModels, as_reference, broadcast_object,
                    check_frame_reduce, check_guidance, check_output_path, check_ranges, check_rewards,
                    close_distributed, decode, drop_text_encoders, encode_prompts, fail, gather_cat,
                    images_hash, latent_shape, load_pipeline, load_prompt_set, load_rewards, loggable,
                    ode_complete, pipeline_sigmas, place, score, select, setup_distributed, velocity)
from rundir import (check_editing, check_model_directory, decimals, hold_run_directory, latest_checkpoint,
                    paired_change, parse_args, read_run_json, safetensors_header, stop_on_write_error,
                    use_checkpoint, weights_fingerprint, write_atomically)
from rundir import read_json as read_bounded_json


@dataclass
class Args:
    model: str = "flux-dev"
    """the base model: a hub id, a local pipeline directory, or an alias: flux-dev, sd3.5-medium, toy"""
    checkpoints: tuple[str, ...] = ()
    """LoRA or transformer directories, checkpoints (<run>/checkpoints/iter_<N>) or runs (their newest)"""
    base: bool = True
    """score the base model first, as the reference entry of the paired changes"""

    # Pairs
    prompts: str = "data/hpdv2/test.txt"
    """evaluation prompts, one per line ('toy': the toy world's held-out prompts)"""
    num_prompts: int | None = None
    """the first N prompts of the file (none given: all)"""
    seeds_per_prompt: int = 1
    """noise seeds per prompt"""
    seed: int = 0
    """pair k's noise seed is 10^6 (seed + 1) + k: 0 gives the training runs' evaluation pairs"""

    # Metrics
    metrics: tuple[str, ...] = ("hps", "clip", "pickscore", "imagereward", "unifiedreward")
    """rewards: hps, clip, pickscore, imagereward, aesthetic, unifiedreward, ocr, geneval, deqa, jpeg, toy;
    editing: image_similarity, editreward (docs/editing.md)"""
    reward_models: tyro.conf.OmitArgPrefixes[RewardModels] = field(default_factory=RewardModels)
    """where each reward model's weights come from"""

    # Sampling (defaults: G2RPO / MixGRPO on FLUX.1-dev; Flow-GRPO / DenseGRPO on SD3.5-M: 512 px, 40 steps,
    # guidance 4.5, 128 tokens)
    steps: int = 50
    """ODE sampling steps of the pipeline's own schedule (the SD3 papers: 40)"""
    guidance: float = 3.5
    """Flux guidance embedding, or SD3 classifier-free guidance with an empty negative prompt (SD3: 4.5)"""
    resolution: int = 1024
    """image height (and width, unless --width) in pixels (the SD3 papers: 512)"""
    width: int | None = None
    """image width in pixels, where it differs from the height"""
    num_frames: int | None = None
    """frames per sample, for models whose samples have them (docs/video.md; none: the model's default)"""
    fps: int = 16
    """frames per second of what a reward receives, where samples have frames"""
    condition_size: int | None = None
    """editing models: each source image resized to this many pixels' area (a side of a square) at its aspect
    ratio; 0: as it is; none: as the model's pipeline resizes it (docs/editing.md)"""
    max_sequence_length: int = 512
    """T5 prompt length in tokens (the SD3 papers: 128)"""
    micro_batch: int = 4
    """latents per model forward and per reward call"""
    kl_to_base: bool = False
    """also each checkpoint's KL to the base model on its own ODE paths (kl_to_base, in nats; see
    docs/evaluation.md): a base forward more per step; a transformer checkpoint holds both on the device"""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """the transformer's and a LoRA's dtype on CUDA, as diffusers loads them; the rewards run in float32"""
    out: str = "runs/evaluation"
    """output directory: scores.json (every pair's score per entry and metric) and table.md (under runs/, with
    the training runs, out of version control)"""
    overwrite: bool = False
    """replace the scores.json and table.md of an earlier evaluation in --out (else they are an error)"""


# --model toy: the toy world's evaluation settings (common.TOY_WORLD). Explicit flags still win.
TOY = {"model": "toy", "mixed_precision": "no", "resolution": 32, "max_sequence_length": 16, "guidance": 3.5,
       "steps": 16, "prompts": "toy", "metrics": ("toy_color_position", "toy_shape_count", "toy_strict"),
       "num_prompts": 64, "seeds_per_prompt": 4, "micro_batch": 48}
# the transformer class of each alias's hub model, for checking a transformer directory without the hub
HUB_TRANSFORMERS = {"black-forest-labs/FLUX.1-dev": "FluxTransformer2DModel",
                    "stabilityai/stable-diffusion-3.5-medium": "SD3Transformer2DModel"}
LORA_FILE = "pytorch_lora_weights.safetensors"
TRANSFORMER_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json")


def read_json(path: str):
    """A JSON file's content (within parse_json's bounds), or None if it is missing or unreadable."""
    try:
        return read_bounded_json(path)
    except (OSError, ValueError):
        return None


def weights_kind(path: str) -> str | None:
    """'lora' (a diffusers LoRA directory), 'transformer' (a diffusers transformer directory) or None."""
    if os.path.isfile(os.path.join(path, LORA_FILE)):
        return "lora"
    has_weights = any(os.path.isfile(os.path.join(path, f)) for f in TRANSFORMER_FILES)
    return "transformer" if has_weights and os.path.isfile(os.path.join(path, "config.json")) else None


def model_identity(model: str) -> str:
    """A model argument as one comparable string: aliases resolved, local directories as their real path."""
    path = MODEL_ALIASES.get(model, model)
    return os.path.realpath(os.path.expanduser(path)) if os.path.isdir(os.path.expanduser(path)) else path


def check_transformer(given: str, weights: str, model: str):
    """A transformer directory must hold the model's transformer class and, for a local model, its
    architecture (every config entry of the model's transformer/config.json)."""
    config = read_json(os.path.join(weights, "config.json"))
    if not isinstance(config, dict) or "_class_name" not in config:
        fail(f"--checkpoints {given!r}: {weights}/config.json is not a diffusers model config")
    path = MODEL_ALIASES.get(model, model)
    index = read_json(os.path.join(path, "model_index.json")) if os.path.isdir(path) else None
    expected = index["transformer"][1] if index and "transformer" in index else HUB_TRANSFORMERS.get(path)
    if expected and config["_class_name"] != expected:
        fail(f"--checkpoints {given!r} holds a {config['_class_name']}, but --model {model!r} has a "
             f"{expected}; evaluate it with the model it was trained from")
    base = read_json(os.path.join(path, "transformer", "config.json")) if index else None
    for key, value in (base or {}).items():
        if not key.startswith("_") and key in config and config[key] != value:
            fail(f"--checkpoints {given!r} has {key}={config[key]}, but --model {model!r}'s transformer has "
                 f"{key}={value}; evaluate it with the model it was trained from")


def check_safetensors(given: str, weights: str):
    """Every .safetensors file of a weights directory whole: its header readable and the file as long as the
    header says (a copy or an export that was cut short would fail only after the base model was scored)."""
    for name in sorted(f for f in os.listdir(weights) if f.endswith(".safetensors")):
        path = os.path.join(weights, name)
        try:
            safetensors_header(path)  # within bounds: a header nested 100,000 deep is no recursion
        except (OSError, ValueError):
            fail(f"--checkpoints {given!r}: {path} is cut short or no safetensors file "
                 f"({os.path.getsize(path):,} bytes); export or copy it again")


def tensor_shapes(weights: str) -> dict:
    """{name: shape} of every tensor in a weights directory's .safetensors files, from their headers."""
    shapes = {}
    for name in sorted(f for f in os.listdir(weights) if f.endswith(".safetensors")):
        shapes.update(safetensors_header(os.path.join(weights, name)))  # (checked by check_safetensors)
    return shapes


def check_fits(entry: dict, transformer, model: str):
    """A LoRA or transformer export must fit the loaded base `transformer` (checked after it loads, before
    anything is scored): every LoRA pair on a linear layer of its size, a transformer's tensors all present
    with the base's shapes. Else one line naming the first misfit."""
    given, shapes = entry["name"], tensor_shapes(entry["path"])
    misfit = None
    if entry["weights"] == "transformer":
        base = {k: tuple(v.shape) for k, v in transformer.state_dict().items()}
        missing, extra = sorted(base.keys() - shapes.keys()), sorted(shapes.keys() - base.keys())
        wrong = [k for k in sorted(base.keys() & shapes.keys()) if base[k] != shapes[k]]
        misfit = (f"{wrong[0]} is {list(shapes[wrong[0]])}, the model's {list(base[wrong[0]])}" if wrong else
                  f"it lacks {missing[0]} ({len(missing)} tensors)" if missing else
                  f"the model has no {extra[0]} ({len(extra)} tensors)" if extra else None)
    for key, shape in shapes.items() if entry["weights"] == "lora" else ():
        module_name, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        if not key.startswith("transformer.") or part not in ("A.weight", "B.weight"):
            continue  # another component's adapter, or a format diffusers converts
        try:
            module = transformer.get_submodule(module_name)
        except AttributeError:
            misfit = f"the model has no layer {module_name}"
            break
        size = getattr(module, "in_features" if part == "A.weight" else "out_features", None)
        if size != shape[1 if part == "A.weight" else 0]:
            what = "inputs" if part == "A.weight" else "outputs"
            misfit = f"{key} is {list(shape)}, for a layer of {size} {what}"
            break
    if misfit:
        fail(f"--checkpoints {given!r} does not fit --model {model!r}: {misfit}; evaluate it with the model "
             f"it was trained from")


def resolve_checkpoint(given: str, model: str) -> dict:
    """{"name", "path", "weights", "iteration"} of one --checkpoints argument: its LoRA or transformer
    directory (a checkpoint's lora/ or transformer/, a run's newest checkpoint's), checked against --model
    before any model loads: the training run's model (run.json next to the weights, when there is one) and a
    transformer's class and architecture."""
    path = os.path.normpath(os.path.expanduser(given))
    if not os.path.exists(path):
        fail(f"--checkpoints {given!r} does not exist; pass a LoRA directory, a transformer directory, a "
             f"checkpoint (runs/<run>/checkpoints/iter_<N>) or a run directory")
    kind = weights_kind(path) if os.path.isdir(path) else None
    if kind is None and os.path.isdir(os.path.join(path, "checkpoints")) and not os.path.isfile(
            os.path.join(path, "run.json")):
        newest = latest_checkpoint(path)
        if newest is None:
            fail(f"--checkpoints {given!r} is a run directory without a complete checkpoint "
                 f"(checkpoints/iter_<N>); wait for its first checkpoint or pass another")
        path = newest
    if kind is None and os.path.isfile(os.path.join(path, "run.json")):
        found = [os.path.join(path, d) for d in ("lora", "transformer")]
        found = [d for d in found if weights_kind(d)]
        if not found:
            fail(f"--checkpoints {given!r}: checkpoint {path!r} has neither a lora/ nor a transformer/ "
                 f"export")
        path = found[0]
        kind = weights_kind(path)
    if kind is None:
        fail(f"--checkpoints {given!r} is neither a LoRA directory ({LORA_FILE}), a transformer directory "
             f"(config.json and {TRANSFORMER_FILES[0]}[.index.json]), a checkpoint (run.json) nor a run "
             f"directory with checkpoints/iter_<N>")
    ckpt = os.path.dirname(path)
    in_checkpoint = os.path.isfile(os.path.join(ckpt, "run.json"))
    if in_checkpoint and not use_checkpoint(ckpt):  # held from here on: a live run's pruning leaves it alone
        fail(f"--checkpoints {given!r}: checkpoint {ckpt!r} was removed as it was opened (a live run's "
             f"--keep-checkpoints); pass it again")
    run = read_run_json(ckpt, need={"iteration": int, "args": dict}, args=("model",)) if in_checkpoint \
        else None
    trained = run["args"].get("model") if run else None
    if trained is not None and model_identity(trained) != model_identity(model):
        fail(f"--checkpoints {given!r} was trained with --model {trained!r} (its run.json), not {model!r}; "
             f"pass --model {trained}")
    if kind == "transformer":
        check_transformer(given, path, model)
    check_safetensors(given, path)
    return {"name": given, "path": path, "weights": kind, "iteration": run["iteration"] if run else None,
            "base_weights": run.get("base_weights") if run else None}


def check_args(args) -> tuple[list[dict], list[tuple[str, int]]]:
    """Every check that needs no model: the entries to score ({"name", "path", "weights", "iteration"}) and
    the pairs (prompt, noise seed), or a one-line error."""
    check_ranges(args, ARG_RANGES)
    check_ranges(args.reward_models, ARG_RANGES)
    check_frame_reduce(args.reward_models.frame_reduce)
    if not args.base and not args.checkpoints:
        fail("nothing to evaluate: pass --checkpoints, or keep --base")
    if os.path.isfile(args.out):
        fail(f"--out {args.out!r} is a file; pass a directory (scores.json and table.md go there)")
    check_output_path(args.out, flag="--out", directory=True)
    if not args.overwrite and os.path.exists(os.path.join(args.out, "scores.json")):
        fail(f"--out {args.out!r} holds an earlier evaluation's scores.json; pass another --out, or "
             f"--overwrite to replace it")
    check_rewards(args.metrics, args.reward_models)
    if len(set(args.metrics)) < len(args.metrics):
        fail(f"--metrics {' '.join(args.metrics)} names a metric twice; name each once")
    prompts = load_prompt_set(args.prompts, split="test", rewards=args.metrics)
    if args.num_prompts is not None:
        if args.num_prompts > len(prompts):
            fail(f"--num-prompts {args.num_prompts} is more than the {len(prompts)} prompts of "
                 f"{args.prompts!r}; pass fewer, or none for all")
        prompts = prompts[:args.num_prompts]
    num_pairs = len(prompts) * args.seeds_per_prompt
    pairs = [(prompts[k % len(prompts)], 10**6 * (args.seed + 1) + k) for k in range(num_pairs)]
    base = [{"name": "base", "path": args.model, "weights": "base", "iteration": None}] if args.base else []
    return base + [resolve_checkpoint(c, args.model) for c in args.checkpoints], pairs


def reserve_space(out: str, *, entries: int, metrics: int, pairs: list):
    """Room on the disk for scores.json and table.md, taken before any work (<out>/scores.json.reserved, which
    the end frees to write them): a full disk fails here, in one line, not after everything was scored."""
    prompts = sum(len(p) + 30 for p, _ in pairs)  # settings: every pair's prompt and noise seed
    need = 2 * (prompts + entries * (metrics + 16) * len(pairs) * 24) + (1 << 16)  # 16: GenEval's per tag
    with stop_on_write_error(out), open(os.path.join(out, "scores.json.reserved"), "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, need)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                fail(f"--out {out!r} has no room for the {need:,} bytes of scores.json and table.md (No "
                     f"space left on device); free space or pass another --out")


@torch.no_grad()
def ode_and_kl(transformer, base, *, kind: str, x, sigmas, emb: dict, guidance: float, micro_batch: int):
    """ode_complete's Euler ODE along the whole schedule (the same steps, the same micro-batches), and each
    path's KL to the base model (`base()`: a context giving it): 1/2 sum_k |sigma_k+1 - sigma_k| ||v(x_k) -
    v_base(x_k)||^2, summed over the latent, at the path's own points x_k. Girsanov: the KL between the path
    measures of dx = v dsigma + dW under the two models; 0 for the base itself, ||c||^2 / 2 for a velocity
    that differs by a constant c (the schedule runs from sigma 1 to 0)."""
    x, kl = x.float().clone(), torch.zeros(len(x), dtype=torch.float64, device=x.device)  # (x is not changed)
    for k in range(len(sigmas) - 1):
        ds = (sigmas[k + 1] - sigmas[k]).to(x.device)
        for c in torch.arange(len(x)).split(micro_batch):
            e, s = select(emb, c.to(x.device)), sigmas[k:k + 1].expand(len(c))
            v = velocity(transformer, kind, x[c], s, e, guidance=guidance).float()
            with base() as reference:
                v_base = velocity(reference, kind, x[c], s, e, guidance=guidance)
            kl[c] += 0.5 * ds.abs().double() * (v - v_base.float()).double().square().flatten(1).sum(1)
            x[c] = x[c] + v * ds
    return x, kl


@torch.no_grad()
def score_pairs(transformer, *, pipe, kind: str, emb: dict, noise, prompts: list[str], rewards: dict, sigmas,
                guidance: float, micro_batch: int, num_pairs: int, device, base=None) -> dict:
    """This rank's pairs (embeddings `emb`, `noise`, `prompts`) sampled by the ODE along the whole schedule,
    decoded and scored micro-batch by micro-batch: {metric: every pair's score in pair order}, on every
    rank; with `base` (ode_and_kl's) also kl_to_base."""
    paths = [list(range(len(sigmas)))] * len(noise)
    if base is None:
        x0 = ode_complete(transformer, kind, noise.to(device), paths, sigmas, emb, guidance=guidance,
                          micro_batch=micro_batch)
    else:
        x0, kl = ode_and_kl(transformer, base, kind=kind, x=noise.to(device), sigmas=sigmas, emb=emb,
                            guidance=guidance, micro_batch=micro_batch)
    parts = [score(rewards, decode(pipe, x0[c]), [prompts[i] for i in c.tolist()], evaluation=True)
             for c in torch.arange(len(x0)).split(micro_batch)]
    local = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if base is not None:
        local["kl_to_base"] = kl.float()
    return {k: gather_cat(v.to(device)).cpu()[:num_pairs] for k, v in local.items()}


def mean_se(values: list) -> str:
    """'mean +- standard error', with the mean rounded to the standard error's second significant digit."""
    t = torch.tensor(values, dtype=torch.float64)
    se = float(t.std() / math.sqrt(len(t))) if len(t) > 1 else math.nan
    return f"{float(t.mean()):.{decimals(se)}f} +- {se:.{decimals(se)}f}"


def table(args, entries: list[dict], scores: list[dict], *, num_prompts: int, kind: str) -> str:
    """The Markdown report: per entry and metric the mean +- SE over the pairs, and the paired change from the
    first entry +- its paired SE on the same pairs."""
    pairs = len(next(iter(scores[0].values())))
    first = entries[0]["name"]
    head = (f"## {args.model} ({kind}): {num_prompts} prompts x {args.seeds_per_prompt} seed(s) = {pairs} "
            f"pairs of {args.prompts}\n\nODE with the pipeline's schedule: {args.steps} steps, guidance "
            f"{args.guidance}, {args.resolution}{f' x {args.width}' * bool(args.width)} px, "
            f"{args.max_sequence_length} tokens, seed {args.seed}. "
            f"Each metric: mean +- standard error over the pairs; change: the paired difference from {first} "
            f"on the same pairs +- its paired standard error.\n")
    metrics = list(scores[0])  # --metrics, and GenEval's accuracies (per tag)
    columns = ["entry", "iteration"] + [c for m in metrics for c in (m, f"{m} change")]
    lines = [head, "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for i, (entry, s) in enumerate(zip(entries, scores)):
        cells = []
        for m in metrics:
            d, se = paired_change(scores[0][m], s[m]) if i else (math.nan, math.nan)
            change = f"{d:+.{decimals(se)}f} +- {se:.{decimals(se)}f}" if i else "(reference)"
            cells += [mean_se(s[m]), change]
        iteration = "-" if entry["iteration"] is None else entry["iteration"]
        lines.append(f"| {entry['name']} | {iteration} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    args = parse_args(Args, toy=TOY, description=__doc__)
    rank, world, device = setup_distributed()
    entries, pairs = check_args(args)
    check_model_directory(args.model)
    if rank == 0:  # --out is this evaluation's until it ends; what it will write has its room on the disk
        with stop_on_write_error(args.out):
            os.makedirs(args.out, exist_ok=True)
        taken = hold_run_directory(args.out, what="--out", why="two evaluations into one --out would replace "
                                                              "each other's scores.json")
        if taken or (not args.overwrite and os.path.exists(os.path.join(args.out, "scores.json"))):
            fail(taken or f"--out {args.out!r} holds an earlier evaluation's scores.json (written "
                          f"meanwhile); pass another --out, or --overwrite to replace it")
        reserve_space(args.out, entries=len(entries), metrics=len(args.metrics), pairs=pairs)
    entries = broadcast_object(entries)  # rank 0's newest checkpoint of a run that is still training

    use_bf16 = args.mixed_precision == "bf16" and device.type == "cuda"
    compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    # the metrics first: a reward file that cannot be read fails before the large model loads
    rewards = load_rewards(args.metrics, device, models=args.reward_models, dtype=torch.float32,
                           fps=args.fps)
    pipe, kind = load_pipeline(args.model, "cpu", dtype=compute_dtype)  # the text encoders first, alone
    check_guidance(pipe, kind, args.guidance)
    check_editing(pipe, kind, [p for p, _ in pairs], condition_size=args.condition_size)
    base = pipe.transformer
    base_weights = weights_fingerprint(base)
    for entry in entries:  # before anything is scored
        if entry["weights"] != "base":
            check_fits(entry, base, args.model)
        if entry.get("base_weights") not in (None, base_weights) and rank == 0:  # LoRA transfer can be meant
            print(f"warning: --checkpoints {entry['name']!r} was trained from other weights of this "
                  f"architecture than --model {args.model!r} holds (base fingerprint "
                  f"{entry['base_weights']}, here {base_weights}): it is scored on this model as it is",
                  file=sys.stderr, flush=True)
    shape = latent_shape(pipe, kind, args.resolution, width=args.width, frames=args.num_frames)
    sigmas = pipeline_sigmas(pipe, kind, num_steps=args.steps, shape=shape)

    # this rank's contiguous share of the pairs, padded with the last pair to equal shares
    share = -(-len(pairs) // world)
    mine = [pairs[min(k, len(pairs) - 1)] for k in range(rank * share, (rank + 1) * share)]
    prompts = [p for p, _ in mine]
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for _, s in mine])
    emb = encode_prompts(pipe, kind, prompts, max_sequence_length=args.max_sequence_length, cfg=args.guidance,
                         device=device)
    drop_text_encoders(pipe)  # every prompt is encoded: no text encoder is kept (FLUX.2 [dev]'s: 23B)
    place(pipe, device)

    all_scores = []
    for entry in entries:
        transformer, reference = base, None
        if entry["weights"] == "lora":
            pipe.load_lora_weights(entry["path"])
            reference = functools.partial(as_reference, base)  # the adapters off
        elif entry["weights"] == "transformer":
            if not args.kl_to_base:
                base.to("cpu")  # one transformer on the device at a time
            transformer = type(base).from_pretrained(entry["path"], dtype=compute_dtype)
            transformer = transformer.requires_grad_(False).eval().to(device)
            reference = functools.partial(as_reference, transformer, base)
        all_scores.append(score_pairs(
            transformer, pipe=pipe, kind=kind, emb=emb, noise=noise, prompts=prompts, rewards=rewards,
            sigmas=sigmas, guidance=args.guidance, micro_batch=args.micro_batch, num_pairs=len(pairs),
            device=device, base=reference if args.kl_to_base else None))
        if args.kl_to_base and entry["weights"] == "base":
            all_scores[-1]["kl_to_base"] = torch.zeros(len(pairs))  # the base model to itself
        for fn in rewards.values():
            if hasattr(fn, "breakdown"):  # GenEval's accuracies per tag
                all_scores[-1].update(fn.breakdown(all_scores[-1], [p for p, _ in pairs]))
        if entry["weights"] == "lora":
            pipe.unload_lora_weights()
        elif entry["weights"] == "transformer":
            del transformer
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            base.to(device)  # (where --kl-to-base kept it there: nothing to do)
        if rank == 0:
            means = ", ".join(f"{k} {v.mean():.4f}" for k, v in all_scores[-1].items())
            print(f"{entry['name']}: {means}", flush=True)

    if rank == 0:
        num_prompts = len(pairs) // args.seeds_per_prompt
        report = table(args, entries, [{k: v.tolist() for k, v in s.items()} for s in all_scores],
                       num_prompts=num_prompts, kind=kind)
        settings = {k: v for k, v in loggable(args).items() if k not in ("checkpoints", "out")}
        settings.update(kind=kind, world=world, num_pairs=len(pairs), pair_prompts=[p for p, _ in pairs],
                        pair_noise_seeds=[s for _, s in pairs])
        if any(getattr(p, "images", ()) for p, _ in pairs):  # editing: each pair's sources (paths or hashes)
            settings["pair_sources"] = [[i if isinstance(i, str) else images_hash((i,)) for i in p.images]
                                        for p, _ in pairs]
        scored = [{**e, "scores": {k: v.tolist() for k, v in s.items()}} for e, s in zip(entries, all_scores)]
        print("\n" + report, flush=True)  # first: a disk that filled meanwhile cannot take the table too
        os.remove(os.path.join(args.out, "scores.json.reserved"))  # the room reserved at the start
        with stop_on_write_error(args.out):
            write_atomically(os.path.join(args.out, "scores.json"),
                             json.dumps({"settings": settings, "entries": scored}, indent=1))
            write_atomically(os.path.join(args.out, "table.md"), report)
        print(f"scores.json and table.md in {os.path.abspath(args.out)}")
    close_distributed()
