"""The module the algorithm files share: what each of them may treat as a black box, as plain functions, in
the order a port to another code base needs.

0. fail: a one-line error instead of a traceback; parse_json (data from outside, within bounds), shown (a
   value from outside in a message, short and escaped)
1. Samplers, mini-batches and CoCA's credit: shifted_sigmas, dpm2_step (DiffusionNFT's sampler),
   dpm_schedule, dpm_solver (DGPO's), sa_solver_update, sa_solver (AWM's), training_minibatches, rank_chunks,
   micro_batches (each rank's training terms), coca_credit (flow_grpo.py --credit coca; here so that its four
   children need not carry it)
2. Model (what differs between families: models.FAMILIES): load_pipeline, check_guidance, latent_shape,
   pipeline_sigmas, encode_prompts, select, velocity (NFE), velocities, ode_complete, decode, make_trainable,
   shard, gathered, as_reference
3. Rewards and prompts: RewardModels, loggable (secrets hidden), REWARD_FUNCTIONS (JPEG, your own),
   load_rewards (HPS-v2.1, CLIP score, PickScore, ImageReward, aesthetic, UnifiedReward, OCR, GenEval, DeQA:
   rewards.py; the toy world's), score, load_prompt_set
4. Run plumbing: TOY_WORLD, check_common_args, setup_distributed, close_distributed, gather_cat,
   sum_over_ranks, broadcast_object, iteration_generator, optimizer_step, ema_update, swapped_in

What an algorithm is (its policy's log-probability, its advantages, its loss, KL and statistics) is written in
its own file; what a run does around it (setup, logs, evaluation, checkpoints, the summary) is rundir.py's,
which imports this module.
"""
import contextlib
import dataclasses
import gc
import hashlib
import io
import itertools
import json
import math
import os
import re
import reprlib
import sys

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


# ======== 0. Errors and data from outside ========
def fail(message: str):
    """Stop with a one-line error (no traceback): bad input says what was wrong and what is allowed."""
    raise SystemExit(f"error: {message}")


def missing_file(module: str) -> str:
    path = module.replace(".", "/") + ".py"
    return (f"{path} is missing: copy this project's {path} next to common.py as {path} (README: copying one "
            f"file)")


SIBLINGS = ("models", "rundir", "rewards", "toy.world", "toy.proxy")  # this project's modules a copy may lack


def _one_line_errors(kind, value, tb, *, hook=sys.excepthook):
    """An algorithm file copied without rundir.py (imported after this module): one line naming the file; a
    Ctrl-C before a run catches it (rundir.catch_signals): one line, no traceback (exit code 130)."""
    if issubclass(kind, ModuleNotFoundError) and value.name in SIBLINGS:
        print(f"error: {missing_file(value.name)}", file=sys.stderr)
    elif issubclass(kind, KeyboardInterrupt):
        print("\nstopped by SIGINT", file=sys.stderr)
    else:
        hook(kind, value, tb)


sys.excepthook = _one_line_errors
try:
    from models import FAMILIES, family_of
    from models import blocks as family_blocks
    from models import sigmas as family_sigmas
except ModuleNotFoundError as e:
    if e.name != "models":
        raise
    fail(missing_file("models"))


JSON_DEPTH, JSON_DIGITS = 32, 64  # outside JSON: nested arrays / objects, an integer's digits (parse_json)


def parse_json(data: str | bytes, *, limit: int = 1 << 20, depth: int = JSON_DEPTH):
    """JSON from outside (a file, a server, a prompt row) within `limit` bytes, `depth` levels and integers of
    JSON_DIGITS digits, checked before json.loads recurses or converts, else ValueError (copy: rewards.py)."""
    if len(data) > limit:
        raise ValueError(f"{len(data):,} bytes, more than {limit:,}")
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    bare = re.sub(r'"[^"]*"', "", re.sub(r"\\.", "", text, flags=re.S))  # escapes, then strings out
    brackets = re.sub(r"[^][{}]", "", bare)
    if max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0) > depth:
        raise ValueError(f"nested deeper than {depth} levels")
    return json.loads(text, parse_int=_bounded_int)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > JSON_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-')):,} digits, more than {JSON_DIGITS}")
    return int(digits)


def shown(value) -> str:
    """A value from outside (text, bytes, parse_json's values) for a message: reprlib's short repr, at most
    160 characters, control characters escaped: no terminal escape sequence reaches the screen."""
    text = reprlib.repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


# ======== 1. Samplers, mini-batches, CoCA's credit (torch only) ========
def shifted_sigmas(num_steps: int, *, shift: float) -> torch.Tensor:
    """DanceGRPO's (G2RPO's, MixGRPO's) schedule: shift u / (1 + (shift - 1) u), u = linspace(1, 0, T + 1)."""
    u = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
    return (shift * u / (1 + (shift - 1) * u)).float()


def dpm2_step(v, x, sigmas, i: int, *, x0_prev=None):
    """One step sigmas[i] -> sigmas[i + 1] of DiffusionNFT's deterministic "dpm2" sampler (solver.py):
    DPM-Solver++(2M) on x0 = x - sigma v, lambda = log((1 - sigma) / sigma); first order (DDIM with eta 0,
    i.e. the Euler step) without `x0_prev` (the previous step's x0), after sigma = 1, and into sigma = 0.
    Returns (x_next, x0), float32."""
    s, t = float(sigmas[i]), float(sigmas[i + 1])
    x, x0 = x.float(), x.float() - s * v.float()
    if x0_prev is None or t == 0 or float(sigmas[i - 1]) == 1:  # D1 = (m0 - m1) / r0 is 0 after sigma = 1
        return t / s * x + (1 - t / s) * x0, x0
    lam = [math.log((1 - u) / u) for u in (float(sigmas[i - 1]), s, t)]
    h, r0 = lam[2] - lam[1], (lam[1] - lam[0]) / (lam[2] - lam[1])
    d = x0 + 0.5 * (x0 - x0_prev) / r0  # D0 + D1 / 2
    return t / s * x - (1 - t) * math.expm1(-h) * d, x0


def dpm_schedule(num_steps: int, *, shift: float):
    """The rollout's schedule (train_sd3_dgpo.py:557-559: Sana's DPMSolverMultistepScheduler, flow sigmas,
    flow_shift): u = 1 - linspace(1, 1/1000, T + 1), sigma = shift u / (1 + (shift - 1) u) from the largest,
    the last (0) dropped and 0 appended (float32 [T + 1]); and the noise levels the model sees there and in
    training, the scheduler's int64 timesteps / 1000 (floor(1000 sigma) / 1000, train:852, 1099-1100; [T])."""
    u = 1 - np.linspace(1, 1 / 1000, num_steps + 1)
    s = np.flip(shift * u / (1 + (shift - 1) * u))[:-1]
    return torch.tensor(np.append(s, 0.0), dtype=torch.float32), torch.tensor(
        (s * 1000).astype(np.int64) / 1000, dtype=torch.float32)


def dpm_solver(velocity_fn, x, sigmas, model_sigmas):
    """DGPO's rollout (sd3_pipeline_with_logprob.py:142-202, scheduler.step): DPM-Solver++(2M) on data
    predictions, first order at the first and the last step (to sigma = 0: the last data prediction), the
    model evaluated at model_sigmas, the steps taken at sigmas; T evaluations, float32."""
    x0 = None
    for i in range(len(sigmas) - 1):
        x, x0 = dpm2_step(velocity_fn(x, model_sigmas[i]), x, sigmas, i, x0_prev=x0)
    return x


def sa_solver_update(x, x0s, times, t: float, tau: float, noise, *, corrector: bool = False):
    """One SA-Solver update (Xue et al., 2023; AWM's sa_solver.py, data prediction, the few-step order-2
    term) from times[-1] = s to t of flow matching (alpha = 1 - t, sigma = t, lambda = log(alpha / sigma)):
    x0s are the data predictions, newest first, at times[-1], times[-2], ... (corrector: at t, then
    times[-1], ...), order len(x0s) <= 2; tau the stochasticity (0: an ODE step, `noise` unused)."""
    lam = lambda u: math.log((1 - u) / u)  # noqa: E731
    s, k = float(times[-1]), 1 + tau**2
    ls, lt = lam(s), lam(float(t))
    h = lt - ls
    e0 = math.exp(k * lt) * (1 - math.exp(-k * h)) / k  # int_ls^lt e^{k l} dl, and l e^{k l} below
    coefs = [e0]
    if len(x0s) == 2:
        e1 = math.exp(k * lt) * ((k * lt - 1) - (k * ls - 1) * math.exp(-k * h)) / k**2
        l0, l1 = (lt, ls) if corrector else (ls, lam(float(times[-2])))  # the interpolation nodes
        coefs = [(e1 - l1 * e0) / (l0 - l1), (e1 - l0 * e0) / (l1 - l0)]
        extra = h / 2 - (h * k - 1 + math.exp(-k * h)) / (k**2 * h) if corrector else \
            (h**2 / 2 - (h * k - 1 + math.exp(-k * h)) / k**2) / (l0 - l1)
        coefs = [coefs[0] + math.exp(k * lt) * extra, coefs[1] - math.exp(k * lt) * extra]
    out = math.exp(-tau**2 * h) * (float(t) / s) * x.float()
    for c, x0 in zip(coefs, x0s):
        out = out + k * float(t) * math.exp(-tau**2 * lt) * c * x0.float()
    if tau > 0:
        out = out + float(t) * math.sqrt(1 - math.exp(-2 * tau**2 * h)) * noise.float()
    return out


def sa_solver(velocity_fn, x, sigmas, *, noise_level: float = 0.0, generator=None):
    """AWM's rollout sampler (sd3_pipeline_with_logprob.py) on a schedule sigmas[0] = 1, ..., 0: the grid
    with times[-2] = times[-3] / 2 and times[0] = 1 - 1e-3, SA-Solver with data prediction x0 = x - t v,
    predictor order 2 (1 at the first step), corrector order 2 (none at the first step), PEC (the corrected
    point is not re-evaluated), stochasticity tau = noise_level on the steps to 0.3 <= t <= 0.9 (0: an ODE),
    and a last step to 0 that returns the newest x0 without a model call: len(sigmas) - 1 evaluations."""
    times = sigmas.clone()
    if len(times) > 2:
        times[-2] = times[-3] / 2
    times[0] = 1 - 1e-3
    tau = lambda t: noise_level if 0.3 <= t <= 0.9 else 0.0  # noqa: E731
    ts, x = [float(times[0])], x.float()
    x0s = [x - ts[0] * velocity_fn(x, times[0]).float()]  # newest last
    for k in range(1, len(times) - 1):
        t = float(times[k])
        noise = None
        if tau(t) > 0:
            where = generator.device if generator else x.device
            noise = torch.randn(x.shape, generator=generator, device=where).to(x.device)
        x_p = sa_solver_update(x, x0s[::-1][:2], ts, t, tau(t), noise)  # predict
        x0s.append(x_p - t * velocity_fn(x_p, times[k]).float())  # evaluate
        x = sa_solver_update(x, x0s[::-1][:2], ts, t, tau(t), noise, corrector=True) if k > 1 else x_p
        ts, x0s = (ts + [t])[-2:], x0s[-2:]
    return x0s[-1]  # denoise to zero


def training_minibatches(advantages, *, updates: int, micro_batches: int, generator):
    """Flow-GRPO's trained samples (train_sd3.py): of all ranks' advantages [trained steps, N], samples zero
    at every step dropped, random dropped ones put back until `micro_batches` divides the number kept,
    shuffled into `updates` mini-batches of indices. One generator on all ranks: 1 and N ranks agree."""
    keep = (advantages.abs().sum(0) != 0).cpu()  # CPU indices: they select CPU tensors too (prompt rows)
    short, dropped = -int(keep.sum()) % micro_batches, torch.where(~keep)[0]
    if 0 < short <= len(dropped):
        keep[dropped[torch.randperm(len(dropped), generator=generator)[:short]]] = True
    kept = torch.where(keep)[0]
    return list(kept[torch.randperm(len(kept), generator=generator)].tensor_split(updates))


def rank_chunks(minibatch, *, rank: int, world: int, per_rank: int, micro_batch: int, sharded: bool) -> list:
    """This rank's part of a mini-batch of indices over all ranks (rank r holds r * per_rank, ...): [(local
    indices, at most `micro_batch`; their weight in the mini-batch's mean times the world size, as gradients
    are averaged over ranks)]. Sharded runs add weight-0 forwards up to the busiest rank's."""
    local = minibatch[minibatch // per_rank == rank] - rank * per_rank
    chunks = [(c, len(c) * world / len(minibatch)) for c in local.split(micro_batch) if len(c)]
    if sharded:
        most = -(-int(torch.bincount(minibatch // per_rank, minlength=world).max()) // micro_batch)
        chunks += [(torch.zeros(1, dtype=torch.long), 0.0)] * (most - len(chunks))
    return chunks


def micro_batches(minibatch, *, steps, part: dict, signal=None, trains=None) -> list:
    """This rank's training terms of a mini-batch of sample indices over all ranks (rank r holds r * per_rank,
    ...), in the order they train: [(j, c, scale)] for each step j of `steps` and each of this rank's
    micro-batches (at most part["micro_batch"] samples), c the local rows that train step j (those with
    trains[c, j] when a mask is given), scale their share of the mean over the mini-batch's terms times the
    world size (the ranks' gradients are averaged). A term whose signal(j, c) is false has no gradient (no
    advantage and no KL): it is left out, or, sharded, kept at scale 0, as are the forwards that bring a
    sharded rank up to the busiest rank's count: every rank joins FSDP2's collectives alike."""
    chunks = rank_chunks(minibatch, **part)
    per_sample = len(steps) if trains is None else int(trains[:, steps].sum(1).max())  # terms per sample
    terms = []
    for j in steps:
        for c, weight in chunks:
            c = c if trains is None or weight == 0 else c[trains[c, j]]
            if not len(c):
                continue
            useful = weight > 0 and (signal is None or bool(signal(j, c)))
            if useful and trains is None:
                terms.append((j, c, weight / per_sample))
            elif useful:  # rows / this rank's terms, rounded in float32 as DanceGRPO's (loss * rows) / terms
                per_rank_terms = len(minibatch) // part["world"] * per_sample
                terms.append((j, c, float(torch.ones(()) / per_rank_terms * len(c))))
            elif part["sharded"]:
                terms.append((j, c, 0.0))
    return terms


def coca_credit(advantages, x0_hats, final, *, window: int, alpha: float, group_size: int, trained: int):
    """CoCA's step credit (Liao et al., 2025; scripts/train_coca.py) of the terminal advantages A [N]: c_k =
    cos(x0_hat_k, final) for the T steps, c_T = 1; window means m_j of c_1..c_T; gains g_0 = m_0 - c_0, g_j =
    m_j - m_{j-1}; w_k = g_{k // window} / (window sum_j g_j) (they sum to 1); s_k = sum_{k' >= k} w_k'; R_k =
    A (alpha + (1 - alpha) s_k), z-scored per group over its samples and first `trained` steps. [T, N]"""
    T, N = x0_hats.shape[:2]
    flat = x0_hats.reshape(T, N, -1).double()
    c = torch.nn.functional.cosine_similarity(flat, final.reshape(1, N, -1).double(), dim=-1)
    c = torch.cat([c, torch.ones(1, N, dtype=c.dtype, device=c.device)])  # c_T = 1
    means = c[1:].view(T // window, window, N).mean(1)  # m_j
    gains = means - torch.cat([c[:1], means[:-1]])  # g_0 = m_0 - c_0, g_j = m_j - m_{j-1}
    total = gains.sum(0)
    uniform = total.abs() < 1e-12  # a zero sum (unguarded in CoCA's code): uniform weights 1 / T
    w = torch.where(uniform, 1 / T, gains / (window * total)).repeat_interleave(window, dim=0)  # [T, N]
    s = w.flip(0).cumsum(0).flip(0)  # the credit to go
    r = advantages.double() * (alpha + (1 - alpha) * s)
    groups = r[:trained].reshape(trained, -1, group_size)
    mean = groups.mean(dim=(0, 2), keepdim=True)
    std = groups.std(dim=(0, 2), keepdim=True, unbiased=False)
    return ((r.reshape(T, -1, group_size) - mean) / (std + 1e-6)).reshape(T, N).float()


# ======== 2. Model: loading, prompts, velocity (with an NFE counter), decoding, training setup ========
# What differs between model families (FLUX.1, SD3, Qwen-Image, FLUX.2, Z-Image) is in models.FAMILIES[kind];
# the functions here are the same for every family and look its entry up by the `kind` load_pipeline returns.
MODEL_ALIASES = {"toy": os.path.join(HERE, "toy", "flux-shapes"),  # short --model names
                 "toy-video": os.path.join(HERE, "toy", "wan-shapes"),
                 "toy-edit": os.path.join(HERE, "toy", "flux-kontext-shapes"),
                 **{a: hub for f in FAMILIES.values() for a, hub in f["aliases"].items()}}
NFE = {"count": 0}  # per-sample transformer evaluations (a CFG pair counts once), counted in velocity()


def load_pipeline(model: str, device, *, dtype=torch.float32):
    """A pipeline of a family in models.FAMILIES from an alias in MODEL_ALIASES, a local directory or a hub
    id: (pipe, its family's key). The text encoders wait on the CPU between encodings (T5-XXL: 9.5 GiB)."""
    from diffusers import DiffusionPipeline
    path = MODEL_ALIASES.get(model, model)
    hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)
    if model in ("toy", "toy-video", "toy-edit") and not os.path.isdir(path):
        fail(f"the toy model is not at {path!r}: copy this project's toy/{os.path.basename(path)} there "
             f"(README: copying one file), or pass --model <a pipeline directory>")
    if not os.path.isdir(path) and not hub_id:
        fail(f"model path {model!r} does not exist; pass a local pipeline directory, a hub id (owner/name) "
             f"or one of {sorted(MODEL_ALIASES)}")
    import diffusers.utils.logging
    import transformers.utils.logging
    diffusers.utils.logging.disable_progress_bar()  # "Loading pipeline components": the training bar is read
    transformers.utils.logging.disable_progress_bar()  # "Loading weights"
    try:
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    except Exception as e:  # offline hub id, broken directory, ...
        if hub_id:
            fail(f"model {model!r} is no local directory, and no hub model that could be loaded "
                 f"({type(e).__name__}: offline, or no such model); pass a local pipeline directory")
        fail(f"cannot load model {model!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    kind = family_of(pipe)
    if kind is None:
        known = [c for f in FAMILIES.values() for c in f["pipelines"]]
        fail(f"model {model!r} is a {type(pipe).__name__}; the pipelines this project trains are "
             f"{', '.join(known)} (docs/models.md: adding a family)")
    pipe.set_progress_bar_config(disable=True)
    place(pipe, device)
    return pipe, kind


TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def drop_text_encoders(pipe):
    """The text encoders out of the pipeline and out of memory (every embedding the run needs is computed)."""
    for name in TEXT_ENCODERS:
        if getattr(pipe, name, None) is not None:
            setattr(pipe, name, None)
    gc.collect()


def place(pipe, device):
    """The transformer and the VAE on `device`, frozen; the text encoders on the CPU (they visit `device` in
    encode_prompts)."""
    for name in ("vae", *TEXT_ENCODERS, "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.requires_grad_(False).eval().to("cpu" if name in TEXT_ENCODERS else device)


def check_guidance(pipe, kind: str, guidance: float):
    """A --guidance that the model would ignore (a step-distilled FLUX.2 [klein], FLUX.1 [schnell]) is a
    one-line error: the run would not sample what it says."""
    if FAMILIES[kind]["guidance"](pipe) == "none" and guidance != 1:
        fail(f"--guidance {guidance} is ignored by this {type(pipe).__name__} (guidance-distilled: no "
             f"guidance input and no CFG); pass --guidance 1")


def latent_shape(pipe, kind: str, resolution: int, *, width: int | None = None,
                 frames: int | None = None) -> tuple:
    """A sample's latent shape: (C, H, W) of an image `resolution` high and `width` (none: as high) wide, or
    (C, F, H, W) where the family has frames (its entry's "frames"); else a one-line error."""
    entry = FAMILIES[kind]
    shape = entry["latent"](pipe, resolution if width in (None, resolution) else (resolution, width))[0]
    if "frames" not in entry:
        if frames not in (None, 1):
            fail(f"--num-frames {frames} is not allowed for this {type(pipe).__name__} (it samples images); "
                 f"pass --num-frames 1, or a video model")
        return shape
    return (shape[0], entry["frames"](pipe, frames), *shape[1:])


def pipeline_sigmas(pipe, kind: str, *, num_steps: int, shape: tuple) -> torch.Tensor:
    """The noise levels the pipeline itself samples with for latents of `shape`, then 0 (Flow-GRPO, DenseGRPO,
    every evaluation): its scheduler's copy set as its __call__ sets it (SD3 `set_timesteps(T)`; FLUX.1,
    Qwen-Image, FLUX.2, Z-Image: linspace(1, 1/T, T) with the family's mu), the pipeline's state untouched."""
    return family_sigmas(pipe, kind, num_steps=num_steps, latent=shape)


@torch.no_grad()
def encode_prompts(pipe, kind: str, prompts: list[str], *, max_sequence_length: int, cfg: float = 1.0,
                   chunk: int = 16, device=None) -> dict:
    """Text embeddings of each prompt (index them to repeat a prompt for its group), `chunk` prompts at a
    time, with the negative prompt's where `cfg` (--guidance) turns true CFG on; the text encoders visit
    `device` (default: the transformer's) once per call. A pipeline with a text cache (--text-cache,
    rundir.fill_text_cache) reads them from disk instead."""
    device = device or pipe.transformer.device
    if getattr(pipe, "text_cache", None) is not None:
        return {k: v.to(device) for k, v in pipe.text_cache(prompts).items()}
    encoders = [getattr(pipe, n) for n in TEXT_ENCODERS if getattr(pipe, n, None) is not None]
    visiting = [m for m in encoders if m.device != torch.device(device)]  # back to the CPU afterwards
    for m in visiting:
        m.to(device)
    try:
        parts = [FAMILIES[kind]["encode"](pipe, prompts[start:start + chunk], guidance=cfg, device=device,
                                          max_sequence_length=max_sequence_length)
                 for start in range(0, len(prompts), chunk)]
        return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    finally:
        for m in visiting:
            m.to("cpu")


def select(emb: dict, index) -> dict:
    """Rows `index` of every tensor of an embedding dict (e.g. each prompt repeated for its group)."""
    return {k: v[index] for k, v in emb.items()}


def velocity(transformer, kind: str, x, sigma, emb: dict, *, guidance: float, detach_uncond: bool = False):
    """The model's velocity v(x, sigma) = dx/dsigma for latents x [B, C, H, W] at noise levels sigma (the
    family's packing, position ids, timestep convention and guidance: models.FAMILIES). With true CFG the
    gradient flows through both predictions, unless `detach_uncond` (Flow-GRPO's code before 2025-08-19)."""
    NFE["count"] += x.shape[0]
    t = torch.as_tensor(sigma, dtype=torch.float32).to(x.device).expand(x.shape[0]).contiguous()  # not bf16
    return FAMILIES[kind]["velocity"](transformer, x, t, emb, guidance=guidance, detach_uncond=detach_uncond)


def velocities(transformer, kind: str, x, sigma, emb: dict, *, rows, chunks, guidance: float):
    """velocity() of every row of x, one forward per chunk of rows; row n uses embedding emb[rows[n]]."""
    return torch.cat([velocity(transformer, kind, x[c], sigma, select(emb, rows[c]), guidance=guidance)
                      for c in chunks])


@torch.no_grad()
def ode_complete(transformer, kind: str, x, paths: list, sigmas, emb: dict, *, guidance: float,
                 micro_batch: int, v_first=None, emb_index=None, progress=None):
    """Euler ODE from each x[n] (embedding emb_index[n], default n) along schedule indices paths[n + k N]; a
    start's velocity is evaluated once (or `v_first`) for all its paths, later steps batch all moving rows.
    `progress()` is called after each step."""
    n, reps = len(x), len(paths) // len(x)
    start = torch.arange(n).repeat(reps)  # row -> its start
    emb_index = torch.arange(n) if emb_index is None else emb_index.cpu()

    def v_of(xs, s, e):  # velocity() of rows xs, micro_batch at a time; row j: sigma s[j], embedding row e[j]
        chunks = torch.arange(len(xs)).split(micro_batch)
        return torch.cat([velocity(transformer, kind, xs[c], s[c], select(emb, e[c].to(xs.device)),
                                   guidance=guidance).float() for c in chunks])
    if v_first is None and max(map(len, paths)) > 1:
        v_first = v_of(x, sigmas[[p[0] for p in paths[:n]]], emb_index)
    x = x.float().repeat(reps, *[1] * (x.ndim - 1))
    for k in range(max(map(len, paths)) - 1):
        live = [r for r, p in enumerate(paths) if len(p) > k + 1]
        rows = torch.tensor(live, dtype=torch.long)
        s = sigmas[[paths[r][k] for r in live]]
        ds = (sigmas[[paths[r][k + 1] for r in live]] - s).to(x.device).view(-1, *[1] * (x.ndim - 1))
        v = v_first[start[rows]].float() if k == 0 else v_of(x[rows], s, emb_index[start[rows]])
        x[rows] = x[rows] + v * ds  # Euler step dx = v dt
        if progress:
            progress()
    return x


@torch.no_grad()
def decode(pipe, latents, *, batch: int = 4) -> torch.Tensor:
    """Latents -> float images in [0, 1], [B, 3, H, W] (the family's VAE); on a GPU `batch` at a time."""
    decode_fn = FAMILIES[family_of(pipe)]["decode"]
    parts = latents.split(batch if latents.is_cuda else len(latents))
    images = torch.cat([decode_fn(pipe, z) for z in parts])
    return ((images.float() + 1) / 2).clamp(0, 1)


def make_trainable(transformer, kind: str, *, lora: tuple | None, reference: bool, sharded: bool = False,
                   compute_dtype=None, checkpointing: bool = False):
    """LoRA (peft, gaussian init; `lora` = (rank, alpha)) on the attention (Flux: and MLP) projections, or
    with `lora` None full fine-tuning. Returns ({name: trainable float32 parameter}, with `reference` and full
    fine-tuning a frozen copy of the initial transformer, else None). `sharded`: FSDP2 for both, float32
    master weights from the local shards. `checkpointing`: per-block activation checkpointing."""
    import copy
    full_finetune = lora is None
    ref = copy.deepcopy(transformer).requires_grad_(False) if reference and full_finetune else None
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    if full_finetune:
        transformer.requires_grad_(True)
    else:
        from peft import LoraConfig
        targets = FAMILIES[kind]["lora_targets"](transformer)
        names = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
        absent = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if len(absent) == len(targets):  # some may be absent (SD3's last block has no to_add_out), not all
            fail(f"none of the LoRA targets {absent} is a linear layer of this {type(transformer).__name__}; "
                 f"its family's lora_targets (models.py) must name layers it has")
        transformer.add_adapter(LoraConfig(r=lora[0], lora_alpha=lora[1], init_lora_weights="gaussian",
                                           target_modules=targets))
    if sharded:
        for model in [m for m in (transformer, ref) if m is not None]:
            shard(model, param_dtype=compute_dtype)
        transformer.float()  # each rank's shards only
    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    if not sharded:
        for p in params.values():
            p.data = p.data.float()
    return params, ref


def transformer_blocks(model) -> list:
    """The blocks of a family's transformer, in order (FSDP2's units)."""
    return family_blocks(model)


def shard(model, *, param_dtype=None, mesh=None):
    """FSDP2: a fully_shard per block, then the root; forwards gather `param_dtype` (bf16) weights, gradients
    reduce in float32. Only the root casts forward inputs: blocks see RoPE and time embedding as unsharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = {"param_dtype": param_dtype, "reduce_dtype": torch.float32}
    blocks = MixedPrecisionPolicy(**policy, cast_forward_inputs=False)
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=blocks, mesh=mesh)
    # the root reshards after forward too (FSDP2 keeps it gathered by default): weights swapped into the
    # shards (common.swapped_in: an old policy) reach every forward
    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy), mesh=mesh, reshard_after_forward=True)


GATHER_SHARE = 1 / 3  # of a GPU's memory that a sharded transformer's gathered weights may take (gathered)


def fits_gathered(transformer) -> bool:
    """Whether a sharded transformer's whole bf16 weights take at most GATHER_SHARE of its GPU (FLUX.1-dev's
    22 GiB on an 80 GB card do, Qwen-Image's 38 GiB do not); on a CPU, always."""
    device = next(transformer.parameters()).device
    if device.type != "cuda":
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    return 2 * sum(p.numel() for p in transformer.parameters()) <= GATHER_SHARE * total


@contextlib.contextmanager
def gathered(transformer, *, sharded: bool):
    """A sharded transformer's blocks kept gathered over no-grad forwards (a rollout), resharded after; a
    model too large for that (fits_gathered) gathers each block in each forward, FSDP2's default."""
    blocks = transformer_blocks(transformer) if sharded and fits_gathered(transformer) else []
    for b in blocks:
        b.set_reshard_after_forward(False)
        b.unshard()
    try:
        yield
    finally:
        for b in blocks:
            b.reshard()
            b.set_reshard_after_forward(True)


def forget_forwards(model):
    """Clear FSDP2's record of forwards (for the next backward's prefetching): a reference model never runs
    backward, so its record would grow by an entry per block and forward all run long."""
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    if state is None or state._comm_ctx is None:
        return
    state._comm_ctx.post_forward_order.clear()
    for module in [model, *transformer_blocks(model)]:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            group._post_forward_indices.clear()


@contextlib.contextmanager
def as_reference(transformer, frozen=None):
    """The reference (pre-RL) model: a full fine-tune's frozen copy, else the transformer with LoRA off."""
    if frozen is None:
        transformer.disable_adapters()
    try:
        yield transformer if frozen is None else frozen
    finally:
        if frozen is None:
            transformer.enable_adapters()
        else:
            forget_forwards(frozen)


# ======== 3. Rewards (each fn(images [B, 3, H, W] in [0, 1], prompts) -> float32 [B]) and prompts ========
def frame_indices(reduce: str, frames: int) -> list[int]:
    """The frames --frame-reduce `reduce` (first, mean or stride:K; check_frame_reduce) scores of `frames`."""
    return list(range(0, frames, frames if reduce == "first" else 1 if reduce == "mean" else int(reduce[7:])))


def check_frame_reduce(reduce: str):
    if not re.fullmatch(r"first|mean|stride:[1-9][0-9]*", reduce):
        fail(f"--frame-reduce {reduce!r} is not allowed; use first, mean or stride:K (K >= 1)")


def per_frame(fn, reduce: str):
    """An image reward fn(images [B, 3, H, W], prompts) that scores videos [B, 3, F, H, W] too: the mean of
    its scores of the frames `reduce` picks (frame_indices), each frame with its video's prompt; images as
    they are. GenEval's evaluation dicts are averaged key by key."""
    def scored(images, prompts, **kwargs):
        if images.ndim != 5:
            return fn(images, prompts, **kwargs)
        b, c, f, h, w = images.shape
        index = frame_indices(reduce, f)
        frames = images[:, :, index].transpose(1, 2).reshape(b * len(index), c, h, w)
        r = fn(frames, [p for p in prompts for _ in index], **kwargs)
        mean = lambda t: t.float().view(b, len(index)).mean(1)  # noqa: E731
        return {k: mean(v) for k, v in r.items()} if isinstance(r, dict) else mean(r)
    scored.__dict__.update(fn.__dict__)  # GenEval's evaluation and breakdown
    return scored


@dataclasses.dataclass
class RewardModels:
    """Where the reward models come from: local paths, or hub ids when the machine is online."""

    hps_checkpoint: str = "xswu/HPSv2:HPS_v2.1_compressed.pt"
    """HPS-v2.1: a local HPS_v2.1_compressed.pt or a hub file (repo:filename)"""
    clip_model: str = "hf-hub:apple/DFN5B-CLIP-ViT-H-14-384"
    """CLIP score: a local open_clip directory (open_clip_config.json and weights) or hf-hub:..."""
    pickscore_model: str = "yuvalkirstain/PickScore_v1"
    """PickScore: a transformers CLIPModel directory or hub id"""
    pickscore_processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    """PickScore: its processor's directory or hub id"""
    imagereward_checkpoint: str = "THUDM/ImageReward:ImageReward.pt"
    """ImageReward: a local ImageReward.pt or a hub file"""
    imagereward_med_config: str = "THUDM/ImageReward:med_config.json"
    """ImageReward: its BERT configuration med_config.json, a local file or a hub file"""
    imagereward_tokenizer: str = "bert-base-uncased"
    """ImageReward: a BERT tokenizer directory or hub id"""
    aesthetic_head: str = "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth"
    """aesthetic: the LAION predictor's head, a local .pth or a hub file"""
    aesthetic_clip: str = "openai/clip-vit-large-patch14"
    """aesthetic: the CLIP ViT-L/14 whose image embedding it scores (a directory or hub id)"""
    unifiedreward_url: str | None = None
    """UnifiedReward: an OpenAI-compatible server (sglang, vLLM) serving it, e.g. http://127.0.0.1:17140"""
    unifiedreward_model: str = "UnifiedReward-7b-v1.5"
    """UnifiedReward: the model name that server serves"""
    unifiedreward_api_key: str | None = None
    """UnifiedReward: the server's --api-key, if it has one (none: $UNIFIEDREWARD_API_KEY); never logged"""
    geneval_url: str = "http://127.0.0.1:18085"
    """GenEval: Flow-GRPO's reward server (github.com/yifan123/reward-server, app_geneval)"""
    deqa_url: str = "http://127.0.0.1:18086"
    """DeQA-Score: the same reward server (app_deqa)"""
    editreward_url: str = "http://127.0.0.1:18088"
    """editreward: a server of an edit-judge VLM (EditReward, EditScore) that scores an edit from its
    instruction, source and result (docs/editing.md: the protocol)"""
    similarity_clip: str = "openai/clip-vit-large-patch14"
    """image_similarity: the transformers CLIPModel whose image features compare an edit with its source"""
    videoalign_url: str = "http://127.0.0.1:18087"
    """VideoAlign (KwaiVGI/VideoReward): a reward server that scores videos (docs/video.md: the protocol)"""
    frame_reduce: str = "mean"
    """the frames of a video that an image reward scores, averaged: first (DanceGRPO's Wan script, UniRL),
    mean (all: Flow-Factory) or stride:K (every K-th from the first: verl-omni's K = 4)"""
    reward_timeout: float = 600.0
    """reward servers (unifiedreward, geneval, deqa): seconds a batch of images may take, every request and
    retry included; a server still silent or still sending then stops the run in one line"""
    reward_retries: int = 3
    """reward servers: tries after the first when a connection is refused, reset or cut short, 120 s pass
    without a byte, or the answer is HTTP 5xx / 429 (0.5, 1, 2 s apart)"""


SECRETS = ("unifiedreward_api_key",)  # RewardModels fields never written to a log, a checkpoint or the screen


def loggable(args) -> dict:
    """The arguments as JSON-ready values (tuples as lists) for logs and checkpoints, every secret hidden."""
    config = json.loads(json.dumps(dataclasses.asdict(args)))
    models = config.get("reward_models", {})
    for key in SECRETS:
        models[key] = "<hidden>" if models.get(key) else models.get(key)
    return config


LEARNED = ["hps", "clip", "pickscore", "imagereward", "aesthetic", "unifiedreward", "ocr", "geneval",
           "deqa", "videoalign_vq", "videoalign_mq", "videoalign_ta",
           "image_similarity", "editreward"]  # rewards.py's models and clients
TOY_REWARDS = ["toy_color_position", "toy_shape_count", "toy_strict",  # toy/world.py's exact rewards
               "toy_proxy"]  # and the learned proxy of the first two (toy/proxy.py)
VIDEO_TOY_REWARDS = ["toy_frame", "toy_frame_first", "toy_frame_mean", "toy_motion", "toy_consistency",
                     "toy_video_strict"]  # the moving-shapes world's (toy/video_world.py)
EDIT_TOY_REWARDS = ["toy_edit", "toy_preserve", "toy_edit_strict"]  # the editing world's (toy/edit_world.py)


def import_sibling(name: str):
    """A module of this project ("rewards", "toy.world"), or a one-line error saying what to copy."""
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in (name, name.split(".")[0]):
            raise  # a package that module needs: its own message is the right one
        fail(missing_file(name))


def check_rewards(names, models: RewardModels):
    """Unknown reward names, missing reward model files (rewards.check): one-line errors before loading."""
    for name in names:
        known = LEARNED + list(REWARD_FUNCTIONS) + TOY_REWARDS + VIDEO_TOY_REWARDS + EDIT_TOY_REWARDS
        if name not in known:
            fail(f"unknown reward {name!r}; choose from {known}")
        if name in LEARNED:
            import_sibling("rewards").check(name, models)


def jpeg_compressibility(images, prompts):
    """-(JPEG quality-95 size in kB) / 500, as in Flow-GRPO (smaller files score higher)."""
    from PIL import Image
    sizes = []
    for img in (images.detach().float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return -torch.tensor(sizes) / 500


# Rewards that are plain functions of images and prompts: {name: fn(images [B, 3, H, W] in [0, 1], prompts) ->
# [B]}. Add your own here, or from a launcher script before the algorithm file runs (docs/rewards.md).
REWARD_FUNCTIONS = {"jpeg": jpeg_compressibility}


def load_rewards(names, device, *, models: RewardModels, dtype=torch.float32, fps: int = 16) -> dict:
    """{name: fn(images, prompts) -> float32 [B]} for each named reward, loaded once: the towers held and run
    in `dtype` (bf16 on GPUs), every projection, scale and head in float32 (docs/rewards.md: precision). An
    image reward scores a video's frames as models.frame_reduce says (per_frame); a video reward (fn.video:
    VideoAlign, the moving-shapes world's) gets the whole clip, and VideoAlign its `fps`."""
    check_rewards(names, models)
    out = {}
    for name in dict.fromkeys(names):
        if name in LEARNED:  # the reward models' ports live in rewards.py (docs/contributing.md: layout)
            rewards = import_sibling("rewards")
            out[name] = rewards.load(name, device, models=models, dtype=dtype, fps=fps)
        elif name in REWARD_FUNCTIONS:
            out[name] = REWARD_FUNCTIONS[name]
        elif name == "toy_proxy":  # the toy world's learned proxy (toy/proxy.py), its weights checked now
            out[name] = import_sibling("toy.proxy").load_reward(device)
        elif name in EDIT_TOY_REWARDS:  # the editing world's exact rewards (toy/edit_world.py)
            world = import_sibling("toy.edit_world")
            strict = {"toy_edit_strict": "toy_edit_strict_accuracy"}
            out[name] = getattr(world, strict.get(name, name + "_reward"))
        elif name in VIDEO_TOY_REWARDS:  # the moving-shapes world's exact rewards (toy/video_world.py)
            world = import_sibling("toy.video_world")
            strict = {"toy_video_strict": "toy_video_strict_accuracy"}
            out[name] = getattr(world, strict.get(name, name + "_reward"))
        else:  # the toy world's exact rewards (toy/world.py)
            world = import_sibling("toy.world")
            out[name] = getattr(world, {"toy_strict": "toy_strict_accuracy"}.get(name, name + "_reward"))
        if not getattr(out[name], "video", False):
            out[name] = per_frame(out[name], models.frame_reduce)
    return out


@torch.no_grad()
def score(rewards: dict, images, prompts, *, evaluation: bool = False) -> dict:
    """{name: float tensor [B] on the CPU}; a NaN or infinite reward is an error, never trained on. With
    `evaluation`, a reward with fn.evaluation (GenEval) is called so and may add metrics: {name: [B], ...}."""
    if not torch.isfinite(images).all():  # not the rewards' fault
        fail("the sampled images are not finite (NaN): sampling diverged; lower --noise-level (or psi), or "
             "--learning-rate if it happened after some updates")
    out = {}
    for name, fn in rewards.items():
        if getattr(fn, "video", False) and images.ndim != 5:
            fail(f"reward {name!r} scores videos; this model samples images (pass a video model, e.g. Wan)")
        r = fn(images, prompts, evaluation=True) if evaluation and getattr(fn, "evaluation", False) else \
            fn(images, prompts)
        for key, r in (r if isinstance(r, dict) else {name: r}).items():
            r = r.float().cpu()
            if not torch.isfinite(r).all():
                fail(f"reward {key!r} returned non-finite values {r[~torch.isfinite(r)][:4].tolist()}")
            out[key] = r
    return out


class Prompt(str):
    """A prompt of a .jsonl file: the text, with its line's JSON object as .metadata (GenEval's tag, include,
    exclude), which indexing, grouping and sharding keep; rewards.py reads it. An editing prompt also has
    .images, its source images (each a file path or uint8 [3, H, W]), and .key, the text and a hash of the
    images: two edits with one instruction are two prompts (the text cache's file names)."""

    def __new__(cls, text: str, metadata: dict, images: tuple = (), key: str | None = None):
        prompt = super().__new__(cls, text)
        prompt.metadata, prompt.images = metadata, tuple(images)
        prompt.key = key or (text if not images else f"{text}\0{images_hash(prompt.images)}")
        return prompt

    def __reduce__(self):
        return Prompt, (str(self), self.metadata, self.images, self.key)


def images_hash(images) -> str:
    """A hash of source images: their pixels (uint8 tensors), or their files' paths, sizes and times."""
    h = hashlib.sha256()
    for image in images:
        if isinstance(image, str):
            st = os.stat(image)
            h.update(f"{os.path.abspath(image)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        else:
            h.update(repr(tuple(image.shape)).encode() + image.contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


IMAGE_SIDE = (8, 8192)  # pixels a source image's side may have
MAX_IMAGES = 8  # source images an editing prompt may have


def source_images(row: dict, *, where: str, folder: str) -> tuple:
    """The source images of a .jsonl row ("image": path, or "images": [path, ...], relative to the file's
    folder), each checked now from its header (there, readable as an image, sides within IMAGE_SIDE); else one
    line naming `where`."""
    from PIL import Image, UnidentifiedImageError
    if "image" in row and "images" in row:
        fail(f"{where} has both \"image\" and \"images\"; give one")
    paths = row.get("images", [row["image"]] if "image" in row else [])
    if "image" in row and not isinstance(row["image"], str):
        fail(f"{where}: \"image\" must be a path (a string), not {json.dumps(row['image'])[:40]}")
    if not isinstance(paths, list) or not 1 <= len(paths) <= MAX_IMAGES or \
            not all(isinstance(p, str) for p in paths):
        fail(f"{where}: \"images\" must be a list of 1 to {MAX_IMAGES} paths (strings)")
    out = []
    for name in paths:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            fail(f"{where}: image {name!r} does not exist (paths are relative to the prompt file)")
        try:
            with Image.open(path) as image:
                w, h = image.size
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
            fail(f"{where}: image {name!r} cannot be read as an image ({type(e).__name__})")
        if not (IMAGE_SIDE[0] <= min(w, h) and max(w, h) <= IMAGE_SIDE[1]):
            fail(f"{where}: image {name!r} is {w}x{h} pixels (width x height); a side may be "
                 f"{IMAGE_SIDE[0]} to {IMAGE_SIDE[1]}")
        out.append(path)
    return tuple(out)


def prompt_key(prompt) -> str:
    """What tells prompts apart: the text, and an editing prompt's source images (Prompt.key)."""
    return getattr(prompt, "key", str(prompt))


def load_prompt_set(path: str, *, split: str = "train", rewards=()) -> list[str]:
    """Prompts from a text file, one per line (blank lines skipped), a .jsonl file with a "prompt" field per
    line (Flow-GRPO's GenEval metadata; each a Prompt), or 'toy': the toy world's grammar. If `rewards` name a
    toy reward, every prompt must be in its grammar; ocr and geneval: rewards.check_prompts (checked here,
    before any model loads)."""
    if path in ("toy", "toy-video", "toy-edit"):
        module = {"toy": "toy.world", "toy-video": "toy.video_world", "toy-edit": "toy.edit_world"}[path]
        world = import_sibling(module)
        draw = {"toy": "toy_prompts", "toy-video": "video_prompts", "toy-edit": "edit_prompts"}[path]
        return getattr(world, draw)(4096 if split == "train" else 1024, seed=0 if split == "train" else 1)
    if os.path.isdir(path):
        fail(f"prompt file {path!r} is a directory; pass a text file with one prompt per line (or a .jsonl "
             f"file)")
    if not os.path.isfile(path):
        fail(f"prompt file {path!r} does not exist; docs/rewards.md 'Prompt sets' says where each paper's "
             f"prompts come from (or pass any text file with one prompt per line)")
    lines = []
    try:
        with open(path, encoding="utf-8") as f:
            while line := f.readline((1 << 20) + 1):  # a line at most 1 Mi characters: never a whole file
                if len(line) > 1 << 20:
                    fail(f"line {len(lines) + 1} of prompt file {path!r} is longer than 1,048,576 "
                         f"characters; a prompt per line")
                lines.append(line.strip())
    except UnicodeDecodeError as e:
        fail(f"prompt file {path!r} is not UTF-8 text (byte {e.start}); save it as UTF-8, a prompt per line")
    lines = [(n, line) for n, line in enumerate(lines, 1) if line]
    prompts = []
    for n, line in lines:
        row = None
        if path.endswith(".jsonl"):
            try:
                row = parse_json(line)
            except ValueError as e:  # no JSON, or beyond parse_json's bounds
                row = "" if isinstance(e, json.JSONDecodeError) else f" ({e})"
            if not isinstance(row, dict) or "prompt" not in row:
                fail(f"line {n} of prompt file {path!r} is not a JSON object with a prompt field"
                     f"{row if isinstance(row, str) else ''}; each line of a .jsonl file must be one")
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                fail(f"line {n} of prompt file {path!r} has the prompt {json.dumps(row['prompt'])[:60]}; a "
                     f"prompt must be a non-empty string")
        text = row["prompt"] if row else line
        images = source_images(row, where=f"line {n} of prompt file {path!r}", folder=os.path.dirname(path)) \
            if row and ("image" in row or "images" in row) else ()
        if prompts and bool(images) != bool(getattr(prompts[0], "images", ())):
            first = "has no image" if not images else "has images"
            fail(f"line {n} of prompt file {path!r} {first}, line {lines[0][0]} "
                 f"{'has' if not images else 'has none'}; an editing prompt set gives every line its images")
        if images and prompts and len(images) != len(prompts[0].images):  # no family batches other counts
            fail(f"line {n} of prompt file {path!r} has {len(images)} source images, line {lines[0][0]} "
                 f"{len(prompts[0].images)}; an editing prompt set gives every line as many (a batch's "
                 f"sources are encoded together)")
        bad = re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]", text)
        if bad:
            what = "a NUL character" if bad[0] == "\0" else "a lone surrogate" if bad[0] >= "\ud800" else \
                "a control character"
            fail(f"line {n} of prompt file {path!r} has {what} ({shown(bad[0])}) in its prompt; a prompt is "
                 f"text: no control character but tab, no lone surrogate")
        prompts.append(Prompt(text, row, images=images) if row else text)
    if not prompts:
        fail(f"prompt file {path!r} is empty; it needs at least one prompt (one per line)")
    if {"ocr", "geneval"} & set(rewards):
        import_sibling("rewards").check_prompts(rewards, prompts, [f"line {n} of {path!r}" for n, _ in lines])
    for module, parser, names, world in (("toy.world", "parse_toy_prompt", TOY_REWARDS, "toy-world"), (
            "toy.video_world", "parse_video_prompt", VIDEO_TOY_REWARDS, "moving-shapes"), (
            "toy.edit_world", "parse_edit", EDIT_TOY_REWARDS, "editing toy-world")):
        wanted = [r for r in rewards if r in names]
        parse = import_sibling(module).__dict__[parser] if wanted else None
        for p in prompts if wanted else []:
            try:
                parse(p)
            except ValueError as e:
                fail(f"prompt file {path!r}: {e}; the rewards {wanted} score {world} prompts only")
    return prompts


# ======== 4. Run plumbing: arguments, distribution, EMA ========
TOY_WORLD = dict(  # the part of every file's TOY preset that describes the toy world itself
    model="toy", mixed_precision="no", resolution=32, max_sequence_length=16, guidance=3.5, prompts="toy",
    eval_prompts="toy", rewards=("toy_color_position", "toy_shape_count"), eval_rewards=("toy_strict",),
    reward_combine="advantages", num_steps=16, eval_steps=16, group_size=12, micro_batch=48,
    full_finetune=True, gradient_checkpointing=False, ema=False, num_iterations=60, eval_every=20,
    eval_num=256, save_every=20, log_images_every=20)


# each numeric argument's range (each value of a tuple), finite both ways: no value that breaks later passes
ARG_RANGES = {
    "seed": "[0, 1e12]", "resolution": "[1, 16384]", "max_sequence_length": "[1, 65536]",
    "guidance": "[0, 100]", "reward_weights": "(0, 1e6]", "num_steps": "[1, 1000]", "eval_steps": "[1, 1000]",
    "group_size": "[2, 4096]", "prompts_per_iteration": "[1, 1e6]", "micro_batch": "[1, 1e6]",
    "noise_level": "[0, 10]", "shift": "[0.01, 100]", "timestep_fraction": "(0, 1]", "adv_eps": "[0, 1]",
    "adv_clip": "(0, 1e6]", "clip_range": "(0, 100]", "beta": "[0, 1e6]", "lora_rank": "[1, 65536]",
    "lora_alpha": "(0, 1e6]", "learning_rate": "(0, 1]", "weight_decay": "[0, 100]",
    "max_grad_norm": "(0, 1e9]", "updates_per_iteration": "[1, 1e6]", "ema_decay": "[0, 1)",
    "ema_every": "[1, 1e9]", "num_iterations": "[1, 1e9]", "eval_every": "[0, 1e9]", "eval_num": "[1, 1e7]",
    "save_every": "[0, 1e9]", "keep_checkpoints": "[0, 1e9]", "log_images_every": "[0, 1e9]",
    "reward_timeout": "(0, 86400]", "reward_retries": "[0, 100]", "threads": "[1, 4096]",
    "width": "[1, 16384]", "num_frames": "[1, 1024]", "fps": "(0, 1000]", "condition_size": "[0, 16384]",
    # algorithm specific: CoCA, DenseGRPO, G2RPO, MixGRPO, DiffusionNFT, AWM, DGPO, Flow-DPPO
    "coca_window": "[1, 1000]", "coca_alpha": "[0, 1]", "dense_ode_steps": "[1, 1000]", "eps1": "(0, 1e4]",
    "eps2": "(0, 10]", "psi_range": "[0, 10]", "sde_steps": "[0, 1000]", "lambdas": "[1, 1000]",
    "window_size": "[1, 1000]", "window_stride": "[0, 1000]", "window_shift_interval": "[1, 1e9]",
    "flash_compress": "(0, 1]", "nft_beta": "(0, 100]", "decay_type": "[0, 2]",
    "train_timesteps": "[1, 1000]", "advantage_max": "(0, 1e6]", "ghuber_power": "(0, 10]",
    "ema_beta": "[0, 1e6]", "kl_ema_decay": "[0, 1]", "flow_shift": "[0.01, 100]", "trunc_steps": "[0, 1000]",
    "beta_dpo": "(0, 1e5]", "switch_ema_ref": "[0, 1e9]", "kl_threshold": "[0, 1e6]",
    # online DPO, CRD
    "ref_update_step": "[1, 1e9]", "crd_beta": "(0, 1e6]", "weight_temp": "[-1, 1e6]", "kl_cfg": "[0, 100]",
    # evaluate.py
    "num_prompts": "[1, 1e7]", "seeds_per_prompt": "[1, 1e4]", "steps": "[1, 1000]",
}


def in_range(value, rule: str) -> bool:
    """A finite number (not a bool, no integer beyond any float) within `rule`: "(a, b]", "[a, b)" ..."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= 1e300:  # NaN too
        return False
    low, high = (float(x) for x in rule[1:-1].split(","))
    above = low <= value if rule[0] == "[" else low < value
    return above and (value <= high if rule[-1] == "]" else value < high)


def check_ranges(args, ranges: dict):
    """Every numeric argument that `args` has (each value of a tuple; not the strings of a Literal such as
    --dense-ode-steps t) within its rule in `ranges`, else a one-line error naming the flag and the rule."""
    for name, rule in ranges.items():
        value = getattr(args, name, None)
        for v in value if isinstance(value, tuple) else [value]:
            if v is not None and not isinstance(v, str) and not in_range(v, rule):
                fail(f"--{name.replace('_', '-')} {shown(v)} is not allowed; use a value in {rule}")


def check_output_path(path: str, *, flag: str, directory: bool):
    """An output directory that can be made, or a file in a writable directory: else a one-line error."""
    if os.path.exists(path) and os.path.isdir(path) != directory:
        kind = "a file" if directory else "a directory"
        fail(f"{flag} {path!r} is {kind}; pass {'a directory' if directory else 'a file path'}")
    parent = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
    while directory and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        fail(f"{flag} {path!r} cannot be written ({parent!r} is no writable directory)")


def check_common_args(args, world: int):
    """The checks every algorithm file shares (its own follow in its check_args); no model loads."""
    if args.group_size < 2:
        fail(f"--group-size {args.group_size} is not allowed; GRPO needs at least 2 images per prompt")
    check_ranges(args, ARG_RANGES)
    check_ranges(args.reward_models, ARG_RANGES)  # --reward-timeout, --reward-retries
    check_frame_reduce(args.reward_models.frame_reduce)
    if args.prompts_per_iteration % world:
        fail(f"--prompts-per-iteration {args.prompts_per_iteration} is not a positive multiple of the world "
             f"size {world}")
    if args.reward_weights and len(args.reward_weights) != len(args.rewards):
        fail(f"--reward-weights has {len(args.reward_weights)} values for {len(args.rewards)} rewards; give "
             f"one per reward")
    if args.ema and args.full_finetune and world > 1:
        fail("--ema is not supported with sharded full fine-tuning (world size > 1); pass --no-ema")
    check_rewards(args.rewards + args.eval_rewards, args.reward_models)
    if args.resume and not os.path.isdir(args.resume):
        fail(f"--resume {args.resume!r} is not a directory; pass a run directory (runs/<run_name>)")
    check_output_path(args.output_dir, flag="--output-dir", directory=True)
    if args.text_cache:
        check_output_path(args.text_cache, flag="--text-cache", directory=True)


RENDEZVOUS_TIMEOUT = 300  # seconds a torchrun rank waits for the others; $RENDEZVOUS_TIMEOUT overrides


def setup_distributed():
    """torchrun-aware setup: NCCL on CUDA, gloo on CPU. Returns (rank, world_size, device). A torchrun
    environment that cannot form a group (a WORLD_SIZE without RANK / MASTER_ADDR / MASTER_PORT, e.g. left in
    a shell; bad values; no peer within RENDEZVOUS_TIMEOUT s) stops in one line."""
    from datetime import timedelta
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    numbers = {k: int(v) if v and re.fullmatch(r"\s*[0-9]{1,9}\s*", v) else v for k, v in env.items()}
    for k, low, high in ("WORLD_SIZE", 1, 10**6), ("RANK", 0, 10**6), ("LOCAL_RANK", 0, 10**6), \
            ("MASTER_PORT", 1, 65535):
        if numbers[k] is not None and not (isinstance(numbers[k], int) and low <= numbers[k] <= high):
            fail(f"{k}={shown(env[k])} in the environment is not a number in [{low}, {high}]; launch with "
                 f"torchrun, or unset it")
    wait = os.environ.get("RENDEZVOUS_TIMEOUT", str(RENDEZVOUS_TIMEOUT))
    if not re.fullmatch(r"\s*[0-9]{1,9}(\.[0-9]{0,9})?\s*", wait) or not 0 < float(wait) <= 86400:
        fail(f"RENDEZVOUS_TIMEOUT={shown(wait)} in the environment is not a number of seconds in (0, 86400]")
    world = numbers["WORLD_SIZE"] if numbers["WORLD_SIZE"] is not None else 1
    local_rank = numbers["LOCAL_RANK"] or 0
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if env[k] is None]
        if missing:
            fail(f"WORLD_SIZE={world} is set but {', '.join(missing)} not (left in the shell by a torchrun "
                 f"run?); launch with torchrun, or unset WORLD_SIZE for one process")
        if not numbers["RANK"] < world or world < 1:
            fail(f"RANK={numbers['RANK']} is not below WORLD_SIZE={world}; launch with torchrun")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        wait = float(wait)
        try:  # the rendezvous first, bounded: the other ranks must join within `wait` seconds
            store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=wait)))
        except (RuntimeError, ValueError, OSError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:120]
            fail(f"rank {env['RANK']} of WORLD_SIZE={world} found no group at {env['MASTER_ADDR']}:"
                 f"{env['MASTER_PORT']} within {wait:.0f} s ({type(e).__name__}: {first}); start every rank "
                 f"(torchrun), unset WORLD_SIZE for one process, or raise $RENDEZVOUS_TIMEOUT")
        # then an hour for collectives: a 12B-parameter checkpoint can take minutes while the others wait
        store.set_timeout(timedelta(hours=1))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=timedelta(hours=1))
    return (dist.get_rank() if world > 1 else 0), world, device


_LAST_BARRIER = []  # close_distributed's barrier, kept until the interpreter exits


def close_distributed():
    """The end of a torchrun process: a barrier, then the process group's end. The barrier's work is kept
    alive until the interpreter exits: gloo's worker thread would otherwise free it (and, through it, the last
    collectives' tensors) at a moment of its own, and a thread that frees a Python-owned tensor while the
    interpreter shuts down aborts the process ("terminate called without an active exception"). FSDP2's device
    mesh keeps the process group, and so its threads, alive past destroy_process_group."""
    if dist.is_initialized():
        work = dist.barrier(async_op=True)
        work.wait()
        _LAST_BARRIER.append(work)
        dist.destroy_process_group()


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Equal-shaped tensors of every rank concatenated along dim 0 in rank order (identity on one process)."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _all_reduce(values: list, op) -> list[float]:
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device="cuda" if nccl else "cpu")
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def sum_over_ranks(values: dict) -> dict:
    """{name: the sum over every rank} of numbers or 0-d tensors (an iteration's training statistics)."""
    return dict(zip(values, _all_reduce(list(values.values()), dist.ReduceOp.SUM)))


def max_over_ranks(value: float) -> float:
    return _all_reduce([value], dist.ReduceOp.MAX)[0]


def broadcast_object(obj):
    """Rank 0's value of a picklable object, on every rank."""
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def iteration_generator(seed: int, iteration: int, rank: int, stream: int = 0) -> torch.Generator:
    """One iteration's generator on one rank (prompts, noise), so that a resumed run repeats an uninterrupted
    one; `stream` 1, 2, ... are further independent streams."""
    return torch.Generator().manual_seed(seed * 100_003 + iteration * 1009 + rank + stream * 2**40)


def seed_everything(seed: int, *, deterministic: bool = False):
    import random
    random.seed(seed)
    torch.manual_seed(seed)  # numpy draws nothing random here
    torch.backends.cudnn.deterministic = deterministic


def optimizer_step(params: dict, optimizer, *, max_grad_norm: float, sharded: bool, has_gradient: bool):
    """One optimizer step on every rank's gradients: DDP-style averaging (FSDP2 reduces its own), clipping,
    step, zero; none if no rank had a gradient (`has_gradient`: a non-zero advantage or a KL term), so 1 and N
    processes step alike. Returns the norm before clipping or None; a non-finite norm stops the run."""
    norm = None
    if max_over_ranks(float(has_gradient)):
        if dist.is_initialized() and not sharded:
            for p in params.values():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(norm):
            fail(f"the gradient norm is {norm}; the run stops before the weights or a checkpoint change "
                 f"(lower --learning-rate, or check the rewards)")
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


@torch.no_grad()
def ema_update(ema: list, params: list, decay: float, step: int, *, warmup: bool = True):
    """Flow-GRPO's EMA of the weights: decay min((1 + s) / (10 + s), decay) after s steps (without `warmup`:
    `decay` itself; DiffusionNFT's old policy, AWM's KL-EMA)."""
    decay = min((1 + step) / (10 + step), decay) if warmup else decay
    for e, p in zip(ema, params):
        e.mul_(decay).add_(p.detach().float(), alpha=1 - decay)


@contextlib.contextmanager
def swapped_in(params: list, values):
    """Temporarily load `values` (e.g. the EMA) into `params`; a no-op when values is None. Sharded: the FSDP2
    root reshards after every forward (common.shard), so the next forward gathers the swapped-in shards."""
    values = [] if values is None else values
    backup = [p.detach().clone() for p, _ in zip(params, values)]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)
