"""What every algorithm file does around its algorithm: the setup before the first iteration, the bookkeeping
after each, and the run directory (runs/<run_name>) it writes and reads back. Plain functions, and one object
for the state a run carries, in the order of a run.

0. The run: parse_args (the command line: the TOY preset, or a resumed checkpoint's arguments, as defaults),
   start_run (the setup, one call), Run (iterations, the optimizer and EMA steps, evaluation, the end of an
   iteration, the end of the run), Stats (an iteration's training statistics)
1. The run directory and its logs: run_directory, make_writer (TensorBoard, wandb), read_jsonl, log_metrics;
   files from outside read within bounds: read_json, safetensors_header
2. Checkpoints: iteration_of, latest_checkpoint, read_run_json, resume_checkpoint, save_state (atomic;
   diffusers exports), load_state
3. Sample grids and the end-of-run summary: image_grid, save_eval_grid, paired_change, run_summary
4. DenseGRPO's psi(t) file (--calibrate writes it, --psi reads it): psi_path, save_psi, load_psi
5. The text cache (--text-cache): fill_text_cache, read_text_cache

Only the algorithm files, evaluate.py and the scripts import it; it imports common.py (never the other way).
"""
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import textwrap
import threading
import time
import types
import typing

import numpy as np
import torch
import torch.distributed as dist

from common import (FAMILIES, JSON_DEPTH, MODEL_ALIASES, NFE, SECRETS, TEXT_ENCODERS,
                    broadcast_object, check_guidance, close_distributed, decode, drop_text_encoders,
                    ema_update, encode_prompts, fail, family_of, gather_cat, gathered, is_main_rank,
                    latent_shape, load_pipeline, load_prompt_set, load_rewards, loggable, make_trainable,
                    max_over_ranks, ode_complete, optimizer_step, parse_json, pipeline_sigmas, prompt_key,
                    score, seed_everything, setup_distributed, shown, sum_over_ranks, swapped_in)


# ======== 0. The run ========
def flag_values(argv: list, flag: str) -> list:
    """The values given to `flag` on a command line, as `--flag value` or `--flag=value`."""
    return [b for a, b in zip(argv, argv[1:]) if a == flag] + [a[len(flag) + 1:] for a in argv
                                                              if a.startswith(flag + "=")]


def checkpoint_arguments(path: str) -> dict | None:
    """The arguments run.json records in the newest checkpoint of a run directory (or of a checkpoint
    directory), or None where there is none that reads (resume_checkpoint then says why)."""
    root = os.path.join(path, "checkpoints")
    names = [n for n in (os.listdir(root) if os.path.isdir(root) else []) if not n.endswith(".tmp")
             and n.startswith("iter_") and n[len("iter_"):].isdigit()]
    newest = os.path.join(root, max(names, key=lambda n: int(n[len("iter_"):]))) if names else path
    try:
        with open(os.path.join(newest, "run.json"), "rb") as f:
            saved = parse_json(f.read((1 << 20) + 1))
    except (OSError, ValueError):
        return None
    return saved.get("args") if isinstance(saved, dict) and isinstance(saved.get("args"), dict) else None


def arguments_from(args_class, saved: dict):
    """An Args of `args_class` holding the values of a checkpoint's run.json (tuples from its lists, the
    reward models' fields, secrets left out: <hidden> in the file); fields it lacks keep their defaults."""
    base, values, hints = args_class(), {}, typing.get_type_hints(args_class)
    for f in dataclasses.fields(args_class):
        if f.name not in saved or f.name == "resume":
            continue
        default, value = getattr(base, f.name), saved[f.name]
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            inner = typing.get_type_hints(type(default))
            value = {k: typed(k, inner[k], v) for k, v in value.items() if k in inner and k not in SECRETS}
            values[f.name] = dataclasses.replace(default, **value)
        else:
            values[f.name] = typed(f.name, hints[f.name], value)
    return dataclasses.replace(base, **values)


def fits(value, hint) -> bool:
    """Whether a value read from JSON is one of the type annotation `hint` (a list for a tuple, an integer
    for a float); annotations it does not know accept any value."""
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, m) for m in members)
    if origin is typing.Literal:
        return any(type(value) is type(m) and value == m for m in members)
    if origin is tuple:
        items = [members[0]] * len(value) if members[1:] == (Ellipsis,) else members
        return isinstance(value, (list, tuple)) and len(items) == len(value) and all(map(fits, value, items))
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) in (int, float)
    return type(value) is hint if isinstance(hint, type) and origin is None else True


def typed(name: str, hint, value):
    """A value of a checkpoint's run.json for the argument annotated `hint`, of that type (a tuple for a
    list: every list an Args holds is a tuple; a float for an integer), else a one-line error."""
    value = tuple(value) if isinstance(value, list) else value
    if not fits(value, hint):
        fail(f"the checkpoint's run.json has --{name.replace('_', '-')} {shown(value)}, not the "
             f"{type_name(hint)} it takes; resume from another checkpoint, or give the flag")
    return coerced(value, hint)


def coerced(value, hint):
    """`value`, which fits `hint`, as that type: a float where an integer was written for one."""
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return value if type(value) in members else coerced(value, next(m for m in members if fits(value, m)))
    if origin is tuple:
        items = [members[0]] * len(value) if members[1:] == (Ellipsis,) else members
        return tuple(map(coerced, value, items))
    return float(value) if hint is float else value


def type_name(hint) -> str:
    """How an error names the type annotation `hint`: int, tuple, int or 't'."""
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin in (typing.Union, types.UnionType, typing.Literal):
        return " or ".join(repr(m) if origin is typing.Literal else type_name(m) for m in members)
    return getattr(origin or hint, "__name__", str(hint))


TOY_VIDEO_WORLD = dict(  # the moving-shapes world (toy/video_world.py) on top of a file's TOY preset
    model="toy-video", guidance=1.0, prompts="toy-video", eval_prompts="toy-video",  # no CFG: samples better
    rewards=("toy_frame", "toy_motion"), eval_rewards=("toy_frame_first", "toy_frame_mean", "toy_consistency",
                                                       "toy_video_strict"),
    num_frames=9, fps=8,
    metrics=("toy_frame_first", "toy_frame_mean", "toy_motion", "toy_consistency", "toy_video_strict"))


TOY_EDIT_WORLD = dict(  # the editing world (toy/edit_world.py) on top of a file's TOY preset
    model="toy-edit", prompts="toy-edit", eval_prompts="toy-edit", rewards=("toy_edit", "toy_preserve"),
    eval_rewards=("toy_edit_strict",), condition_size=0,
    metrics=("toy_edit", "toy_preserve", "toy_edit_strict"))
TOY_WORLDS = {"video": TOY_VIDEO_WORLD, "edit": TOY_EDIT_WORLD}


def toy_world_of(model: str | None) -> str | None:
    """"image", "video" or "edit" for a toy pipeline (by its alias, or by the toy_world.json its directory
    holds wherever it was copied: toy/make_toy.py, make_video_toy.py, make_edit_toy.py), else None."""
    if model in ("toy", "toy-video", "toy-edit"):
        return {"toy": "image", "toy-video": "video", "toy-edit": "edit"}[model]
    marker = os.path.join(model or "", "toy_world.json")
    if not model or not os.path.isfile(marker):
        return None
    try:
        with open(marker, "rb") as f:
            about = parse_json(f.read((1 << 16) + 1), limit=1 << 16)
    except (OSError, ValueError):
        return "image"
    world = about.get("world") if isinstance(about, dict) else None
    return world if world in TOY_WORLDS else "image"


def parse_args(args_class, *, toy: dict, description: str):
    """The command line parsed by tyro. With --model toy the TOY preset gives the defaults, and with --resume
    DIR the arguments its checkpoint recorded, so flags passed explicitly still win (resume_checkpoint says
    which) and --help shows those defaults; `--help | head` exits quietly."""
    import tyro
    argv = sys.argv[1:]
    given, resume = flag_values(argv, "--model"), flag_values(argv, "--resume")
    # the toy pipeline, by its alias or by its toy_world.json wherever it was copied (toy/make_toy.py,
    # toy/make_video_toy.py: the moving-shapes world, rundir.TOY_VIDEO_WORLD over the file's preset)
    world = toy_world_of(given[-1] if given else None)
    wants_toy = world is not None
    saved = checkpoint_arguments(resume[-1]) if resume else None
    fields = {f.name for f in dataclasses.fields(args_class)}
    preset = {**toy, **{k: v for k, v in TOY_WORLDS.get(world, {}).items() if k in fields}}
    default = dataclasses.replace(args_class(), **preset) if wants_toy else args_class()
    if saved is not None:
        default = arguments_from(args_class, saved)
        description += " (--resume: the defaults below are the arguments its checkpoint recorded)"
    elif wants_toy:
        alias, where = {"video": ("toy-video", " in the moving-shapes world"),
                        "edit": ("toy-edit", " in the editing world")}.get(world, ("toy", ""))
        description += f" (--model {alias}: the defaults below are the file's TOY preset{where})"
    try:
        args = tyro.cli(args_class, default=default, description=description)
        for i, a in enumerate(sys.argv):  # a secret never stays in sys.argv, which wandb uploads
            if a.startswith("--unifiedreward-api-key") and a != "--unifiedreward-api-key":
                sys.argv[i] = "--unifiedreward-api-key=<hidden>"
            elif i and sys.argv[i - 1] == "--unifiedreward-api-key":
                sys.argv[i] = "<hidden>"
        return args
    except SystemExit:
        with contextlib.suppress(BrokenPipeError):
            sys.stdout.flush()
        raise
    except BrokenPipeError:  # --help piped into a program that stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


def say(message: str):
    """A line on rank 0's terminal that does not break a progress bar."""
    if is_main_rank():
        from tqdm import tqdm
        tqdm.write(message)


def progress_bar(*, inner: bool = False, **kwargs):
    """A tqdm bar on rank 0 (none elsewhere); an `inner` bar (below the training bar) only on a terminal."""
    from tqdm import tqdm
    hidden = not is_main_rank() or (inner and not sys.stderr.isatty())
    return tqdm(disable=hidden, dynamic_ncols=True, leave=not inner, **kwargs)


def start_run(args, *, script: str, check_args, planned_nfe, reference: bool, copies: tuple = ()) -> "Run":
    """Everything before the first iteration, the same in every algorithm file: the process group, the checks
    of the arguments (`check_args(args, world)`), the checkpoint to resume, the prompts, the run directory and
    its logs, the seeds, the rewards, the pipeline and its trainable weights (LoRA, or all of them: FSDP2
    across ranks), a frozen `reference`, AdamW, the evaluation EMA and named `copies` of the trainable weights
    (an old policy, a KL-EMA), each restored from the checkpoint when resuming. `planned_nfe(args)["rollout"]`
    is logged as perf/nfe_min_per_prompt."""
    rank, world, device = setup_distributed()
    check_args(args, world)
    choose_threads(device, requested=args.threads)
    catch_signals()  # Ctrl-C (SIGINT) and SIGTERM: at once until the first iteration, then after an iteration
    ckpt, start = None, 0
    if args.resume:
        ckpt, start = resume_checkpoint(args.resume, args=args, world=world, script=os.path.basename(script))
    # the prompts, the model directory and the text cache before the run directory: nothing left behind
    train_prompts = load_prompt_set(args.prompts, split="train", rewards=args.rewards)
    eval_prompts = load_prompt_set(args.eval_prompts, split="test", rewards=args.rewards + args.eval_rewards)
    check_model_directory(args.model)
    if args.text_cache:
        check_text_cache(args.text_cache)
    run_dir, writer = run_directory(args, checkpoint=ckpt), None
    STOP["run_dir"] = run_dir
    try:  # a failed start of a new run leaves no run directory behind (discard_new_run)
        with stop_on_write_error(run_dir):
            writer = make_writer(run_dir, args, resume_iteration=start if ckpt else None) if rank == 0 \
                else None
        seed_everything(args.seed, deterministic=args.torch_deterministic)
        use_bf16 = args.mixed_precision == "bf16" and device.type == "cuda"
        compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
        # the rewards first: a reward file that cannot be read fails before the large model loads
        say(f"loading the rewards ({', '.join(dict.fromkeys(args.rewards + args.eval_rewards))}) and the "
            f"model {args.model}")
        eval_fns = load_rewards(args.rewards + args.eval_rewards, device, models=args.reward_models,
                                dtype=compute_dtype, fps=args.fps)
        sharded = args.full_finetune and world > 1  # FSDP2; LoRA runs average their gradients (DDP style)
        # on the CPU first: for the text cache's encoders, and for FSDP2, which moves each block's shards to
        # the GPU as it shards it (the whole model, and a reference copy, never sit on one GPU)
        on_cpu = bool(args.text_cache) or sharded
        pipe, kind = load_pipeline(args.model, "cpu" if on_cpu else device, dtype=compute_dtype)
        check_guidance(pipe, kind, args.guidance)
        check_editing(pipe, kind, train_prompts, eval_prompts, condition_size=args.condition_size)
        base_weights = weights_fingerprint(pipe.transformer)  # what a checkpoint was trained from
        trained_on = read_run_json(ckpt).get("base_weights") if ckpt else None
        if trained_on and trained_on != base_weights:  # (older checkpoints have none)
            fail(f"checkpoint {ckpt!r} was trained from other weights than --model {args.model!r} holds "
                 f"now (same architecture; base fingerprint {trained_on}, now {base_weights}); resume with "
                 f"its model")
        if args.text_cache:  # each prompt encoded once, the text encoders alone on the device, then dropped
            fill_text_cache(pipe, kind, train_prompts + eval_prompts[:args.eval_num],
                            directory=args.text_cache, device=device,
                            max_sequence_length=args.max_sequence_length, cfg=args.guidance)
        shape = latent_shape(pipe, kind, args.resolution, width=args.width, frames=args.num_frames)
        lora = None if args.full_finetune else (args.lora_rank, args.lora_alpha)
        params, ref_model = make_trainable(pipe.transformer, kind, lora=lora, reference=reference,
                                           sharded=sharded, compute_dtype=compute_dtype,
                                           checkpointing=args.gradient_checkpointing)
        if on_cpu:  # the rest of what load_pipeline left on the CPU (the parameters stay the same objects)
            for module in [pipe.vae] + ([] if sharded else [pipe.transformer]):
                module.to(device)
        optimizer = torch.optim.AdamW(params.values(), lr=args.learning_rate, betas=(0.9, 0.999),
                                      weight_decay=args.weight_decay, eps=1e-8)
        ema = [p.detach().float().clone() for p in params.values()] if args.ema else None
        copies = {name: [p.detach().clone() for p in params.values()] for name in copies}
        # bf16 autocast only for unsharded full fine-tuning: LoRA and FSDP2 already compute in bf16
        use_autocast = use_bf16 and args.full_finetune and not sharded
        amp = torch.autocast(device.type, dtype=compute_dtype, enabled=use_autocast, cache_enabled=False)
        weights = dict(zip(args.rewards, args.reward_weights or [1.0] * len(args.rewards)))
        run = Run(args=args, rank=rank, world=world, device=device, sharded=sharded, run_dir=run_dir,
                  writer=writer, pipe=pipe, kind=kind, transformer=pipe.transformer, params=params,
                  optimizer=optimizer, ema=ema, ref_model=ref_model, copies=copies, amp=amp, shape=shape,
                  weights=weights, reward_fns={k: eval_fns[k] for k in args.rewards}, eval_fns=eval_fns,
                  train_prompts=train_prompts, eval_prompts=eval_prompts, start=start,
                  planned_rollout=planned_nfe(args)["rollout"], script=os.path.basename(script),
                  base_weights=base_weights)
        if ckpt:
            say(f"resuming {ckpt}")
            load_state(ckpt, run=run)
        return run
    except BaseException:
        discard_new_run(run_dir, writer=writer, resumed=ckpt is not None)
        raise


def check_editing(pipe, kind: str, *prompt_sets, condition_size: int | None):
    """Editing prompts (with source images) for an editing model only; the condition size the family's encode
    reads (pipe.condition_size). The sources of each set must enter the VAE at one size (a batch's are encoded
    together; the family's "editing" gives the size): checked now, from the images' headers, not when a batch
    that mixes them is first encoded, hours into a run."""
    from PIL import Image
    pipe.condition_size = condition_size
    resized = FAMILIES[kind].get("editing")

    @functools.lru_cache(maxsize=None)
    def read(path):  # (height, width), from the header
        with Image.open(path) as image:
            return image.height, image.width

    at_vae = functools.lru_cache(maxsize=None)(lambda height, width: resized(pipe, height, width))
    for prompts in prompt_sets:
        edits = [p for p in prompts if getattr(p, "images", ())]
        if edits and not resized:
            editors = [c for f in FAMILIES.values() if f.get("editing") for c in f["pipelines"]]
            fail(f"the prompt set has source images (an editing set), and this {type(pipe).__name__} "
                 f"generates from text alone; pass an editing model ({', '.join(editors)}) or a prompt set "
                 f"without images")
        first = {}  # the first prompt whose sources enter the VAE at each size
        for p in edits:
            sizes = []
            for image in p.images:
                try:
                    height, width = read(image) if isinstance(image, str) else map(int, image.shape[-2:])
                    sizes.append(at_vae(height, width))
                except SystemExit as e:  # smaller than the model's multiple
                    fail(f"the source image {shown_source(image)} of {str(p)[:40]!r}: "
                         f"{str(e)[len('error: '):]}")
            first.setdefault(tuple(sizes), p)
            if len(first) > 1:
                (a, pa), (b, pb) = first.items()
                hw = lambda sizes: " + ".join(f"{h}x{w}" for h, w in sizes)  # noqa: E731
                fail(f"the sources of {str(pa)[:40]!r} ({', '.join(map(shown_source, pa.images))}) and of "
                     f"{str(pb)[:40]!r} ({', '.join(map(shown_source, pb.images))}) enter the VAE at {hw(a)} "
                     f"and {hw(b)} pixels (height x width); a batch's sources are encoded together: pass "
                     f"--condition-size S (each source resized to S x S pixels' area) with sources of one "
                     f"aspect ratio, or resize them alike first")


def shown_source(image) -> str:
    """A source image as an error names it: its file's name, or its size where it has no file."""
    if isinstance(image, str):
        return repr(os.path.basename(image))
    return "<{}x{} pixels>".format(*image.shape[-2:])


def check_model_directory(model: str):
    """A local pipeline directory (or alias) checked before anything large is built, from its JSON files and
    safetensors headers alone: each component's config.json of the class that model_index.json names (of a
    transformers component: its model type), each diffusers component's weights exactly the tensors its config
    builds (on the meta device: no memory), rotary axes that add up to the attention head size; else one line.
    A hub id loads as diffusers loads it."""
    path = MODEL_ALIASES.get(model, model)
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        return
    try:
        index = read_json(os.path.join(path, "model_index.json"))
        parts = {k: v for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[0] in
                 ("diffusers", "transformers") and os.path.isfile(os.path.join(path, k, "config.json"))}
        configs = {k: read_json(os.path.join(path, k, "config.json")) for k in parts}
        if not all(isinstance(c, dict) for c in configs.values()):
            raise ValueError("a config.json holds no JSON object")
    except (OSError, ValueError, AttributeError) as e:
        fail(f"--model {model!r}: its model_index.json or a config.json cannot be read "
             f"({escaped(e)})")
    for name, (library, cls_name) in parts.items():
        config, misfit = configs[name], None
        if library == "transformers":
            import transformers
            config_class = getattr(getattr(transformers, cls_name, None), "config_class", None)
            wanted = getattr(config_class, "model_type", None)
            if wanted and config.get("model_type") != wanted:
                misfit = (f"its config.json is a {shown(config.get('model_type'))} model, not a {cls_name} "
                          f"({wanted!r})")
        else:
            misfit = diffusers_misfit(os.path.join(path, name), cls_name, config)
        if misfit:
            fail(f"--model {model!r}: {name}/ is not what model_index.json and its config say: {misfit}")


def diffusers_misfit(folder: str, cls_name: str, config: dict) -> str | None:
    """What does not fit between a diffusers component's class, config.json and safetensors weights."""
    import diffusers
    if config.get("_class_name", cls_name) != cls_name:
        return f"its config.json is a {shown(config.get('_class_name'))}, model_index.json names a {cls_name}"
    axes = config.get("axes_dims_rope") or config.get("axes_dims")
    head = config.get("attention_head_dim")
    if head is None and type(config.get("dim")) is int and type(config.get("n_heads")) is int:
        head = config["dim"] // max(config["n_heads"], 1)  # Z-Image
    if isinstance(axes, list) and all(type(a) is int for a in axes) and type(head) is int and \
            sum(axes) != head:
        return f"its rotary axes {axes} add up to {sum(axes)}, not the attention head size {head}"
    index = os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")
    try:
        files = sorted(set(read_json(index, limit=1 << 26)["weight_map"].values())) \
            if os.path.isfile(index) else ["diffusion_pytorch_model.safetensors"]
        found = {}
        for f in (os.path.join(folder, os.path.basename(f)) for f in files):
            found.update(safetensors_header(f) if os.path.isfile(f) else {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its weights cannot be read ({escaped(e)})"
    if not found or not hasattr(diffusers, cls_name):  # (.bin weights, a class of another library: as loaded)
        return None
    cls = getattr(diffusers, cls_name)
    try:
        with torch.device("meta"):
            built = {k: tuple(v.shape) for k, v in cls.from_config(config).state_dict().items()}
    except Exception as e:  # a config no model can be built from
        return f"its config.json builds no {cls_name} ({type(e).__name__}: {escaped(e)})"
    ignored = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])]
    missing = sorted(built.keys() - found.keys())
    unexpected = sorted(k for k in found.keys() - built.keys() if not any(p.search(k) for p in ignored))
    wrong = [k for k in sorted(built.keys() & found.keys()) if built[k] != found[k]]
    if missing or unexpected:
        return (f"its config builds {len(built)} tensors, its weights hold {len(found)} ({len(missing)} "
                f"missing, e.g. {first(missing)}; {len(unexpected)} others, e.g. "
                f"{first(unexpected)})")
    if wrong:
        return (f"its weights hold {wrong[0]} of shape {list(found[wrong[0]])}, its config builds "
                f"{list(built[wrong[0]])}")
    return None


def choose_threads(device, *, requested: int | None):
    """On a CPU, torch's threads per process: --threads, else $OMP_NUM_THREADS (torchrun sets 1), else one per
    core that other work leaves free (the 1-minute load average), at least 1, said in one line when fewer than
    the cores: threads that wait on a busy core cost up to 10x the CPU time (docs/contributing.md)."""
    if device.type != "cpu":
        return
    if requested:
        torch.set_num_threads(requested)
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = max(1, min(torch.get_num_threads(), int(cores - load + 0.5)))
    if free < torch.get_num_threads():
        torch.set_num_threads(free)
        say(f"the CPU is busy (load {load:.1f} on {cores} cores): {free} torch thread{'s' * (free > 1)} per "
            f"process (--threads N or OMP_NUM_THREADS=N to choose)")


STOP = {"signal": None, "iterating": False, "run_dir": None, "bar": None, "handlers": {}}  # catch_signals


def catch_signals():
    """SIGINT (Ctrl-C) and SIGTERM: before the first iteration the run stops at once (a new run's directory
    removed); during an iteration it finishes the iteration, saves it and stops (Run.iterations); a second
    signal stops at once, the last complete checkpoint intact. Main thread only (a no-op elsewhere)."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    STOP.update(signal=None, iterating=False, run_dir=None, bar=None)
    for sig in (signal.SIGINT, signal.SIGTERM):
        STOP["handlers"].setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, on_signal)


def on_signal(signum, frame):
    import signal
    name = signal.Signals(signum).name
    if STOP["iterating"] and STOP["signal"] is None:
        STOP["signal"] = signum
        say(f"{name}: the run stops when this iteration is done and saved ({name} again: at once, losing it)")
        return
    again = STOP["signal"] is not None
    STOP["signal"] = signum  # kept: if the SystemExit below is swallowed (a __del__, a callback),
    stop_at_once(signum, again=again)  # Run.iterations still stops before its first iteration


def stop_at_once(signum: int, *, again: bool):
    """The stop of a signal outside an iteration's end, or of a second one: one line, exit 128 + signal."""
    import signal
    if STOP.get("bar") is not None:  # its last state printed now, not after this line
        STOP.pop("bar").close()
    run_dir = STOP["run_dir"] if STOP["run_dir"] and os.path.isdir(STOP["run_dir"]) else None
    ckpt = latest_checkpoint(run_dir) if run_dir else None
    kept = f"; its checkpoint {ckpt} resumes (--resume {run_dir})" if ckpt else ""
    if run_dir and not ckpt and STOP["iterating"]:  # a new run's first iteration: nothing to resume
        discard_new_run(run_dir, writer=None, resumed=False)
        kept = f"; no iteration was saved yet, so {run_dir} is removed"
    print(f"\nstopped by {signal.Signals(signum).name}{' again' * again}{kept}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def restore_signals():
    """The handlers catch_signals replaced, back in place (the end of a run, in a process that goes on)."""
    import signal
    while STOP["handlers"]:
        signal.signal(*STOP["handlers"].popitem())


def discard_new_run(run_dir: str, *, writer, resumed: bool):
    """A new run that stopped before its first iteration: its directory (logs, a lock) removed by rank 0."""
    if resumed or not is_main_rank():
        return
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.close()
    release_run_directories()
    shutil.rmtree(run_dir, ignore_errors=True)


@dataclasses.dataclass
class Run:
    """The state of a run that every algorithm file's loop uses (made by start_run)."""
    args: object
    rank: int
    world: int
    device: torch.device
    sharded: bool  # full fine-tuning on several ranks: FSDP2
    run_dir: str
    writer: object  # rank 0's TensorBoard writer, else None
    pipe: object
    kind: str  # the model family: a key of models.FAMILIES
    transformer: torch.nn.Module
    params: dict  # {name: trainable float32 parameter}
    optimizer: torch.optim.Optimizer
    ema: list | None  # the evaluation EMA of the trainable weights
    ref_model: object  # full fine-tuning's frozen reference (LoRA: the model with its adapters off), or None
    copies: dict  # {name: a list shaped like the trainable weights}, saved with every checkpoint
    amp: object  # the autocast context of every forward
    shape: tuple  # the shape of a sample's latents: (C, H, W), or (C, F, H, W) with frames
    weights: dict  # {reward: weight}
    reward_fns: dict  # the training rewards
    eval_fns: dict  # every reward scored at evaluation
    train_prompts: list
    eval_prompts: list
    start: int  # the first iteration to run (a resumed run: the checkpoint's)
    planned_rollout: float  # the closed-form rollout NFE per prompt (perf/nfe_min_per_prompt)
    script: str = ""  # the algorithm file's name (a checkpoint resumes with it only)
    base_weights: str = ""  # weights_fingerprint of the base transformer: saved with every checkpoint
    last_eval: tuple | None = None  # (iteration, the training reward on the held-out pairs)
    pbar: object = None  # the training progress bar (iterations)
    t0: float = dataclasses.field(default_factory=time.time)

    @property
    def part(self) -> dict:
        """What common.micro_batches needs to know of this rank's share of the samples."""
        return {"rank": self.rank, "world": self.world, "micro_batch": self.args.micro_batch,
                "per_rank": self.args.prompts_per_iteration // self.world * self.args.group_size,
                "sharded": self.sharded}

    def iterations(self, *, evaluate_base: bool = True):
        """The iterations still to run, with a progress bar; before the first of a new run, the base model's
        evaluation (iteration 0). The bar's rate and ETA count training only, not evaluations or saving."""
        args = self.args
        if self.start == 0 and args.eval_every and args.eval_base and evaluate_base:
            try:
                self.last_eval = self.evaluate(0, what="the base model")
            except BaseException:  # nothing to resume yet: a new run leaves no directory
                discard_new_run(self.run_dir, writer=self.writer, resumed=False)
                raise
        if STOP["signal"] is not None:  # a signal during the start whose SystemExit (its line printed) was
            discard_new_run(self.run_dir, writer=self.writer, resumed=self.start > 0)  # swallowed somewhere
            raise SystemExit(128 + STOP["signal"])
        say(f"training: iterations {self.start + 1} to {args.num_iterations} "
            f"({args.prompts_per_iteration} prompts x {args.group_size} images each; Ctrl-C stops after an "
            f"iteration, saved)")
        bar = "{n_fmt}/{total_fmt} iterations |{bar}| {elapsed}<{remaining}, {rate_fmt}{postfix}"
        self.pbar = progress_bar(iterable=range(self.start, args.num_iterations), initial=self.start,
                                 total=args.num_iterations, bar_format=bar, unit="it")
        STOP["bar"] = self.pbar
        for iteration in self.pbar:
            self.t_start, self.cpu_start, self.nfe_start = time.time(), time.process_time(), NFE["count"]
            STOP["iterating"] = True  # a signal from now on waits for the iteration's end (catch_signals)
            yield iteration
            signum = int(max_over_ranks(float(STOP["signal"] or 0)))  # every rank stops at the same one
            if signum and iteration + 1 < args.num_iterations:
                self.stop(iteration + 1, signum)

    def stop(self, iteration: int, signum: int):
        """The end of a run stopped by a signal after `iteration`: its checkpoint (unless one was just saved),
        the logs closed, one line with the command that continues it, exit code 128 + signal."""
        import signal
        path = os.path.join(self.run_dir, "checkpoints", f"iter_{iteration}")
        if not os.path.isdir(path):
            self.save(iteration)
        self.finish(summary=False)
        launcher = f"torchrun --nproc_per_node {self.world}" if self.world > 1 else "python"
        name, script = signal.Signals(signum).name, os.path.basename(sys.argv[0])
        if self.rank == 0:
            print(f"stopped by {name} after iteration {iteration} (checkpoint {path}); continue with: "
                  f"{launcher} {script} --resume {self.run_dir}")
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def paused(self):
        """Time that the progress bar's rate and ETA do not count (an evaluation, a checkpoint)."""
        t = time.time()
        try:
            yield
        finally:
            if self.pbar is not None and not self.pbar.disable:
                self.pbar.start_t += time.time() - t

    @torch.no_grad()
    def evaluate(self, iteration: int, *, what: str = "") -> tuple:
        """ODE samples of the fixed held-out pairs with the EMA weights (if any), scored by every reward:
        eval/* metrics, eval_<iteration>.json and a grid. Pair k: prompt k mod len(prompts), noise seed
        10^6 + k; each rank an equal share (the last pair repeated: all ranks run the same forwards). Returns
        (iteration, the training reward)."""
        args = self.args
        n = -(-args.eval_num // self.world)
        pairs = [min(k, args.eval_num - 1) for k in range(self.rank * n, (self.rank + 1) * n)]
        prompts = [self.eval_prompts[k % len(self.eval_prompts)] for k in pairs]
        noise = torch.stack([torch.randn(self.shape, generator=torch.Generator().manual_seed(10**6 + k))
                             for k in pairs])
        sigmas = pipeline_sigmas(self.pipe, self.kind, num_steps=args.eval_steps, shape=self.shape)
        with self.paused(), swapped_in(list(self.params.values()), self.ema):
            say(f"evaluating {what or f'iteration {iteration}'} on {args.eval_num} held-out prompt/seed "
                f"pairs ({args.eval_steps} ODE steps)")
            emb = encode_prompts(self.pipe, self.kind, prompts, max_sequence_length=args.max_sequence_length,
                                 cfg=args.guidance)
            bar = progress_bar(total=len(sigmas) - 1, unit="step", desc="ODE", inner=True)
            with self.amp, gathered(self.transformer, sharded=self.sharded), bar:
                paths = [list(range(len(sigmas)))] * n  # every pair the whole schedule
                x0 = ode_complete(self.transformer, self.kind, noise.to(self.device), paths, sigmas, emb,
                                  guidance=args.guidance, micro_batch=args.micro_batch, progress=bar.update)
            held = held_out_rewards(args)  # rewards scored, not trained on: the over-rating and the drift
            parts, shown, thumbs = [], [], []  # decoded and scored a micro-batch at a time (videos: GBs)
            for c in torch.arange(n).split(args.micro_batch):
                images = decode(self.pipe, x0[c])
                parts.append(score(self.eval_fns, images, [prompts[i] for i in c], evaluation=True))
                shown.append(images[:max(0, GRID - sum(map(len, shown)))].cpu())
                if held:  # each frame of a video [B, 3, F, H, W] as an image
                    thumbs.append(thumbnails(images.transpose(1, 2) if images.ndim == 5 else images))
            local = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            scores = {k: gather_cat(v.to(self.device)).cpu()[:args.eval_num] for k, v in local.items()}
            for fn in self.eval_fns.values():
                if hasattr(fn, "breakdown"):  # GenEval's accuracies per tag
                    every = [self.eval_prompts[k % len(self.eval_prompts)] for k in range(args.eval_num)]
                    scores.update(fn.breakdown(scores, every))
            small = gather_cat(torch.cat(thumbs).to(self.device)).cpu()[:args.eval_num] if held else None
            if self.rank == 0:
                means = {f"eval/{k}": v.mean() for k, v in scores.items()}
                with stop_on_write_error(self.run_dir):
                    if held:
                        means.update(over_rating_metrics(self.run_dir, iteration, scores, small, held=held,
                                                         weights=self.weights))
                    log_metrics(self.writer, self.run_dir, iteration, means, per_sample=scores)
                    save_eval_grid(self.run_dir, iteration, torch.cat(shown), prompts, local, fps=args.fps)
        return iteration, self.reward(scores).item()

    def reward(self, scores: dict):
        """The training objective: the weighted mean of the training rewards."""
        return sum(self.weights[k] * scores[k].mean() for k in self.args.rewards) / sum(self.weights.values())

    def optimizer_step(self, terms: list):
        """One optimizer step on the gradients of a mini-batch's `terms` ((j, c, scale, ...) each, from
        common.micro_batches): DDP-style averaging, clipping, AdamW; none if no rank had a term with a
        gradient. Returns the norm, or None."""
        has_gradient = any(term[2] > 0 for term in terms)
        return optimizer_step(self.params, self.optimizer, max_grad_norm=self.args.max_grad_norm,
                              sharded=self.sharded, has_gradient=has_gradient)

    def ema_step(self, step: int):
        """The evaluation EMA after `step` optimizer steps in all, every --ema-every steps (Flow-GRPO)."""
        if self.ema is not None and (step + 1) % self.args.ema_every == 0:
            ema_update(self.ema, list(self.params.values()), self.args.ema_decay, step)

    def nfe(self) -> float:
        """This iteration's transformer evaluations so far, over all ranks."""
        return sum_over_ranks({"nfe": NFE["count"] - self.nfe_start})["nfe"]

    def log(self, iteration: int, metrics: dict):
        if self.rank == 0:
            with stop_on_write_error(self.run_dir):
                log_metrics(self.writer, self.run_dir, iteration, metrics)

    def end_iteration(self, iteration: int, stats: "Stats", *, scores: dict, metrics: dict | None = None,
                      samples: tuple | None = None):
        """After iteration `iteration` (0-based): its metrics (the rewards of every rank's samples `scores`
        {name: [groups, G]}, the training statistics, NFE and time, the file's own `metrics`), the progress
        bar, an evaluation, a grid of `samples` (images, their prompt, {reward: their scores}) and a
        checkpoint when due."""
        args, done = self.args, iteration + 1
        P = args.prompts_per_iteration // self.world
        totals = sum_over_ranks({**stats.sums, "nfe": NFE["count"] - self.nfe_start,
                                 "nfe_rollout": stats.nfe_start - self.nfe_start})
        n = max(totals["terms"], 1)
        m = {f"reward/{k}_mean": v.mean() for k, v in scores.items()}
        m.update({f"reward/{k}_std": v.std() for k, v in scores.items()})
        flat = torch.stack([v.max(1).values == v.min(1).values for v in scores.values()]).all(0)
        m["reward/zero_std_fraction"] = flat.float().mean()
        m.update({f"train/{k}": totals[k] / n for k in stats.sums if k != "terms"})  # means over the terms
        m["train/grad_norm"] = sum(stats.norms) / max(len(stats.norms), 1)
        m["train/updates"] = len(stats.norms)
        m.update(metrics or {})
        m.update({f"train/{k}": max_over_ranks(v) for k, v in stats.maxima.items()})
        m["perf/nfe_rollout_per_prompt"] = totals["nfe_rollout"] / (P * self.world)
        m.setdefault("perf/nfe_min_per_prompt", self.planned_rollout)
        m["perf/nfe_per_iteration"] = totals["nfe"]
        m["perf/rollout_seconds"] = stats.t_start - self.t_start  # the rollout and the rewards
        m["perf/seconds_per_iteration"] = time.time() - self.t_start
        m["perf/cpu_seconds_per_iteration"] = time.process_time() - self.cpu_start  # this process
        self.log(done, m)
        last = done == args.num_iterations
        if args.eval_every and (done % args.eval_every == 0 or last):
            self.last_eval = self.evaluate(done)
        held_out = "" if self.last_eval is None else \
            f" (held-out {self.last_eval[1]:.3f} at iteration {self.last_eval[0]})"
        self.pbar.set_postfix_str(f"reward {self.reward(scores):.3f}{held_out}", refresh=False)
        if self.rank == 0 and args.log_images_every and done % args.log_images_every == 0 and samples:
            images, prompt, sample_scores = samples
            captions = [f"{prompt[:40]}\n" + " ".join(f"{k}={v[i]:.3f}" for k, v in sample_scores.items())
                        for i in range(len(images))]
            images = beside_sources(images.cpu(), [prompt] * len(images))
            with stop_on_write_error(self.run_dir):
                self.writer.add_figure("samples", image_grid(images, captions), done)
        if (args.save_every and done % args.save_every == 0) or last:
            self.save(done)

    def save(self, iteration: int):
        """A checkpoint after `iteration` iterations (save_state); the oldest beyond --keep-checkpoints go."""
        path = os.path.join(self.run_dir, "checkpoints", f"iter_{iteration}")
        with self.paused(), stop_on_write_error(self.run_dir, unfinished=path + ".tmp"):
            say(f"saving {path}")
            save_state(path, iteration=iteration, run=self, keep=self.args.keep_checkpoints)

    def finish(self, summary: bool = True):
        """The end of the run: the logs closed, what it did printed (run_summary), the process group ended."""
        restore_signals()
        if self.rank == 0:
            if self.pbar is not None:
                self.pbar.close()
            with stop_on_write_error(self.run_dir):
                self.writer.close()
            release_run_directories()
            if summary:
                print(run_summary(self.run_dir, args=self.args, pipe=self.pipe, weights=self.weights,
                                  seconds=time.time() - self.t0))
        close_distributed()


class Stats:
    """One iteration's training statistics, made when its policy update starts (which ends the rollout's NFE
    and time): sums of `names` over the trained terms (add; "terms" counts them; logged as means over every
    rank's terms), `maxima` over the ranks (max), the optimizer steps' gradient norms (step)."""

    def __init__(self, *names, maxima: tuple = ()):
        self.sums = dict.fromkeys(("terms", *names), 0.0)
        self.maxima, self.norms = dict.fromkeys(maxima, 0.0), []
        self.nfe_start, self.t_start = NFE["count"], time.time()

    def add(self, scale: float, **sums):
        """Sums of a term's statistics; none at scale 0 (a forward that only joins FSDP2's collectives)."""
        if scale:
            for k, v in sums.items():
                self.sums[k] += v.detach() if torch.is_tensor(v) else v

    def max(self, scale: float, **values):
        """Running maxima of a term's statistics (none at scale 0)."""
        if scale:
            for k, v in values.items():
                self.maxima[k] = max(self.maxima[k], float(v))

    def step(self, norm):
        """An optimizer step's gradient norm (None: no step was taken)."""
        if norm is not None:
            self.norms.append(norm)


# ======== 1. The run directory and its logs ========
HELD = {}  # {run directory: the open run.lock by which this process holds it}


def run_directory(args, *, checkpoint: str | None) -> str:
    """The resumed checkpoint's run, or a new <output_dir>/<model>__<exp_name>__<seed>__<time>[_<k>] (made by
    rank 0 with os.mkdir, which only one process can win: runs started in the same second get distinct
    directories); rank 0 holds it for the run's life (hold_run_directory), or every rank stops in one line."""
    run_dir, problem = None, None
    if is_main_rank():
        with stop_on_write_error(args.output_dir):
            if checkpoint:
                run_dir = os.path.dirname(os.path.dirname(checkpoint))
            else:
                model = os.path.basename(args.model.rstrip("/"))
                name = f"{model}__{args.exp_name}__{args.seed}__{int(time.time())}"
                run_dir = new_directory(os.path.join(args.output_dir, name))
            problem = hold_run_directory(run_dir)
    run_dir, problem = broadcast_object((run_dir, problem))
    if problem:
        fail(problem)
    return run_dir


def new_directory(path: str) -> str:
    """A directory made by this process: `path`, else path_2, path_3, ... (os.mkdir fails if one exists)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for k in range(1, 10**4):
        try:
            os.mkdir(path if k == 1 else f"{path}_{k}")
            return path if k == 1 else f"{path}_{k}"
        except FileExistsError:
            continue
    fail(f"{path!r} and 10,000 of its numbered variants exist; pass another --output-dir")


MIXED = "two runs in one directory would mix their logs and checkpoints"


def hold_run_directory(run_dir: str, *, what: str = "run directory", why: str = MIXED) -> str | None:
    """An exclusive lock on <run_dir>/run.lock (fcntl.flock: the OS drops it when the process ends, kill -9
    included; released by release_run_directories), naming this process in the file. Returns None, or why it
    cannot be had: the holder. Holding it, what a killed run left half-written (*.tmp) goes."""
    import fcntl
    import socket
    f = open(os.path.join(run_dir, "run.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its holder wrote itself in
        f.seek(0)
        holder = "".join(c if c.isprintable() else repr(c)[1:-1] for c in f.read(300).strip())  # (escaped)
        holder = holder or "another process"
        f.close()
        return f"{what} {run_dir!r} is in use by {holder}; wait until that run ends or stop it ({why})"
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} "
            f"({' '.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:200]})\n")
    f.flush()
    HELD[run_dir] = f
    for d in (run_dir, os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "samples")):
        for name in os.listdir(d) if os.path.isdir(d) else []:
            if ".tmp" in name:  # a killed run's unfinished write
                left = os.path.join(d, name)
                shutil.rmtree(left) if os.path.isdir(left) else os.remove(left)
    return None


def release_run_directories():
    """This process's run directory locks released (the end of a run; a process's end releases them too)."""
    while HELD:
        HELD.popitem()[1].close()


def write_atomically(path: str, data: str | bytes):
    """`path` replaced whole: a temporary file written, flushed to disk (fsync), renamed over it. A kill at
    any moment leaves the old content or the new, never a part or an empty file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


@contextlib.contextmanager
def stop_on_write_error(run_dir: str, *, unfinished: str | None = None):
    """An OSError while writing (a read-only file system, a full disk) as a one-line error naming the path and
    the checkpoint that still resumes; `unfinished` (a checkpoint's .tmp) removed first."""
    try:
        yield
    except Exception as e:
        said = ("No space left", "Read-only file system")  # safetensors' writer says it in words
        chain = [e]
        while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
        os_error = next((x for x in chain if isinstance(x, OSError)), None)  # torch.save's "unexpected pos"
        if os_error is None and not any(s in str(e) for s in said):  # comes from the OSError of its write
            raise
        e = os_error or e
        if unfinished:
            shutil.rmtree(unfinished, ignore_errors=True)
        ckpt = latest_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        then = f"; its last complete checkpoint resumes: --resume {run_dir}" if ckpt else ""
        where = getattr(e, "filename", None) or unfinished or run_dir
        why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0][:120]
        fail(f"cannot write {where!r} ({why}): the run stops here{then}")


def make_writer(run_dir: str, args, *, resume_iteration: int | None = None):
    """Rank 0's TensorBoard writer (wandb syncs it with --track), the arguments as text; resuming after N
    drops what the killed run logged after N (metrics.jsonl rows, rewritten atomically, eval_<i>.*,
    TensorBoard events)."""
    from torch.utils.tensorboard import SummaryWriter
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if resume_iteration is not None and os.path.isfile(metrics):
        rows = [r for r in read_jsonl(metrics) if r["iteration"] <= resume_iteration]
        write_atomically(metrics, "".join(json.dumps(r) + "\n" for r in rows))
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
    if not getattr(threading.excepthook, "quiet_writer", False):
        threading.excepthook = functools.partial(quiet_writer_thread, threading.excepthook)
        threading.excepthook.quiet_writer = True
    table = "\n".join(f"|{k}|{v}|" for k, v in config.items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer


def quiet_writer_thread(previous, args):
    """threading.excepthook without the traceback of TensorBoard's writer thread when its write fails (a full
    disk): the main thread raises the same error at its next log or close, which stop_on_write_error says in
    one line."""
    if not (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError)):
        previous(args)


def read_jsonl(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (JSON objects with an integer "iteration", each line at most 1 MiB, parsed
    within parse_json's bounds), without a last line that a killed process left half written (no newline);
    any other line that is no such row is a one-line error."""
    rows = []
    with open(path, "rb") as f:
        while line := f.readline((1 << 20) + 1):
            try:
                row = parse_json(line)
            except ValueError:
                row = None
            if not (isinstance(row, dict) and type(row.get("iteration")) is int) and line.endswith(b"\n"):
                fail(f"{path} line {len(rows) + 1} is no metrics row (a JSON object with an integer "
                     f"\"iteration\", at most 1 MiB): {shown(line[:60])}; remove that line")
            rows += [row] if line.endswith(b"\n") else []
    return rows


def read_json(path: str, *, limit: int = 1 << 20, depth: int = JSON_DEPTH):
    """A JSON file's content within parse_json's bounds (at most `limit` bytes read); OSError, ValueError."""
    with open(path, "rb") as f:
        return parse_json(f.read(limit + 1), limit=limit, depth=depth)


SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                     "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_header(path: str) -> dict:
    """{name: shape} of a .safetensors file from its header alone (no tensor is read; within safetensors' own
    bounds: 100 MB, and 4 levels), checked to describe tensors of their dtype's size that fill the file
    exactly; else ValueError saying what is wrong (cut short, a pickle or another format), or OSError."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(size - 8, 100_000_000):
            raise ValueError(f"cut short or no safetensors file ({size:,} bytes)")
        header = parse_json(f.read(n), limit=n, depth=4)
    shapes, end = {}, 0
    for name, t in (header.items() if isinstance(header, dict) else [("", None)]):
        if name == "__metadata__":
            continue
        shape, offsets = (t.get("shape"), t.get("data_offsets")) if isinstance(t, dict) else (None, None)
        fits = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and \
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets) and \
            0 <= offsets[0] <= offsets[1]
        if fits and t.get("dtype") in SAFETENSORS_BYTES:  # its bytes are its elements'
            fits = offsets[1] - offsets[0] == math.prod(shape) * SAFETENSORS_BYTES[t["dtype"]]
        if not fits:
            raise ValueError(f"its header's entry {shown(name)} is no tensor")
        shapes[name], end = tuple(shape), max(end, offsets[1])
    if 8 + n + end != size:
        raise ValueError(f"cut short or no safetensors file ({size:,} bytes, its header: {8 + n + end:,})")
    return shapes


def log_metrics(writer, run_dir: str, step: int, metrics: dict, per_sample: dict | None = None):
    """On rank 0: scalars to TensorBoard and a line to <run_dir>/metrics.jsonl; `per_sample` (every evaluation
    pair's reward, for paired comparisons) to <run_dir>/eval_<step>.json."""
    for k, v in metrics.items():
        writer.add_scalar(k, v, step)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:  # a kill leaves at most a half line
        f.write(json.dumps({"iteration": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    if per_sample is not None:
        write_atomically(os.path.join(run_dir, f"eval_{step}.json"),
                         json.dumps({k: v.tolist() for k, v in per_sample.items()}))


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
RUN_JSON = {"iteration": int, "script": str, "world": int, "sharded": bool, "args": dict}  # save_state writes


def read_run_json(ckpt: str, *, need: dict = RUN_JSON, args: tuple = FIXED_ON_RESUME) -> dict:
    """A checkpoint's run.json, checked to hold what save_state writes (`need`, RUN_JSON: an iteration >= 1,
    the script, the world size, whether sharded, the arguments, with `args` among them), else one line."""
    try:
        saved = read_json(os.path.join(ckpt, "run.json"))
    except (OSError, ValueError) as e:
        bound = f": {e}" if type(e) is ValueError else ""  # parse_json's bounds say which
        fail(f"checkpoint {ckpt!r} cannot be read ({type(e).__name__} in run.json{bound}); resume from "
             f"another one")
    saved = saved if isinstance(saved, dict) else {}
    lacks = [k for k, kind in need.items() if type(saved.get(k)) is not kind]
    lacks += [f"args.{k}" for k in args if k not in (saved.get("args") if "args" not in lacks else {})]
    if lacks or saved["iteration"] < 1 or saved.get("world", 1) < 1:
        fail(f"checkpoint {ckpt!r} has a run.json without a valid {', '.join(lacks) or 'iteration or world'} "
             f"(not what save_state writes); resume from another checkpoint")
    return saved


def resume_checkpoint(path: str, *, args, world: int, script: str) -> tuple[str, int]:
    """The checkpoint to resume (chosen on rank 0: every rank reads the same one) and its iteration, checked
    before any model loads: same algorithm file, model, trainable weights, world size if sharded. Prints the
    arguments given on the command line that differ from the checkpoint's: the new values apply (e.g.
    --learning-rate)."""
    ckpt = broadcast_object(latest_checkpoint(path) if is_main_rank() else None)
    if ckpt is None:
        fail(f"--resume {path!r} holds no checkpoint; pass a run directory with checkpoints/iter_*")
    saved = read_run_json(ckpt)
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
    if args.num_iterations <= saved["iteration"]:
        fail(f"--num-iterations {args.num_iterations} is not beyond checkpoint {ckpt!r} (iteration "
             f"{saved['iteration']}); pass the total number of iterations to reach, more than "
             f"{saved['iteration']}")
    changed = [f"{k} {saved['args'].get(k)} -> {v}" for k, v in now.items()
               if k != "resume" and saved["args"].get(k) != v]
    if is_main_rank():  # the checkpoint's arguments are the defaults (parse_args): the flags given win
        given = f"; changed on the command line: {', '.join(changed)}" if changed else ""
        print(f"resuming with the checkpoint's arguments{given}")
    return ckpt, saved["iteration"]


def save_state(path: str, *, iteration: int, run: Run, keep: int = 0):
    """Atomic checkpoint of a Run at `path` (path.tmp, renamed): run.json (iteration, script, world size,
    arguments), state.pt (unsharded: trainable weights, optimizer, EMA, the copies {name: a list shaped like
    params}, e.g. an old policy) or dcp/ (sharded: each rank's shards by torch.distributed.checkpoint, the
    copies too), exports (the EMA if any): lora/ (diffusers `pipe.load_lora_weights`, with alpha) or
    transformer/ (`<Transformer>.from_pretrained`; sharded: a file per rank and an index). The newest `keep`
    checkpoints stay (0: all)."""
    from safetensors.torch import save_file
    transformer, optimizer, params, ema, args = run.transformer, run.optimizer, run.params, run.ema, run.args
    pipe, sharded, extra, base_weights = run.pipe, run.sharded, run.copies, run.base_weights
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
        with open(os.path.join(tmp, "state.pt"), "wb") as f:  # a full disk: OSError (a path: RuntimeError)
            torch.save(state, f)
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
        run = {"iteration": iteration, "script": run.script, "world": world,
               "sharded": sharded, "args": loggable(args), "base_weights": base_weights}
        with open(os.path.join(tmp, "run.json"), "w") as f:
            json.dump(run, f, indent=1)
        for folder, _, files in os.walk(tmp):  # on the disk before the rename makes the checkpoint count
            for name in files:
                with open(os.path.join(folder, name), "rb+") as f:
                    os.fsync(f.fileno())
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        root = os.path.dirname(path)
        done = sorted((d for d in os.listdir(root) if iteration_of(d) is not None and not d.endswith(".tmp")),
                      key=iteration_of)
        for d in done[:-keep] if keep else []:  # a sharded FLUX.1-dev checkpoint is ~190 GB
            prune(os.path.join(root, d))
    barrier()


def prune(path: str):
    """A checkpoint removed, unless a process reads it (evaluate.py holds it: use_checkpoint); then it stays
    until a later checkpoint's pruning."""
    import fcntl
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(path)
    except BlockingIOError:
        say(f"keeping {path}: another process reads it (evaluate.py); a later checkpoint removes it")
    finally:
        os.close(fd)


HELD_CHECKPOINTS = []  # the checkpoints this process reads (use_checkpoint), held until it ends


def use_checkpoint(path: str) -> bool:
    """A shared lock on a checkpoint directory for this process's life, so that a live run's pruning leaves it
    alone; False if it is gone (pruned before the lock)."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits for a removal under way, which then leaves no run.json
    HELD_CHECKPOINTS.append(fd)
    return os.path.isfile(os.path.join(path, "run.json"))


def load_state(path: str, *, run: Run):
    """Restores into a Run what save_state wrote (sharded: same world size), with this run's learning rate and
    weight decay in the optimizer, its copies in place, its EMA (if it keeps one)."""
    transformer, optimizer, params, extra = run.transformer, run.optimizer, run.params, run.copies
    if run.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        shards = dict(zip(("model", "optim"), get_state_dict(transformer, optimizer)))
        shards["extra"] = {k: dict(zip(params, v)) for k, v in extra.items()}
        try:  # each rank reads its own shards in place; a misfit fails on every rank
            dcp.load(shards, checkpoint_id=os.path.join(path, "dcp"))
        except Exception as e:
            why = escaped((str(e).strip().splitlines() or [""])[0])
            fail(f"checkpoint {path!r} does not fit this run ({type(e).__name__}: {why}); resume a "
                 f"checkpoint of this model and these weights")
        set_state_dict(transformer, optimizer, model_state_dict=shards["model"],
                       optim_state_dict=shards["optim"])
        saved_ema = None
    else:
        try:  # weights_only: a pickle cannot run code
            state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            fail(f"checkpoint {path!r} cannot be read ({type(e).__name__} in state.pt); resume another one")
        misfit = state_misfit(state, params, extra=extra, ema=run.args.ema)
        if misfit:
            fail(f"checkpoint {path!r} does not fit this run: {misfit}; resume a checkpoint of this model "
                 f"and these trainable weights")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state["trainable"][n])
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # another optimizer's state
            fail(f"checkpoint {path!r} does not fit this run: its optimizer state ({type(e).__name__}: "
                 f"{escaped(e)}); resume a checkpoint of this model and these trainable weights")
        saved_ema = state["ema"]
        with torch.no_grad():
            for k, values in extra.items():
                for n, t in zip(params, values):
                    t.copy_(state["extra"][k][n])
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = run.args.learning_rate, run.args.weight_decay
    if run.args.ema:
        run.ema = [saved_ema[n].to(run.device) for n in params]


def state_misfit(state, params: dict, *, extra: dict, ema: bool) -> str | None:
    """What of a state.pt does not fit this run's trainable weights (the names and shapes of its trainable
    weights, its EMA and each copy), or None."""
    if not isinstance(state, dict) or not {"trainable", "optimizer", "ema", "extra"} <= set(state):
        return "its state.pt is none that save_state writes (trainable, optimizer, ema, extra)"
    wanted = {n: tuple(p.shape) for n, p in params.items()}
    parts = {"trainable weights": state["trainable"], **({"EMA": state["ema"]} if ema else {}),
             **{f"copy {k!r}": (state["extra"] or {}).get(k) for k in extra}}
    for what, saved in parts.items():
        saved = saved if isinstance(saved, dict) else {}
        got = {n: tuple(t.shape) if torch.is_tensor(t) else None for n, t in saved.items()}
        missing, unexpected = sorted(wanted.keys() - got.keys()), sorted(got.keys() - wanted.keys())
        wrong = [n for n in sorted(wanted.keys() & got.keys()) if wanted[n] != got[n]]
        if missing or unexpected:
            return (f"its {what} lack {len(missing)} of this run's {len(wanted)} tensors "
                    f"({first(missing)}) and hold {len(unexpected)} others "
                    f"({first(unexpected)})")
        if wrong:
            return f"its {what} hold {wrong[0]} of shape {got[wrong[0]]}, this run's is {wanted[wrong[0]]}"
    return None


def escaped(text, n: int = 160) -> str:
    """Text of a file or an error (which may quote a file), cut at n characters, control characters escaped"""
    return repr(str(text)[:n])[1:-1]


def first(names: list) -> str:
    """The first of some names read from a file (tensors), escaped; '-' for none."""
    return escaped(names[0], 100) if names else "-"


def weights_fingerprint(module) -> str:
    """A short hash of a module's weights, cheap at any size: each tensor's name, shape and 1,024 values
    spread over it, rounded to bfloat16 (the same weights loaded in float32 or bf16 agree). Other weights of
    the same architecture (another release, a fine-tune) differ in these values."""
    digest = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        flat = t.detach().reshape(-1)
        picks = torch.linspace(0, max(flat.numel() - 1, 0), min(1024, flat.numel())).long().to(flat.device)
        digest.update(f"{name} {tuple(t.shape)}".encode())
        digest.update(flat[picks].to(torch.bfloat16).cpu().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


# ======== 3. Sample grids and the end-of-run summary ========
def frame_strip(videos, frames: int = 4):
    """Videos [B, 3, F, H, W] as images [B, 3, H, k W] of k = min(frames, F) frames side by side, evenly
    spaced from the first to the last (a still view of the motion)."""
    index = torch.linspace(0, videos.shape[2] - 1, min(frames, videos.shape[2])).round().long()
    return torch.cat(list(videos[:, :, index].unbind(2)), dim=-1)


def image_grid(images, captions, ncols: int = 6, path: str | None = None, title: str = ""):
    """Matplotlib figure of images [B, 3, H, W] in [0, 1] (videos [B, 3, F, H, W]: their frame_strip) under
    their captions, saved to `path` if given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    images = frame_strip(images) if images.ndim == 5 else images
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
        buf = io.BytesIO()
        fig.savefig(buf, dpi=100, format=os.path.splitext(path)[1][1:])
        write_atomically(path, buf.getvalue())
        plt.close(fig)
    return fig


def beside_sources(images, prompts: list):
    """Images [B, 3, H, W] of editing prompts each with its first source image on its left (resized to the
    result's size, a 2-pixel gap): [B, 3, H, 2 W + 2]; other images (and videos) as they are."""
    if images.ndim != 4 or not getattr(prompts[0], "images", ()):
        return images
    from models import source_image
    h, w = images.shape[-2:]
    out = torch.zeros(len(images), 3, h, 2 * w + 2)
    for i, p in enumerate(prompts):
        src = torch.from_numpy(np.asarray(source_image(p.images[0]).resize((w, h)))).permute(2, 0, 1)
        out[i, :, :, :w], out[i, :, :, w + 2:] = src.float() / 255, images[i].float()
    return out


GRID = 12  # evaluation pairs shown in each evaluation's grid


def save_eval_grid(run_dir: str, iteration: int, images, prompts: list, scores: dict, n: int = GRID,
                   fps: int = 16):
    """runs/<run>/samples/eval_<iteration>.png: the first n evaluation pairs, their prompts and rewards; for
    videos also eval_<iteration>.webp, the same pairs playing (save_video_grid)."""
    captions = ["\n".join(textwrap.wrap(p, 34) + [f"{k} {v[i]:.3f}" for k, v in scores.items()])
                for i, p in enumerate(prompts[:n])]
    edits = " (edits: source | result)" if getattr(prompts[0], "images", ()) else ""
    image_grid(beside_sources(images[:n].cpu(), prompts[:n]), captions,
               path=os.path.join(run_dir, "samples", f"eval_{iteration}.png"),
               title=f"iteration {iteration}: ODE samples of fixed prompt / seed pairs{edits}")
    if images.ndim == 5:
        save_video_grid(images[:n], os.path.join(run_dir, "samples", f"eval_{iteration}.webp"), fps=fps)


def save_video_grid(videos, path: str, *, fps: int, ncols: int = 6):
    """Videos [B, 3, F, H, W] in [0, 1] tiled into one grid per frame (ncols across, 2-pixel gaps) and written
    as a looping lossless animated WebP (Pillow) at `fps` frames per second, atomically."""
    from PIL import Image
    b, _, f, h, w = videos.shape
    ncols = min(ncols, b)
    rows = math.ceil(b / ncols)
    grid = torch.zeros(f, 3, rows * (h + 2), ncols * (w + 2))
    for i, v in enumerate(videos.detach().float().clamp(0, 1).cpu()):
        y, x = (i // ncols) * (h + 2), (i % ncols) * (w + 2)
        grid[:, :, y:y + h, x:x + w] = v.transpose(0, 1)
    pixels = (grid * 255).round().byte().permute(0, 2, 3, 1).numpy()
    frames = [Image.fromarray(p) for p in pixels]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], duration=round(1000 / fps),
                   loop=0, lossless=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomically(path, buf.getvalue())


def paired_change(before: list, after: list) -> tuple[float, float]:
    """The mean change over the same pairs and its paired standard error."""
    a, b = torch.tensor(before, dtype=torch.float64), torch.tensor(after, dtype=torch.float64)
    return float((b - a).mean()), float((b - a).std() / math.sqrt(len(a)))


def decimals(se: float) -> int:
    """Decimals that show a standard error to two significant digits (4 when it is 0 or undefined)."""
    if not math.isfinite(se) or se <= 0:
        return 4
    return min(max(1 - int(f"{se:.1e}".split("e")[1]), 0), 10)  # the exponent of se rounded to 2 digits


def change_line(before: list, after: list) -> str:
    """'mean -> mean (change +- paired SE, z SE): verdict', with decimals enough that a change beyond 2 SE
    never shows as 0, and 'no change' for none at all."""
    d, se = paired_change(before, after)
    k = max(4, decimals(se if se > 0 else abs(d)))
    means = f"{sum(before) / len(before):.{k}f} -> {sum(after) / len(after):.{k}f}"
    verdict = "no change" if d == 0 else "improved" if d > 2 * se else "got worse" if d < -2 * se else \
        "no change beyond 2 SE"
    return f"{means} ({d:+.{k}f} +- {se:.{k}f}, {d / se if se > 0 else 0:+.1f} SE): {verdict}"


def held_out_rewards(args) -> list[str]:
    """The rewards a run evaluates but does not train on (--eval-rewards less --rewards)."""
    return [k for k in dict.fromkeys(args.eval_rewards) if k not in args.rewards]


def thumbnails(images: torch.Tensor) -> torch.Tensor:
    """Images [..., 3, H, W] in [0, 1] area-averaged to 32 x 32, in 8 bits: what the drift compares."""
    x = images.float()
    small = torch.nn.functional.interpolate(x.reshape(-1, *x.shape[-3:]), size=(32, 32), mode="area")
    return (small.clamp(0, 1) * 255).round().to(torch.uint8).reshape(*x.shape[:-2], 32, 32)


def over_rating(base: dict, now: dict, held: str, *, weights: dict) -> tuple[float, float]:
    """The training objective's change (the weighted mean of the training rewards, as Run.reward, per pair)
    minus the held-out reward's change, from `base` to `now` ({reward: every pair's score}): its mean over the
    pairs and its paired standard error."""
    def trained(e):
        return sum(w * torch.as_tensor(e[k]).double() for k, w in weights.items()) / sum(weights.values())

    def change(k):
        return torch.as_tensor(now[k]).double() - torch.as_tensor(base[k]).double()
    d = trained(now) - trained(base) - change(held)
    return float(d.mean()), float(d.std() / math.sqrt(len(d)))


def over_rating_metrics(run_dir: str, iteration: int, scores: dict, small: torch.Tensor, *, held: list,
                        weights: dict) -> dict:
    """What the reward-hacking comparison measures (docs/results.md), logged at every evaluation of a run that
    scores rewards it does not train on: eval/over_rating/<held-out reward> (over_rating since the base
    evaluation) with its paired SE (..._se), and eval/drift: per pair, the root mean square difference between
    this evaluation's image and the base model's image of the same prompt and noise, both area-averaged to
    32 x 32 in [0, 1] units (thumbnails); its mean over the pairs, with its SE. The base evaluation (iteration
    0) keeps its thumbnails in <run_dir>/drift_base.pt; without a base evaluation nothing is measured."""
    path, base_scores = os.path.join(run_dir, "drift_base.pt"), os.path.join(run_dir, "eval_0.json")
    if iteration == 0:
        buffer = io.BytesIO()
        torch.save(small, buffer)
        write_atomically(path, buffer.getvalue())
        return {}
    if not (os.path.isfile(path) and os.path.isfile(base_scores)):
        return {}
    base, out = read_json(base_scores, limit=1 << 28), {}
    for k in held:
        d, se = over_rating(base, scores, k, weights=weights)
        out[f"eval/over_rating/{k}"], out[f"eval/over_rating/{k}_se"] = d, se
    before = torch.load(path, weights_only=True)
    if before.shape == small.shape:
        per_pair = ((small.double() - before.double()) / 255).pow(2).flatten(1).mean(1).sqrt()
        out["eval/drift"] = float(per_pair.mean())
        out["eval/drift_se"] = float(per_pair.std() / math.sqrt(len(per_pair)))
    return out


def over_rating_lines(run_dir: str, evals: list, *, args, weights: dict) -> list[str]:
    """A line per held-out reward: the evaluations at which the over-rating exceeds 2 paired SE (or its last
    value) and the one where the held-out reward peaked (the checkpoint to keep); then one with the drift."""
    held = held_out_rewards(args)
    if not held or 0 not in evals or len(evals) < 2:
        return []
    e = {i: read_json(os.path.join(run_dir, f"eval_{i}.json"), limit=1 << 28) for i in evals}
    out = []
    for k in held:
        over = {i: over_rating(e[0], e[i], k, weights=weights) for i in evals[1:]}
        beyond = [i for i, (d, se) in over.items() if d > 2 * se]
        last = beyond[-1] if beyond else evals[-1]
        (d, se), p = over[last], max(4, decimals(over[last][1]))
        at = ", ".join(map(str, beyond))
        told = f"exceeds 2 paired SE at iterations {at}" if beyond else "never exceeds 2 paired SE"
        peak = max(evals, key=lambda j: (sum(e[j][k]) / len(e[j][k]), -j))
        kept = os.path.isdir(os.path.join(run_dir, "checkpoints", f"iter_{peak}"))
        keep = f"checkpoints/iter_{peak}" if kept else "none saved there (--save-every)"
        keep = "the base model" if peak == 0 else keep
        out.append(f"  over-rating (training reward's gain minus {k}'s): {told} ({d:+.{p}f} +- {se:.{p}f} at "
                   f"{last}); {k} peaked at iteration {peak} ({sum(e[peak][k]) / len(e[peak][k]):.4f}), the "
                   f"checkpoint to keep: {keep}")
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "eval/drift" in r]
    if rows:
        r, p = rows[-1], max(4, decimals(rows[-1]["eval/drift_se"]))
        out.append(f"  drift from the base model (RMS difference of the pairs' images, 32 x 32, in [0, 1]): "
                   f"{r['eval/drift']:.{p}f} +- {r['eval/drift_se']:.{p}f} at iteration {r['iteration']}")
    return out


def run_summary(run_dir: str, *, args, pipe, weights: dict, seconds: float) -> str:
    """What a run did (metrics.jsonl, eval_<i>.json): each reward at the first and last evaluation with the
    change's paired standard error, time, NFE, sample grids, the checkpoint and how diffusers loads it."""
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "perf/nfe_per_iteration" in r]
    nfe = sum(r["perf/nfe_per_iteration"] for r in rows)
    took = f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"
    out = [f"\n{args.exp_name} on {args.model}: {len(rows)} iteration{'s' * (len(rows) != 1)} in {took}, "
           f"{nfe:,.0f} transformer evaluations (NFE)"]
    names = os.listdir(run_dir)
    evals = sorted(iteration_of(f) for f in names if f.startswith("eval_") and f.endswith(".json"))
    if len(evals) > 1:
        e0, e1 = (read_json(os.path.join(run_dir, f"eval_{i}.json"), limit=1 << 28)
                  for i in (evals[0], evals[-1]))
        for e in (e0, e1):  # the training objective on held-out pairs: the weighted mean of the rewards
            e["training reward"] = [sum(weights[k] * e[k][j] for k in weights) / sum(weights.values())
                                    for j in range(len(e[args.rewards[0]]))]
        pairs = len(e1[args.rewards[0]])
        out.append(f"Evaluation on {pairs} fixed prompt/seed pairs (ODE, {args.eval_steps} steps), iteration "
                   f"{evals[0]} -> {evals[-1]}, change +- paired standard error:")
        for name in ["training reward", *[k for k in e1 if k != "training reward"]]:
            out.append(f"  {name:>20}: {change_line(e0[name], e1[name])}")
        out += over_rating_lines(run_dir, evals, args=args, weights=weights)
    samples = os.path.abspath(os.path.join(run_dir, "samples"))
    grids = sorted(os.listdir(samples), key=iteration_of) if os.path.isdir(samples) else []
    if grids:
        out.append(f"Sample grids in {samples}: {', '.join(grids)}")
    ckpt = latest_checkpoint(run_dir)
    if ckpt:
        ckpt, model = os.path.abspath(ckpt), MODEL_ALIASES.get(args.model, args.model)
        pipe_cls, tr_cls = type(pipe).__name__, type(pipe.transformer).__name__.removeprefix("FSDP")
        if args.full_finetune:
            transformer = f"{tr_cls}.from_pretrained({os.path.join(ckpt, 'transformer')!r})"
            load = f"pipe = {pipe_cls}.from_pretrained({model!r}, transformer={transformer})"
        else:
            load = (f"pipe = {pipe_cls}.from_pretrained({model!r}); "
                    f"pipe.load_lora_weights({os.path.join(ckpt, 'lora')!r})")
        entry = FAMILIES[family_of(pipe)]
        frames = f"num_frames={args.num_frames or 33}, " if "frames" in entry else ""
        height, width = args.resolution, args.width or args.resolution
        prompt = "make the red circle blue" if "call_image" in entry else "a red circle on the left"
        source = entry["call_image"](height, width, args.condition_size) if "call_image" in entry else ""
        call = (f"pipe({source}prompt={prompt!r}, height={height}, width={width}, {frames}"
                f"num_inference_steps={args.eval_steps}, {entry['call_guidance'](args.guidance)}, "
                f"max_sequence_length={args.max_sequence_length})")
        out += [f"Checkpoint: {ckpt} (continue with --resume {os.path.abspath(run_dir)}); in diffusers:",
                f"  from diffusers import {pipe_cls}, {tr_cls}", f"  {load}"]
        out += ["  source = diffusers.utils.load_image('source.png')  # an image to edit"] if source else []
        out += [f"  video = {call}.frames[0]  # diffusers.utils.export_to_video(video, 'a.mp4', "
                f"fps={args.fps})"] if frames else [f"  image = {call}.images[0]"]
    return "\n".join(out)


# ======== 4. DenseGRPO's psi(t) file ========
def psi_path(args, run_dir: str) -> str:
    """Where --calibrate writes psi(t): --psi-out, else <run dir>/psi.json."""
    return args.psi_out or os.path.join(run_dir, "psi.json")


def save_psi(path: str, *, psi: list, iteration: int, history: list):
    """psi(t) after `iteration` calibration iterations (--calibrate), with psi after each one before it."""
    write_atomically(path, json.dumps({"psi": psi, "num_steps": len(psi), "iteration": iteration,
                                       "history": history}))  # a stopped run never leaves half a file


def load_psi(path: str, num_steps: int) -> list[float]:
    """psi(t) from a JSON file written by --calibrate ({"psi": [...]}, or a bare list), one value per step."""
    try:
        psi = read_json(path)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON, beyond parse_json's bounds
        fail(f"--psi file {path!r} cannot be read as JSON ({type(e).__name__}); write one with --calibrate")
    psi = psi.get("psi") if isinstance(psi, dict) else psi
    if not isinstance(psi, list) or not all(type(p) in (int, float) and 0 <= p <= 10 for p in psi):  # NaN too
        fail(f"--psi {path!r} holds no list of noise levels in [0, 10]; expected {{\"psi\": [one per step]}}")
    if len(psi) != num_steps:
        fail(f"--psi {path!r} has {len(psi)} values; --num-steps {num_steps} needs one per step")
    return [float(p) for p in psi]


# ======== 5. The text cache (--text-cache): each prompt encoded once, no text encoder kept ========
# A file per prompt (its embeddings, a padded one cut to its tokens), the negative prompt's once, and
# meta.json (what the embeddings depend on). Runs of one model and --max-sequence-length share a directory.
def text_cache_file(directory: str, prompt: str) -> str:
    """The file of a prompt's embeddings: a hash of its text and, for an edit, of its source images."""
    name = hashlib.sha256(prompt_key(prompt).encode()).hexdigest()[:40]
    return os.path.join(directory, name + ".safetensors")


def text_fingerprint(pipe, kind: str, max_sequence_length: int, *, edits: bool = False) -> dict:
    """What the embeddings depend on: the family, each text encoder's configuration (a hash), weights
    (weights_fingerprint) and dtype, each tokenizer's class, size and vocabulary (a hash); with `edits` (a
    prompt set with source images) also the VAE's weights and the condition size."""
    encoders = {}
    for name in TEXT_ENCODERS:
        if (encoder := getattr(pipe, name, None)) is not None:
            config = {k: v for k, v in encoder.config.to_dict().items()
                      if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")}
            text = json.dumps(config, sort_keys=True, default=str)
            encoders[name] = {"config": hashlib.sha256(text.encode()).hexdigest(),
                              "weights": weights_fingerprint(encoder), "dtype": str(encoder.dtype)}
    tokenizers = []
    for t in (getattr(pipe, n, None) for n in ("tokenizer", "tokenizer_2", "tokenizer_3")):
        vocab = getattr(t, "tokenizer", t).get_vocab() if t is not None else None  # FLUX.2 [dev]: a processor
        words = hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest()[:16] if vocab else ""
        tokenizers += [f"{type(t).__name__} {len(vocab)} {words}"] if t is not None else []
    meta = {"family": kind, "text_encoders": encoders, "tokenizers": tokenizers,
            "max_sequence_length": max_sequence_length}
    if edits:  # an editing set's rows hold its sources' tokens: the VAE and the size they are encoded at
        meta["condition"] = {"vae": weights_fingerprint(pipe.vae),
                             "condition_size": getattr(pipe, "condition_size", None)}
    return meta


def cache_rows(emb: dict) -> tuple[list[dict], list[str]]:
    """Each row of an embedding dict, its masked embeddings cut to their tokens (mask left out), and the keys
    so cut; the families pad their rows at the end (models.padded)."""
    masked = [k for k in emb if k.endswith("embeds") and k[:-6] + "mask" in emb]
    rows = []
    for i in range(len(next(iter(emb.values())))):
        row = {k: emb[k][i, :int(emb[k[:-6] + "mask"][i].sum())] if k in masked else v[i]
               for k, v in emb.items() if not (k.endswith("mask") and k[:-4] + "embeds" in masked)}
        rows.append({k: v.contiguous().cpu() for k, v in row.items()})
    return rows, masked


def save_row(path: str, row: dict):
    from safetensors.torch import save_file

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file(row, tmp)
        os.replace(tmp, path)
    except Exception as e:  # a full disk, a read-only directory: safetensors says it in words
        why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0][:120]
        fail(f"cannot write the text cache {path!r} ({why}); free space or pass another --text-cache")
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def fill_text_cache(pipe, kind: str, prompts: list[str], *, directory: str, device, max_sequence_length: int,
                    cfg: float):
    """Every prompt not yet in `directory` encoded once (rank r its r-th share, then each rank what it still
    cannot see: a directory local to each node), the text encoders alone on `device`; then they leave the
    pipeline, and encode_prompts reads the files (read_text_cache)."""
    from safetensors.torch import load_file

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    chunk = 16  # prompts per encoder call
    encode = functools.partial(encode_prompts, pipe, kind, max_sequence_length=max_sequence_length, cfg=cfg,
                               device=device)
    unique = list({prompt_key(p): p for p in prompts}.values())  # an instruction over two sources: two
    for name in TEXT_ENCODERS:  # on the device until they are dropped (encode_prompts leaves them there)
        if getattr(pipe, name, None) is not None:
            getattr(pipe, name).to(device)
    rows, masked = cache_rows(encode(unique[:1]))  # which embeddings this run uses, the negative prompt's
    edits = any(getattr(p, "images", ()) for p in unique)
    meta = text_fingerprint(pipe, kind, max_sequence_length, edits=edits)
    negative = os.path.join(directory, "negative")
    meta_path = os.path.join(directory, "meta.json")
    check_text_cache(directory, rows=False)  # never rows without the meta.json that says what made them
    if rank == 0:
        with stop_on_write_error(directory):
            os.makedirs(directory, exist_ok=True)
            if not os.path.exists(meta_path):
                write_atomically(meta_path, json.dumps(meta, indent=1))
    if dist.is_initialized():
        dist.barrier()
    found = read_json(meta_path)  # (checked at the start: check_text_cache)
    if found != meta:
        what = {"family": f"model family ({found.get('family')})", "text_encoders": "text encoder",
                "tokenizers": "tokenizer", "max_sequence_length": f"--max-sequence-length "
                f"({found.get('max_sequence_length')})", "condition": "VAE or --condition-size"}
        differ = [what[k] for k in meta if found.get(k) != meta[k]]
        fail(f"--text-cache {directory!r} holds the embeddings of another {', '.join(differ)}; pass an empty "
             f"or a new directory")
    shared = not edits  # an edit's negative may see its images (Qwen-Image-Edit's): kept in each row
    neg = {k: v for k, v in rows[0].items() if shared and k.startswith("neg_")}  # else kept in each row
    if neg and not os.path.exists(negative + ".safetensors"):
        save_row(negative + ".safetensors", neg)
    for share in (True, False):
        missing = [p for p in unique if not os.path.exists(text_cache_file(directory, p))]
        mine = missing[rank::world] if share else missing
        if share and rank == 0:
            say(f"encoding {len(missing)} prompts into the text cache {directory} "
                f"({len(unique) - len(missing)} there already)")
        for start in progress_bar(iterable=range(0, len(mine), chunk), desc="text cache", inner=True):
            part = mine[start:start + chunk]
            for prompt, row in zip(part, cache_rows(encode(part))[0]):
                save_row(text_cache_file(directory, prompt), {k: v for k, v in row.items()
                                                              if not (shared and k.startswith("neg_"))})
        if share and dist.is_initialized():
            dist.barrier()
    neg = load_file(negative + ".safetensors") if neg else {}
    drop_text_encoders(pipe)
    pipe.text_cache = functools.partial(read_text_cache, directory, masked=masked, negative=neg,
                                        length=max_sequence_length)


def check_text_cache(directory: str, *, rows: bool = True):
    """Before the model loads: a --text-cache directory's meta.json a JSON object of what made the embeddings,
    never embeddings without it (a deleted meta.json would let rows of other settings pass), and with `rows`
    every row whole (its safetensors header, which a cut file or a pickle fails); else one line."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    found, meta = sorted(f for f in names if f.endswith(".safetensors")), os.path.join(directory, "meta.json")
    if found and not os.path.isfile(meta):
        fail(f"--text-cache {directory!r} holds {len(found)} embeddings without the meta.json that says what "
             f"made them; pass an empty or a new directory")
    try:
        ok = not os.path.exists(meta) or {"family", "text_encoders", "max_sequence_length"} <= \
            read_json(meta).keys()
    except (OSError, ValueError, AttributeError):  # unreadable, no JSON, no object
        ok = False
    if not ok:
        fail(f"--text-cache {directory!r}: its meta.json is no text cache's description; pass an empty or a "
             f"new directory")
    for name in found if rows else []:
        try:
            safetensors_header(os.path.join(directory, name))
        except (OSError, ValueError) as e:
            fail(f"--text-cache {directory!r}: {name} is no embedding ({e}); delete it (it is encoded again) "
                 f"or pass another directory")


def read_text_cache(directory: str, prompts: list[str], *, masked: list, negative: dict, length: int) -> dict:
    """encode_prompts' embeddings of `prompts` from the files fill_text_cache wrote (bitwise those of the
    batches that filled it; Qwen-Image's differ from another batching's by ~1e-7: docs/models.md)."""
    from safetensors.torch import load_file

    from models import padded
    rows = []
    for prompt in prompts:
        path = text_cache_file(directory, prompt)
        if not os.path.exists(path):
            fail(f"prompt {prompt[:60]!r} is not in the text cache {directory!r} (a file was removed); run "
                 f"again")
        try:
            rows.append({**load_file(path), **negative})
        except Exception as e:  # damaged since the start (check_text_cache)
            fail(f"--text-cache {directory!r}: {os.path.basename(path)} cannot be read ({type(e).__name__}); "
                 f"delete it (it is encoded again) and resume")
    out = {}
    for k in rows[0]:
        if k in masked:
            out[k], out[k[:-6] + "mask"] = padded([r[k] for r in rows], length)
        else:
            out[k] = torch.stack([r[k] for r in rows])
    return out
