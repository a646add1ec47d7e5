"""Shared plumbing for flow_grpo.py, g2rpo.py and densegrpo.py: plain functions, in six sections.

1. schedules  2. SDE/ODE steps  3. model  4. rewards  5. advantages  6. distributed, logging, checkpoints
The algorithm files import what they need from here; everything algorithm-specific stays in them.
"""
import contextlib
import io
import json
import math
import os
import shutil
import sys
import textwrap

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_ALIASES = {  # short names accepted by --model
    "toy": os.path.join(HERE, "toy", "flux-shapes"),
    "sd3.5-medium": "stabilityai/stable-diffusion-3.5-medium",
    "flux-dev": "black-forest-labs/FLUX.1-dev",
}


def fail(message: str):
    """Stop with a one-line error (no traceback): bad input must say what was wrong and what is allowed."""
    raise SystemExit(f"error: {message}")


def apply_preset(args, preset: dict, argv=None):
    """Set every field in `preset` that was not passed explicitly on the command line (explicit flags win)."""
    argv = sys.argv[1:] if argv is None else argv
    given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    given |= {g[3:] for g in given if g.startswith("no_")}
    for key, value in preset.items():
        if key not in given:
            setattr(args, key, value)
    return args


# ======== 1. Schedules ========
def sigma_schedule(num_steps: int, shift: float, pipe=None, kind: str = "flux", image_tokens: int = 0) -> torch.Tensor:
    """Noise levels sigma_0 = 1 > ... > sigma_T = 0 for T = num_steps sampling steps.

    Without `pipe`: shift*u / (1 + (shift-1)*u) on u = linspace(1, 0, T + 1) (DanceGRPO, G2RPO). With `pipe`: the
    pipeline's own scheduler and its config, as diffusers' pipelines (and Flow-GRPO) call it: SD3
    `set_timesteps(T)` (shift 3, sigma_min shifted too); Flux `linspace(1, 1/T, T)` with the resolution-dependent
    mu = calculate_shift(image_tokens) when the scheduler shifts dynamically (FLUX.1-dev); then sigma = 0."""
    if pipe is None:
        u = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
        return (shift * u / (1 + (shift - 1) * u)).float()
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # a copy: the pipeline's state is untouched
    c = scheduler.config
    mu = calculate_shift(image_tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    if kind == "flux":
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    else:
        scheduler.set_timesteps(num_steps, mu=mu if c.get("use_dynamic_shifting") else None)
    return scheduler.sigmas.float().cpu()


def strided_indices(start: int, end: int, stride: int) -> list[int]:
    """Schedule indices start, start+stride, ... that always end exactly at `end` (the last stride may be shorter).
    Gives ceil((end - start) / stride) steps."""
    if stride < 1:
        fail(f"stride {stride} is not allowed; use an integer >= 1")
    return list(range(start, end, stride)) + [end]


def spaced_indices(start: int, end: int, n: int) -> list[int]:
    """Exactly min(n, end - start) steps from schedule index `start` to `end`, as evenly spaced as integers allow:
    start + ceil(j (end - start) / n). n = 1 jumps straight to `end`; n >= end - start visits every index."""
    n = min(n, end - start)
    return [start + -(-j * (end - start) // n) for j in range(n + 1)]


# ======== 2. SDE / ODE steps (all step math in float32, shared by sampling and training so log-probs match exactly) ========
def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """log N(x; mean, std^2), averaged over every non-batch dimension (the official per-element mean)."""
    lp = -((x.detach() - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=tuple(range(1, x.ndim)))


def sde_step(v, x, sigmas, i: int, noise_level: float, prev_sample=None, generator=None, form: str = "flow_grpo"):
    """One Euler-Maruyama step of the marginal-preserving reverse SDE from sigmas[i] to sigmas[i+1].

    dx = [v + g^2 / (2 sigma) (x + (1 - sigma) v)] dt + g dW   (Flow-GRPO Eq. 9; G2RPO Eq. 3), dt < 0, with
    g = a * sqrt(sigma / (1 - sigma')) (form "flow_grpo"; sigma' = sigmas[1] at sigma = 1) or g = eta ("dance",
    DanceGRPO's constant coefficient). noise_level 0 is the Euler ODE step x + v dt (log-prob is then 0).
    Samples x_next unless `prev_sample` is given. Returns (x_next, log_prob, mean, std) with std = g sqrt(-dt).
    """
    v, x = v.float(), x.float()
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = sigma_next - sigma
    if form == "flow_grpo":
        g = noise_level * math.sqrt(sigma / (1 - (float(sigmas[1]) if sigma == 1 else sigma)))
    elif form == "dance":
        g = noise_level
    else:
        fail(f"noise form {form!r} is not known; use 'flow_grpo' or 'dance'")
    mean = x + (v + g**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt
    std = g * math.sqrt(-dt)
    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, device=generator.device if generator else x.device)
        prev_sample = mean + std * noise.to(x.device) if std > 0 else mean
    prev_sample = prev_sample.float()
    log_prob = gaussian_log_prob(prev_sample, mean, std) if std > 0 else torch.zeros(x.shape[0], device=x.device)
    return prev_sample, log_prob, mean, std


def ode_step(v, x, sigma: float, sigma_next: float):
    """Euler step of the probability-flow ODE dx = v dt (float32)."""
    return x.float() + v.float() * (float(sigma_next) - float(sigma))


@torch.no_grad()
def ode_complete(transformer, kind: str, x, paths: list, sigmas, emb: dict, guidance: float, micro_batch: int,
                 v_first=None, emb_index=None):
    """Integrate the ODE from each start x[n] (embedding row emb_index[n], default n) along schedule indices paths[r],
    r = n, n + N, ... (e.g. strided_indices(...) per stride, or the whole schedule). The velocity at a start is
    evaluated once (or taken from `v_first`) and shared by all its paths; later steps batch every row still moving,
    whatever its stride. Embeddings are indexed per micro-batch, never copied per row."""
    n, reps = len(x), len(paths) // len(x)
    start = torch.arange(n).repeat(reps)  # row -> its start
    emb_index = torch.arange(n) if emb_index is None else emb_index.cpu()
    if v_first is None and max(map(len, paths)) > 1:
        s0 = sigmas[[p[0] for p in paths[:n]]]
        v_first = torch.cat([velocity(transformer, kind, x[c], s0[c], select(emb, emb_index[c].to(x.device)), guidance)
                             .float() for c in torch.arange(n).split(micro_batch)])
    x = x.float().repeat(reps, *[1] * (x.ndim - 1))
    for k in range(max(map(len, paths)) - 1):
        live = [r for r, p in enumerate(paths) if len(p) > k + 1]
        s, rows = sigmas[[paths[r][k] for r in live]], torch.tensor(live, dtype=torch.long)
        ds = (sigmas[[paths[r][k + 1] for r in live]] - s).to(x.device).view(-1, *[1] * (x.ndim - 1))
        if k == 0:
            v = v_first[start[rows]].float()
        else:
            v = torch.cat([velocity(transformer, kind, x[rows[c]], s[c], select(emb, emb_index[start[rows[c]]].to(x.device)),
                                    guidance).float() for c in torch.arange(len(rows)).split(micro_batch)])
        x[rows] = x[rows] + v * ds  # Euler step dx = v dt
    return x


# ======== 3. Model: loading, prompt encoding, velocity (with an NFE counter), decoding, trainable parameters ========
NFE = {"count": 0}  # per-sample transformer evaluations (a CFG pair counts once); every forward goes through velocity()
_ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
         "attn.to_add_out"]  # "attn." as in Flow-GRPO: SD3.5-M's second attention (attn2) gets no adapter
LORA_TARGETS = {"sd3": _ATTN, "flux": _ATTN + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]}


def load_pipeline(model: str, device, dtype=torch.float32):
    """A FluxPipeline or StableDiffusion3Pipeline from an alias in MODEL_ALIASES, a local directory or a hub id.
    Returns (pipe, kind) with kind in {"flux", "sd3"}."""
    from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusion3Pipeline

    path = MODEL_ALIASES.get(model, model)
    is_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)
    if not os.path.isdir(path) and not is_hub_id:
        fail(f"model path {model!r} does not exist; pass a local pipeline directory, a hub id (owner/name) "
             f"or one of {sorted(MODEL_ALIASES)}")
    try:
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype)
    except Exception as e:  # offline hub id, broken directory, ...
        fail(f"cannot load model {model!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    kind = "flux" if isinstance(pipe, FluxPipeline) else "sd3" if isinstance(pipe, StableDiffusion3Pipeline) else None
    if kind is None:
        fail(f"model {model!r} is a {type(pipe).__name__}; only FluxPipeline and StableDiffusion3Pipeline are supported")
    pipe.set_progress_bar_config(disable=True)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:  # on a GPU the text encoders (T5-XXL: 9.5 GiB) wait on the CPU between encodings
            module.requires_grad_(False).eval().to("cpu" if name.startswith("text") else device)
    return pipe, kind


def latent_shape(pipe, kind: str, resolution: int) -> tuple:
    """(C, H, W) of the latents for a square image, or a one-line error if the model cannot take `resolution`."""
    f = pipe.vae_scale_factor
    multiple = 2 * f if kind == "flux" else f * pipe.transformer.config.patch_size
    if resolution < multiple or resolution % multiple:
        fail(f"--resolution {resolution} is not allowed for this model; use a positive multiple of {multiple}")
    channels = pipe.transformer.config.in_channels // (4 if kind == "flux" else 1)
    return channels, resolution // f, resolution // f


@torch.no_grad()
def encode_prompts(pipe, kind: str, prompts: list[str], max_sequence_length: int, cfg: float = 1.0) -> dict:
    """Text embeddings for each prompt (computed once per prompt; index them to repeat for a group). The text encoders
    visit the transformer's device for the call and go back to the CPU afterwards."""
    device = pipe.transformer.device
    encoders = [m for m in (pipe.text_encoder, pipe.text_encoder_2, getattr(pipe, "text_encoder_3", None)) if m is not None]
    for m in encoders:
        m.to(device)
    try:
        if len(prompts) > 16 and device.type == "cuda":  # an evaluation's prompts: 16 at a time through T5
            parts = [encode_prompts(pipe, kind, prompts[i:i + 16], max_sequence_length, cfg) for i in range(0, len(prompts), 16)]
            return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
        if kind == "flux":
            embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=device,
                                                   max_sequence_length=max_sequence_length)
            return {"embeds": embeds, "pooled": pooled}
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt(
            prompts, prompts, prompts, device=device, do_classifier_free_guidance=cfg > 1, negative_prompt="",
            negative_prompt_2="", negative_prompt_3="", max_sequence_length=max_sequence_length)
        return {"embeds": embeds, "pooled": pooled, **({"neg_embeds": neg, "neg_pooled": neg_pooled} if cfg > 1 else {})}
    finally:
        for m in encoders:
            m.to("cpu")


def select(emb: dict, index) -> dict:
    """Rows `index` of every tensor in an embedding dict (e.g. repeat each prompt for its group)."""
    return {k: v[index] for k, v in emb.items()}


def velocity(transformer, kind: str, x, sigma, emb: dict, guidance: float = 1.0):
    """Model velocity v(x, sigma) for latents x [B, C, H, W]. Hides Flux packing, position ids and the guidance
    embedding (timestep = sigma), and SD3's classifier-free guidance (timestep = 1000 sigma, batch [negative; positive])."""
    from diffusers import FluxPipeline

    NFE["count"] += x.shape[0]
    b, c, h, w = x.shape
    dtype = next(transformer.parameters()).dtype
    t = torch.as_tensor(sigma, dtype=torch.float32).to(x.device).expand(b).contiguous()  # float32, not the weights' dtype
    if kind == "flux":
        packed = FluxPipeline._pack_latents(x.to(dtype), b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, dtype)
        txt_ids = torch.zeros(emb["embeds"].shape[1], 3, device=x.device, dtype=dtype)
        g = torch.full((b,), guidance, device=x.device, dtype=dtype) if transformer.config.guidance_embeds else None
        out = transformer(hidden_states=packed, timestep=t, guidance=g, pooled_projections=emb["pooled"].to(dtype),
                          encoder_hidden_states=emb["embeds"].to(dtype), txt_ids=txt_ids, img_ids=img_ids,
                          return_dict=False)[0]
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
    cfg = "neg_embeds" in emb and guidance > 1
    embeds = torch.cat([emb["neg_embeds"], emb["embeds"]]) if cfg else emb["embeds"]
    pooled = torch.cat([emb["neg_pooled"], emb["pooled"]]) if cfg else emb["pooled"]
    out = transformer(hidden_states=torch.cat([x, x]).to(dtype) if cfg else x.to(dtype),
                      timestep=torch.cat([t, t]) * 1000 if cfg else t * 1000, encoder_hidden_states=embeds.to(dtype),
                      pooled_projections=pooled.to(dtype), return_dict=False)[0]
    if cfg:
        uncond, cond = out.chunk(2)
        out = uncond + guidance * (cond - uncond)
    return out


@torch.no_grad()
def decode(pipe, latents, batch: int = 4) -> torch.Tensor:
    """Latents -> float images in [0, 1], [B, 3, H, W]; on a GPU `batch` latents per VAE call (the decoder's
    temporaries, not its weights, dominate at 512-720 px)."""
    cfg = pipe.vae.config
    z = (latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)).to(pipe.vae.dtype)
    images = torch.cat([pipe.vae.decode(c, return_dict=False)[0] for c in z.split(batch if z.is_cuda else len(z))])
    return ((images.float() + 1) / 2).clamp(0, 1)


def make_trainable(transformer, kind: str, lora_rank: int, lora_alpha: float, full_finetune: bool, reference: bool,
                   sharded: bool = False, amp=None, checkpointing: bool = False):
    """LoRA adapters (peft, gaussian init) on the attention (and for Flux, MLP) projections, or full fine-tuning.
    Returns the trainable parameters (float32) and, if `reference` and fully fine-tuning, a frozen copy of the initial
    transformer (a LoRA run's reference is the same transformer with its adapter disabled). `sharded`: FSDP2 (`shard`)
    for the policy and the reference alike; the float32 master weights are made after sharding, from the local shards
    only, so no GPU ever holds a full float32 copy. `checkpointing`: diffusers' per-block activation checkpointing."""
    import copy

    ref = copy.deepcopy(transformer).requires_grad_(False) if reference and full_finetune else None
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    if full_finetune:
        transformer.requires_grad_(True)
    else:
        from peft import LoraConfig
        transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian",
                                           target_modules=LORA_TARGETS[kind]))
    if sharded:
        for model in [transformer] + ([ref] if ref is not None else []):
            shard(model, amp)
        transformer.float()  # each rank's shards only
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params if not sharded else []:
        p.data = p.data.float()
    return params, ref


def shard(model, amp=None, mesh=None):
    """FSDP2: one fully_shard per transformer block, then the root; forwards gather `amp` (bf16) weights, gradients are
    reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32)
    for block in [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]:
        fully_shard(block, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)


@contextlib.contextmanager
def gathered(transformer, sharded: bool):
    """Keep a sharded transformer's blocks gathered (in their compute dtype) for a run of no-grad forwards, e.g. a
    rollout, instead of all-gathering every block's weights again at every forward; reshard afterwards."""
    blocks = [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", [])] if sharded else []
    for b in blocks:
        b.set_reshard_after_forward(False)
        b.unshard()
    try:
        yield
    finally:
        for b in blocks:
            b.reshard()
            b.set_reshard_after_forward(True)


@contextlib.contextmanager
def adapters_disabled(transformer, enabled: bool = True):
    """The reference (pre-RL) model of a LoRA run: the same transformer with its adapter switched off."""
    if enabled:
        transformer.disable_adapters()
    try:
        yield transformer
    finally:
        if enabled:
            transformer.enable_adapters()


def reference_kl(ref, kind: str, x, sigmas, i: int, emb: dict, guidance: float, noise_level: float, prev_sample, form: str,
                 mean, std: float, lora: bool, exact: bool = False):
    """KL between the policy's and the reference model's Gaussian steps from x, per-element mean of |mu - mu_ref|^2
    divided by 2 std_dev_t^2 (Flow-GRPO's code: std_dev_t = std / sqrt(-dt), without the step's sqrt(-dt)) or, if
    `exact`, by 2 std^2 (the Gaussian KL of the papers' formula: the official value divided by |dt|). The reference
    is the same transformer with its LoRA adapter off (`lora`) or a frozen copy."""
    if std == 0:
        fail(f"--beta > 0 needs noise at every trained step (the KL divides by its variance); step {i} has none")
    with torch.no_grad(), adapters_disabled(ref, lora):
        v_ref = velocity(ref, kind, x, sigmas[i], emb, guidance)
    mean_ref = sde_step(v_ref, x, sigmas, i, noise_level, prev_sample=prev_sample, form=form)[2]
    var = std**2 if exact else std**2 / float(sigmas[i] - sigmas[i + 1])
    return ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, x.ndim))).mean() / (2 * var)


# ======== 4. Rewards: each is fn(images [B, 3, H, W] in [0, 1], prompts) -> tensor [B] ========
def load_safely(path: str):
    """Weights from safetensors or a pickle read with weights_only=True (a downloaded pickle cannot run code)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _clip_preprocess(images, size: int, mean, std, pad_square: bool):
    """Resize (longest side to `size` and pad, as HPS does; or shortest side and centre-crop), then normalise."""
    import torch.nn.functional as F

    h, w = images.shape[-2:]
    scale = size / (max(h, w) if pad_square else min(h, w))
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    x = F.interpolate(images.float(), size=(nh, nw), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    if pad_square:
        x = F.pad(x, (0, size - nw, 0, size - nh))
    else:
        top, left = (nh - size) // 2, (nw - size) // 2
        x = x[..., top:top + size, left:left + size]
    return (x - torch.tensor(mean).view(1, 3, 1, 1).to(x)) / torch.tensor(std).view(1, 3, 1, 1).to(x)


def open_clip_reward(name: str, device, checkpoint: str | None = None, pad_square: bool = False, dtype=torch.float32):
    """Cosine of L2-normalised open_clip image and text features (no logit scale), the model held and run in `dtype`.
    `name`: an architecture ('ViT-H-14', built without pretrained weights), 'hf-hub:...' or a local directory with
    open_clip_config.json; `checkpoint`: a state_dict loaded strictly on top (HPS)."""
    import open_clip

    name = f"local-dir:{name}" if os.path.isdir(name) else name
    try:
        model = open_clip.create_model(name, pretrained=None)
    except Exception as e:
        fail(f"cannot load open_clip model {name!r} ({str(e).splitlines()[0][:200]}); pass a local directory")
    if checkpoint:
        state = load_safely(checkpoint)
        model.load_state_dict(state.get("state_dict", state), strict=True)
    model.eval().requires_grad_(False).to(device, dtype)
    size, cfg = model.visual.image_size, open_clip.get_model_preprocess_cfg(model)  # the model's own mean / std
    size, tokenizer = (size[0] if isinstance(size, (tuple, list)) else size), open_clip.get_tokenizer(name)

    @torch.no_grad()
    def score(images, prompts):
        x = _clip_preprocess(images.to(device), size, cfg["mean"], cfg["std"], pad_square).to(dtype)
        img = torch.nn.functional.normalize(model.encode_image(x).float(), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(tokenizer(list(prompts)).to(device)).float(), dim=-1)
        return (img * txt).sum(-1)

    return score


def hps_reward(checkpoint: str, device, arch: str = "ViT-H-14", dtype=torch.float32):
    """HPS-v2.1 as the hpsv2 package computes it, without that package: open_clip ViT-H-14 (no pretrained tag), a
    strict load of HPS_v2.1_compressed.pt's state_dict, longest side resized to 224 and padded, cosine similarity."""
    if not os.path.isfile(checkpoint):
        repo, _, filename = checkpoint.partition(":")
        from huggingface_hub import hf_hub_download
        try:
            checkpoint = hf_hub_download(repo, filename or "HPS_v2.1_compressed.pt")
        except Exception as e:
            fail(f"HPS checkpoint {checkpoint!r} is neither a local file nor downloadable ({type(e).__name__}); "
                 f"pass --hps-checkpoint /path/to/HPS_v2.1_compressed.pt")
    return open_clip_reward(arch, device, checkpoint, pad_square=True, dtype=dtype)


def pickscore_reward(model_path: str, processor_path: str, device, dtype=torch.float32):
    """PickScore as in Flow-GRPO: logit_scale.exp() * cos(text, image) / 26 (transformers CLIPModel)."""
    from transformers import AutoProcessor, CLIPModel

    try:
        processor = AutoProcessor.from_pretrained(processor_path)
        model = CLIPModel.from_pretrained(model_path).eval().requires_grad_(False).to(device, dtype)
    except Exception as e:
        fail(f"cannot load PickScore from {model_path!r} / {processor_path!r} ({type(e).__name__}); "
             f"pass --pickscore-model and --pickscore-processor local directories")
    ip = processor.image_processor
    size = ip.crop_size if isinstance(ip.crop_size, int) else ip.crop_size["height"]

    @torch.no_grad()
    def score(images, prompts):
        x = _clip_preprocess(images.to(device), size, ip.image_mean, ip.image_std, False).to(dtype)
        tok = processor.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=77,
                                  return_tensors="pt").to(device)
        feats = lambda out: (out if torch.is_tensor(out) else out.pooler_output).float()  # noqa: E731 (transformers 4 / 5)
        img = torch.nn.functional.normalize(feats(model.get_image_features(pixel_values=x)), dim=-1)
        txt = torch.nn.functional.normalize(feats(model.get_text_features(**tok)), dim=-1)
        return model.logit_scale.exp().float() * (img * txt).sum(-1) / 26

    return score


def jpeg_compressibility(images, prompts):
    """-(JPEG quality-95 size in kB) / 500, as in Flow-GRPO (smaller files score higher)."""
    from PIL import Image

    sizes = []
    for img in (images.detach().float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return -torch.tensor(sizes) / 500


TOY_REWARDS = ["toy_color_position", "toy_shape_count", "toy_strict"]  # exact rewards of the toy world (toy/world.py)
REWARDS = ["hps", "clip", "pickscore", "jpeg"] + TOY_REWARDS


def load_rewards(names, device, hps_checkpoint=None, clip_model=None, pickscore_model=None, pickscore_processor=None,
                 hps_arch="ViT-H-14", dtype=torch.float32) -> dict:
    """{name: fn(images, prompts) -> tensor [B]} for each requested reward, loaded once, the models held and run in
    `dtype` (bf16 on GPUs: scores within ~1e-2 of float32, see tests/test_rewards.py). Weights come from the given
    local paths, else from the hub: xswu/HPSv2, apple/DFN5B-CLIP-ViT-H-14-384, yuvalkirstain/PickScore_v1."""
    out = {}
    for name in names:
        if name not in REWARDS:
            fail(f"unknown reward {name!r}; choose from {REWARDS}")
        if name == "hps":
            out[name] = hps_reward(hps_checkpoint or "xswu/HPSv2:HPS_v2.1_compressed.pt", device, hps_arch, dtype)
        elif name == "clip":  # CLIP score (MixGRPO, G2RPO)
            out[name] = open_clip_reward(clip_model or "hf-hub:apple/DFN5B-CLIP-ViT-H-14-384", device, dtype=dtype)
        elif name == "pickscore":
            out[name] = pickscore_reward(pickscore_model or "yuvalkirstain/PickScore_v1",
                                         pickscore_processor or "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device, dtype)
        elif name == "jpeg":
            out[name] = jpeg_compressibility
        else:
            from toy import world

            out[name] = getattr(world, {"toy_strict": "toy_strict_accuracy"}.get(name, name + "_reward"))
    return out


@torch.no_grad()
def score(rewards: dict, images, prompts) -> dict:
    """{name: float tensor [B] on CPU}; a NaN or infinite reward is an error, never silently trained on."""
    out = {}
    for name, fn in rewards.items():
        r = fn(images, prompts).float().cpu()
        if not torch.isfinite(r).all():
            fail(f"reward {name!r} returned non-finite values {r[~torch.isfinite(r)][:4].tolist()}")
        out[name] = r
    return out


def load_prompt_set(path: str, split: str = "train") -> list[str]:
    """Prompts from a text file, one per line (blank lines skipped), a .jsonl file with a "prompt" field per line
    (Flow-GRPO's GenEval metadata), or 'toy': the toy world's grammar."""
    if path == "toy":
        from toy.world import toy_prompts
        return toy_prompts(4096 if split == "train" else 1024, seed=0 if split == "train" else 1)
    if not os.path.isfile(path):
        fail(f"prompt file {path!r} does not exist; README 'Prompt sets' says where each paper's prompts come from "
             f"(or pass any text file with one prompt per line)")
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] if path.endswith(".jsonl") else line.strip() for line in f if line.strip()]
    if not prompts:
        fail(f"prompt file {path!r} is empty; it needs at least one prompt (one per line)")
    return prompts


# ======== 5. Advantages ========
def group_advantages(rewards, eps: float, unbiased: bool, global_std: bool = False):
    """GRPO advantages for rewards [P, G] (P groups of G): (r - group mean) / (std + eps), with the std per group or
    over all P*G rewards. A group whose rewards are all equal gets exactly zero advantage (never NaN or eps-blown)."""
    r = rewards.double()
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(unbiased=unbiased) if global_std else r.std(dim=1, keepdim=True, unbiased=unbiased)
    adv = centred / (std + eps)
    flat = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)
    return torch.where(flat, torch.zeros_like(adv), adv).float()


def combine_advantages(rewards: dict, weights: dict, mode: str, eps: float, unbiased: bool, global_std: bool,
                       clip: float):
    """Several rewards -> one advantage [P, G]. mode "advantages": normalise each reward separately, then take the
    weighted sum (DanceGRPO / G2RPO); mode "rewards": normalise the weighted sum of rewards (Flow-GRPO). Clip to +-clip."""
    if mode == "advantages":
        adv = sum(weights[n] * group_advantages(r, eps, unbiased, global_std) for n, r in rewards.items())
    elif mode == "rewards":
        adv = group_advantages(sum(weights[n] * r for n, r in rewards.items()), eps, unbiased, global_std)
    else:
        fail(f"reward combination {mode!r} is not known; use 'advantages' or 'rewards'")
    return adv.clamp(-clip, clip)


def clipped_policy_loss(log_prob, old_log_prob, advantages, clip_range: float, kl=None, beta: float = 0.0):
    """PPO-clip surrogate on per-step log-probs, mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))) with r = exp(logp - logp_old),
    plus beta * kl. Also returns logging sums [ratio, clipped, approx_kl, policy loss, kl, count] and max |r - 1|."""
    ratio = torch.exp(log_prob - old_log_prob)
    policy = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)).mean()
    kl = torch.zeros_like(policy) if kl is None else kl
    r, d, n = ratio.detach(), (log_prob - old_log_prob).detach(), len(ratio)
    sums = torch.stack([r.sum(), ((r - 1).abs() > clip_range).float().sum(), (0.5 * d**2).sum(), policy.detach() * n,
                        kl.detach() * n, torch.tensor(float(n), device=r.device)])
    return policy + beta * kl, sums, (r - 1).abs().max()


# ======== 6. Distributed, seeding, logging, checkpoints ========
def setup_distributed():
    """torchrun-aware setup: NCCL on CUDA, gloo on CPU. Returns (rank, world_size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        import datetime  # a 12B-parameter checkpoint can take minutes to write while other ranks wait

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    return (dist.get_rank() if world > 1 else 0), world, device


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors from every rank along dim 0 (identity on one process)."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def broadcast_object(obj):
    """Rank 0's value of a picklable object on every rank (e.g. the run name)."""
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def optimizer_step(params, optimizer, max_grad_norm: float, sharded: bool) -> float:
    """DDP-style gradient averaging across ranks (FSDP reduces its own), norm clipping, step, zero.
    Returns the gradient norm before clipping."""
    for p in params if not sharded and dist.is_initialized() else []:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def seed_everything(seed: int, deterministic: bool = False):
    import random

    random.seed(seed), torch.manual_seed(seed)  # numpy is not used for anything random here
    torch.backends.cudnn.deterministic = deterministic


def make_writer(run_dir: str, args, track: bool = False, project: str = "flow-rl", rank: int = 0, resume: str | None = None):
    """Rank 0: TensorBoard writer in runs/<run_name> (plus wandb syncing it when `track`), hyperparameters as text.
    Resuming from the checkpoint `resume` (iteration N) first drops what the killed run logged after N: metrics.jsonl
    rows, eval_<i>.json, samples/eval_<i>.png and TensorBoard events, so the log reads like an uninterrupted run's."""
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    done = int(os.path.basename(resume)[5:]) if resume else None  # latest_checkpoint: always .../iter_<N>
    if done is not None and os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["iteration"] <= done]
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for d, name in [(d, n) for d in (run_dir, os.path.join(run_dir, "samples")) if os.path.isdir(d) for n in os.listdir(d)]:
            if name.startswith("eval_") and name.split(".")[0][5:].isdigit() and int(name.split(".")[0][5:]) > done:
                os.remove(os.path.join(d, name))

    if track:
        import wandb

        wandb.init(project=project, sync_tensorboard=True, config=vars(args), name=os.path.basename(run_dir),
                   save_code=True)
    writer = SummaryWriter(run_dir, purge_step=None if done is None else done + 1)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    return writer


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file, without a last line that a killed process left half written."""
    rows = []
    for line in open(path):
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def log_metrics(writer, run_dir: str, step: int, metrics: dict, per_sample: dict | None = None):
    """Scalars to TensorBoard and one JSON line per call to <run_dir>/metrics.jsonl (rank 0 only); `per_sample`
    (e.g. every evaluation pair's reward, for paired comparisons) to <run_dir>/eval_<step>.json."""
    if writer is None:
        return
    for k, v in metrics.items():
        writer.add_scalar(k, v, step)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iteration": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
    if per_sample is not None:
        with open(os.path.join(run_dir, f"eval_{step}.json"), "w") as f:
            json.dump({k: v.tolist() for k, v in per_sample.items()}, f)


def image_grid(images, captions, ncols: int = 6, path: str | None = None, title: str = ""):
    """A matplotlib figure of images [B, 3, H, W] in [0, 1] with a caption under each; saved to `path` if given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(ncols, len(images))
    rows, lines = math.ceil(len(images) / ncols), max(c.count("\n") + 1 for c in captions)  # caption lines above each
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
    """runs/<run>/samples/eval_<iteration>.png: the first n fixed evaluation pairs, captioned with prompt and rewards."""
    captions = ["\n".join(textwrap.wrap(p, 34) + [f"{k} {v[i]:.3f}" for k, v in scores.items()])
                for i, p in enumerate(prompts[:n])]
    image_grid(images[:n].cpu(), captions, path=os.path.join(run_dir, "samples", f"eval_{iteration}.png"),
               title=f"iteration {iteration}: ODE samples of fixed prompt / seed pairs")


def run_summary(run_dir: str, args, kind: str, weights: dict, seconds: float) -> str:
    """What a run did (from metrics.jsonl and eval_<i>.json): every evaluated reward at the first and the last evaluation
    of the same fixed pairs with the change's paired standard error, time and NFE, where the samples and the checkpoint
    are, and the lines that load it in diffusers."""
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "perf/nfe_per_iteration" in r]
    out = [f"\n{args.exp_name} on {args.model}: {len(rows)} iterations in {seconds / 60:.1f} min, "
           f"{sum(r['perf/nfe_per_iteration'] for r in rows):,.0f} transformer evaluations (NFE)"]
    evals = sorted(int(f[5:-5]) for f in os.listdir(run_dir) if f.startswith("eval_") and f.endswith(".json"))
    e0, e1 = (json.load(open(os.path.join(run_dir, f"eval_{i}.json"))) for i in (evals[:1] + evals[-1:])) if evals else ({}, {})
    if len(evals) > 1 and e0.keys() == e1.keys() and len(e0[args.rewards[0]]) == len(e1[args.rewards[0]]):
        for e in (e0, e1):  # the training objective on held-out pairs
            e["training reward"] = [sum(weights[k] * e[k][j] for k in weights) / sum(weights.values())  # weighted mean
                                    for j in range(len(e[args.rewards[0]]))]
        out.append(f"Evaluation on {len(e1[args.rewards[0]])} fixed prompt/seed pairs (ODE, {args.eval_steps} steps), "
                   f"iteration {evals[0]} -> {evals[-1]}, change +- paired standard error:")
        for name in ["training reward", *[k for k in e1 if k != "training reward"]]:
            a, b = torch.tensor(e0[name], dtype=torch.float64), torch.tensor(e1[name], dtype=torch.float64)
            d, se = float((b - a).mean()), float((b - a).std() / math.sqrt(len(a)))
            verdict = "improved" if d > 2 * se else "got worse" if d < -2 * se else "no change beyond 2 SE"
            out.append(f"  {name:>20}: {a.mean():.4f} -> {b.mean():.4f} ({d:+.4f} +- {se:.4f}, "
                       f"{d / se if se > 0 else 0:+.1f} SE): {verdict}")
    out.append(f"Samples of every evaluation: {os.path.join(run_dir, 'samples')}/eval_<iteration>.png")
    ckpt, model = latest_checkpoint(run_dir), MODEL_ALIASES.get(args.model, args.model)
    if ckpt:
        model = os.path.relpath(model) if os.path.abspath(model).startswith(os.getcwd() + os.sep) else model
        pipe_cls, tr_cls = ("Flux", "Flux") if kind == "flux" else ("StableDiffusion3", "SD3")
        load = (f"pipe = {pipe_cls}Pipeline.from_pretrained({model!r}, transformer={tr_cls}Transformer2DModel."
                f"from_pretrained({os.path.join(ckpt, 'transformer')!r}))" if args.full_finetune else
                f"pipe = {pipe_cls}Pipeline.from_pretrained({model!r}); pipe.load_lora_weights({os.path.join(ckpt, 'lora')!r})")
        out += [f"Checkpoint: {ckpt} (resume with --resume {run_dir}); in diffusers:",
                f"  from diffusers import {pipe_cls}Pipeline, {tr_cls}Transformer2DModel", f"  {load}",
                f"  image = pipe('a red circle on the left', height={args.resolution}, width={args.resolution}, "
                f"num_inference_steps={args.eval_steps}, guidance_scale={args.guidance}, "
                f"max_sequence_length={args.max_sequence_length}).images[0]"]
    return "\n".join(out)


@torch.no_grad()
def ema_update(ema: list, params: list, decay: float, step: int):
    """Exponential moving average of the trainable parameters (used for evaluation and the exported weights), with
    Flow-GRPO's warm-up: the decay is min((1 + s) / (10 + s), decay) after s optimizer steps."""
    decay = min((1 + step) / (10 + step), decay)
    for e, p in zip(ema, params):
        e.mul_(decay).add_(p.detach().float(), alpha=1 - decay)


@contextlib.contextmanager
def swapped_in(params: list, values):
    """Temporarily load `values` (e.g. the EMA) into `params`; a no-op when values is None."""
    backup = [p.detach().clone() for p in params] if values is not None else []
    with torch.no_grad():
        for p, v in zip(params, values if values is not None else []):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_state(path: str, iteration: int, transformer, optimizer, params, names, ema, args, pipe, sharded: bool,
               keep: int = 0):
    """Atomic checkpoint at `path` (written to path.tmp, published with one rename): state.pt (iteration, args; for an
    unsharded run also the trainable weights, optimizer and EMA), dcp/ (a sharded run: each rank writes its own shards
    of the weights and optimizer with torch.distributed.checkpoint, nothing is gathered), and the exported weights:
    lora/ (diffusers LoRA, `pipe.load_lora_weights`) or transformer/ (diffusers; a sharded run writes one file per
    rank plus an index, both read by `<Transformer>.from_pretrained`). With an EMA the exports hold the EMA."""
    from safetensors.torch import save_file

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "transformer"))
    _barrier()
    state = {"iteration": iteration, "args": vars(args)}
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(transformer, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "dcp"))
        files, mine = {}, {}
        for k, (name, t) in enumerate(transformer.state_dict().items()):  # every rank gathers one tensor at a time
            full, files[name] = t.full_tensor() if hasattr(t, "full_tensor") else t, f"{k % world + 1:05d}"
            if k % world == rank:
                mine[name] = full.detach().cpu().contiguous()
        save_file(mine, os.path.join(tmp, "transformer", f"diffusion_pytorch_model-{rank + 1:05d}-of-{world:05d}.safetensors"))
        if rank == 0:
            config = json.loads(transformer.to_json_string())
            config["_class_name"] = config["_class_name"].removeprefix("FSDP")  # the class FSDP2 wrapped
            with open(os.path.join(tmp, "transformer", "config.json"), "w") as f:
                json.dump(config, f, indent=1)
            weight_map = {n: f"diffusion_pytorch_model-{i}-of-{world:05d}.safetensors" for n, i in files.items()}
            with open(os.path.join(tmp, "transformer", "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    elif rank == 0:
        state.update(trainable={n: p.detach().cpu().clone() for n, p in zip(names, params)},
                     optimizer=optimizer.state_dict(), ema=dict(zip(names, (e.cpu() for e in ema))) if ema else None)
        with swapped_in(params, ema):
            if args.full_finetune:
                transformer.save_config(os.path.join(tmp, "transformer"))
                save_file({k: v.detach().contiguous().cpu() for k, v in transformer.state_dict().items()},
                          os.path.join(tmp, "transformer", "diffusion_pytorch_model.safetensors"))
            else:
                from peft.utils import get_peft_model_state_dict

                os.rmdir(os.path.join(tmp, "transformer"))
                type(pipe).save_lora_weights(os.path.join(tmp, "lora"), get_peft_model_state_dict(transformer))
    if rank == 0:
        torch.save(state, os.path.join(tmp, "state.pt"))
    _barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        old = sorted((d for d in os.listdir(os.path.dirname(path)) if d[5:].isdigit()), key=lambda d: int(d[5:]))
        for d in old[:-keep] if keep else []:  # a sharded FLUX.1-dev checkpoint is ~190 GB
            shutil.rmtree(os.path.join(os.path.dirname(path), d))
    _barrier()


def load_state(path: str, transformer, optimizer, params, names, sharded: bool, device, with_ema: bool):
    """Restore what save_state wrote (same world size for a sharded run). Returns (iteration, ema or None)."""
    state = load_safely(os.path.join(path, "state.pt"))
    if with_ema and not state.get("ema"):
        fail(f"--ema: the checkpoint {path!r} was saved without an EMA; resume with --no-ema")
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(transformer, optimizer)
        shards = {"model": model_state, "optim": optim_state}
        dcp.load(shards, checkpoint_id=os.path.join(path, "dcp"))  # each rank reads its own shards in place
        set_state_dict(transformer, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optim"])
    else:
        with torch.no_grad():
            for p, n in zip(params, names):
                p.copy_(state["trainable"][n])
        optimizer.load_state_dict(state["optimizer"])
    return state["iteration"], [state["ema"][n].to(device) for n in names] if with_ema else None


def latest_checkpoint(path: str):
    """The newest complete checkpoint <run>/checkpoints/iter_<N> under a run directory (or `path` itself if it is
    one), or None."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, "state.pt")):
        if not (os.path.basename(path)[5:].isdigit() and os.path.basename(os.path.dirname(path)) == "checkpoints"):
            fail(f"--resume {path!r} is not a run's checkpoints/iter_<N>; pass the run directory")
        return path
    root = os.path.join(path, "checkpoints")
    done = [d for d in os.listdir(root) if d.startswith("iter_") and not d.endswith(".tmp")] if os.path.isdir(root) else []
    return os.path.join(root, max(done, key=lambda d: int(d[5:]))) if done else None
