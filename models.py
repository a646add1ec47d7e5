"""The model families: what this project needs of a diffusers text-to-image (editing, text-to-video) pipeline,
one entry per family in FAMILIES. The algorithm files never name a family: common.py's model functions
(latent_shape, pipeline_sigmas, encode_prompts, velocity, decode, make_trainable, shard) look the loaded
pipeline's entry up by its `kind`.

An entry (a dict of plain functions and names) defines:
    pipelines       the diffusers pipeline classes it handles (by name)
    aliases         short --model names -> hub ids
    latent          (pipe, resolution: pixels square, or (height, width)) -> (C, H, W) of the latents the
                    samplers move, and the pixel multiple
    frames          (video families only) (pipe, num_frames or None) -> the latent frames F: latents are then
                    (C, F, H, W), and the samplers, log-probs and losses treat them as any other shape
    mu              (pipe, latent (C, H, W), num_steps) -> the schedule's shift parameter mu (None: no shift)
    base_sigmas     num_steps -> the noise levels before the shift (None: the scheduler's own, SD3)
    encode          (pipe, prompts, *, max_sequence_length, guidance, device) -> {name: [B, ...] tensors}
    velocity        (transformer, x [B, C, H, W] or [B, C, F, H, W], t [B] float32 sigma, emb, *, guidance,
                    detach_uncond) -> v, as dx/dsigma
    decode          (pipe, latents) -> the VAE's output in [-1, 1]: [B, 3, H, W], or frames [B, 3, F, H, W]
    lora_targets    transformer -> the peft target module names (attention and MLP projections)
    blocks          transformer -> its blocks in order (FSDP2's units, activation checkpointing)
    transformers    its transformer classes (by name)
    guidance        pipe -> how --guidance acts: "embedded" (an input of the model), "cfg" (true
                    classifier-free guidance, off at 1), "cfg0" (Z-Image's pos + g (pos - neg), off at 0) or
                    "none" (ignored: a step-distilled model)
    negative        the negative prompt of true CFG
    call_guidance   --guidance -> the pipeline __call__'s arguments for the same guidance (the run's summary)
    editing         (editing families only) (pipe, height, width) -> the (height, width) a source of that size
                    enters the VAE at (rundir.check_editing: a set's sources must resize alike); prompts may
                    carry source images (common.Prompt.images);
                    encode then also returns their tokens ("cond") and what places them (ids or shapes), per
                    prompt, which velocity puts after the noisy target's tokens and cuts off again; pipe.
                    condition_size (--condition-size) sets the size they are encoded at
    call_image      (editing families only) (height, width, condition_size) -> the __call__'s source arguments

Every velocity returns dx/dsigma in the latent layout the family's pipeline draws its noise in, so the same
initial noise and the same schedule give the pipeline's own latents (tests/test_families.py). Where a family
uses true CFG, the gradient flows through both predictions, as in Flow-GRPO's compute_log_prob since a482878
(2025-08-19) and every current implementation; detach_uncond stops it at the unconditional one (the old code).
Adding a family: write these functions and an entry, and build a tiny pipeline of it in toy/tiny_families.py.
"""
import numpy as np
import torch

_ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
         "attn.add_v_proj", "attn.to_add_out"]  # "attn.": SD3.5-M's second attention (attn2) gets none


def calculate_shift(tokens: int, config) -> float:
    """mu linear in the image token count (diffusers' calculate_shift), from the scheduler's config."""
    c = config
    base, top = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    m = (c.get("max_shift", 1.15) - c.get("base_shift", 0.5)) / (top - base)
    return tokens * m + c.get("base_shift", 0.5) - m * base


def linspace_sigmas(num_steps: int):
    """linspace(1, 1/T, T) in float64, as Flux, Qwen-Image and FLUX.2 pass it to their schedulers."""
    return np.linspace(1.0, 1 / num_steps, num_steps)


def cfg(uncond, cond, w: float, *, detach_uncond: bool):
    """uncond + w (cond - uncond); with `detach_uncond` the gradient reaches the conditional one only."""
    uncond = uncond.detach() if detach_uncond else uncond
    return uncond + w * (cond - uncond)


def pack(x):
    """[B, C, H, W] -> Flux's and Qwen-Image's 2x2 patches [B, H/2 * W/2, 4C]."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)


def unpack(tokens, shape):
    """pack's inverse, to `shape` [B, C, H, W]."""
    b, c, h, w = shape
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def trim(emb: dict, prefix: str = ""):
    """The rows' text embeddings cut to their longest prompt, and the mask (None when nothing is padded, as
    Qwen-Image's encode_prompt passes it)."""
    mask = emb[prefix + "mask"]
    n = int(mask.sum(1).max())
    mask = mask[:, :n]
    return emb[prefix + "embeds"][:, :n], (None if bool(mask.all()) else mask)


def padded(rows: list, length: int):
    """Variable-length [n_i, D] rows zero-padded to `length`: ([B, length, D], mask [B, length])."""
    out = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, :len(r)], mask[i, :len(r)] = r[:length], 1
    return out, mask


def square(resolution, *, f: int, mult: int, channels: int):
    """(channels, H / f, W / f) of an image `resolution` pixels square, or (height, width) pixels, or a
    one-line error."""
    h, w = resolution if isinstance(resolution, tuple) else (resolution, resolution)
    for flag, size in (("--resolution", h), ("--width", w)):
        if size < mult or size % mult:
            raise SystemExit(f"error: {flag} {size} is not allowed for this model; use a positive "
                             f"multiple of {mult}")
    return (channels, h // f, w // f), mult


# ======== FLUX.1 (FluxPipeline) ========
def flux_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, device=device,
                                           max_sequence_length=max_sequence_length)
    return {"embeds": embeds, "pooled": pooled}


def flux_velocity(transformer, x, t, emb, *, guidance, detach_uncond):
    """Packed 2x2 latents, position ids, the timestep sigma, the guidance embedding of FLUX.1-dev; an editing
    prompt's source tokens (emb "cond", FLUX.1 Kontext) after the target's, the prediction cut back to
    them."""
    from diffusers import FluxPipeline
    b, c, h, w = x.shape
    dtype = next(transformer.parameters()).dtype
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, dtype)
    txt_ids = torch.zeros(emb["embeds"].shape[1], 3, device=x.device, dtype=dtype)
    distilled = transformer.config.guidance_embeds  # FLUX.1-dev: guidance is an input, not CFG
    g = torch.full((b,), guidance, device=x.device, dtype=dtype) if distilled else None
    tokens = pack(x.to(dtype))
    if "cond" in emb:  # pipeline_flux_kontext.py: cat([latents, image_latents], 1), cat([ids, image_ids])
        tokens = torch.cat([tokens, emb["cond"].to(dtype)], 1)
        img_ids = torch.cat([img_ids, shared_ids(emb["cond_ids"]).to(dtype)])
    embeds, pooled = emb["embeds"].to(dtype), emb["pooled"].to(dtype)
    out = transformer(hidden_states=tokens, timestep=t, guidance=g, encoder_hidden_states=embeds,
                      pooled_projections=pooled, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
    return unpack(out[:, :h * w // 4], x.shape)


def vae_decode(pipe, z):
    """z / scaling_factor + shift_factor through the VAE (FLUX.1, SD3, Z-Image)."""
    cfg_ = pipe.vae.config
    z = (z / cfg_.scaling_factor + (cfg_.shift_factor or 0.0)).to(pipe.vae.dtype)
    return pipe.vae.decode(z, return_dict=False)[0]


def flux_blocks(model):
    return [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]


# ======== FLUX.1 Kontext (FluxKontextPipeline): editing, the source's tokens after the target's ========
def source_image(image):
    """A source image as the pipelines take it: a PIL RGB image of a file path, or of uint8 [3, H, W]."""
    from PIL import Image
    if isinstance(image, str):
        with Image.open(image) as f:
            return f.convert("RGB")
    return Image.fromarray(image.permute(1, 2, 0).cpu().numpy())


def condition_hw(height: int, width: int, *, size, multiple: int, preferred=None):
    """The (height, width) a source of (height, width) is resized to: with `size` None the pipeline's own
    (`preferred` (width, height) list: the one nearest in aspect ratio; none: as it is), 0 as it is, else the
    area of a size x size square at the source's aspect ratio; each side floored to `multiple`."""
    if size is None and preferred:
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in preferred)
    elif size:
        scale = size / (height * width) ** 0.5
        height, width = round(height * scale), round(width * scale)
    if height < multiple or width < multiple:
        raise SystemExit(f"error: a source image of {height}x{width} pixels is smaller than this model's "
                         f"multiple {multiple}; pass a larger --condition-size")
    return height // multiple * multiple, width // multiple * multiple


MIXED_SIZES = ("error: the source images of one batch have different sizes after resizing; pass "
               "--condition-size S (each source resized to S x S pixels' area) and sources of one aspect "
               "ratio")


def shared_ids(cond_ids):
    """The condition's position ids [N, 3] that every row of a batch shares, or a one-line error."""
    if len(cond_ids) > 1 and not bool((cond_ids == cond_ids[:1]).all()):
        raise SystemExit(MIXED_SIZES)
    return cond_ids[0]


def kontext_source_hw(pipe, height: int, width: int) -> tuple:
    """The (height, width) a source of (height, width) pixels enters the VAE at, as the pipeline's __call__
    resizes it: floored to the processor's multiple (get_default_height_width: the ratio it reads), then its
    preferred resolution nearest in aspect ratio, or pipe.condition_size's (condition_hw)."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
    shape = torch.empty(1, 3, 1, 1).expand(1, 3, height, width)  # its size alone: no pixels
    h, w = pipe.image_processor.get_default_height_width(shape)
    return condition_hw(h, w, size=getattr(pipe, "condition_size", None), multiple=2 * pipe.vae_scale_factor,
                        preferred=PREFERRED_KONTEXT_RESOLUTIONS)


def kontext_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    """FLUX.1's text embeddings and, for editing prompts, each one's source image resized as the pipeline's
    __call__ resizes it (its preferred resolution nearest in aspect ratio, or pipe.condition_size:
    condition_hw), VAE-encoded (the posterior's mode), normalised and packed: "cond" [B, N, 4C] and its
    position ids "cond_ids" [B, N, 3] (first axis 1: pipeline_flux_kontext.py prepare_latents)."""
    from diffusers import FluxKontextPipeline
    out = flux_encode(pipe, prompts, max_sequence_length=max_sequence_length, guidance=guidance,
                      device=device)
    counts = {len(getattr(p, "images", ())) for p in prompts}
    if counts == {0}:
        return out
    if counts != {1}:
        raise SystemExit(f"error: FLUX.1 Kontext edits one source image per prompt; these prompts have "
                         f"{sorted(counts)}")
    tokens, ids = [], []
    for p in prompts:
        image = source_image(p.images[0])
        h, w = kontext_source_hw(pipe, image.height, image.width)
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, h, w), h, w)
        z = pipe._encode_vae_image(pixels.to(pipe.vae.device, pipe.vae.dtype), generator=None)
        tokens.append(pack(z)[0])
        cond_ids = FluxKontextPipeline._prepare_latent_image_ids(1, z.shape[2] // 2, z.shape[3] // 2, "cpu",
                                                                 z.dtype)
        cond_ids[..., 0] = 1
        ids.append(cond_ids)
    if len({len(t) for t in tokens}) > 1:
        raise SystemExit(MIXED_SIZES)
    return {**out, "cond": torch.stack(tokens).to(device), "cond_ids": torch.stack(ids).to(device)}


# ======== Qwen-Image-Edit (QwenImageEdit[Plus]Pipeline): the sources' tokens after the target's ========
def qwen_edit_sources(pipe, images):
    """The pipeline's resizes of a prompt's source images: what its Qwen2.5-VL encoder sees, and each one's
    pixels for the VAE [1, 3, 1, H, W]. Plus (2509, 2511; pipeline_qwenimage_edit_plus.py:697-706): the
    encoder's at 384 x 384 pixels' area (CONDITION_IMAGE_SIZE), the VAE's at 1024 x 1024 (VAE_IMAGE_SIZE),
    both at the source's aspect ratio in multiples of 32 (calculate_dimensions, :158); 2508
    (pipeline_qwenimage_edit.py:623-624, 662-665): one resize to 1024 x 1024 pixels' area that both see.
    pipe.condition_size other than None sets the VAE's size alone (condition_hw: 0 the source as it is, S the
    area of S x S; floored to 2f); the encoder's stays the pipeline's."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
    plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
    size, processor = getattr(pipe, "condition_size", None), pipe.image_processor
    seen, pixels = [], []
    for image in map(source_image, images):
        ratio = image.width / image.height
        vae_h, vae_w = qwen_edit_source_hw(pipe, image.height, image.width)
        if plus:
            module = pipeline_qwenimage_edit_plus
            w, h = module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, ratio)
            seen.append(processor.resize(image, h, w))
            vae_image = image  # preprocess resizes it (:706)
        else:
            vae_image = processor.resize(image, vae_h, vae_w)  # the encoder's input too (:663)
            seen.append(vae_image)
        if size is not None:  # the encoder's input stays the pipeline's
            vae_image = processor.resize(image, vae_h, vae_w)
        pixels.append(processor.preprocess(vae_image, vae_h, vae_w).unsqueeze(2))
    return (seen if plus else seen[0]), pixels


def qwen_edit_source_hw(pipe, height: int, width: int) -> tuple:
    """The (height, width) a source of (height, width) pixels enters the VAE at (qwen_edit_sources): Plus
    1024 x 1024 pixels' area at its aspect ratio in multiples of 32 (calculate_dimensions), 2508 the same
    (its own calculate_dimensions), or pipe.condition_size's (condition_hw, floored to 2f)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
    size = getattr(pipe, "condition_size", None)
    if size is not None:
        return condition_hw(height, width, size=size, multiple=2 * pipe.vae_scale_factor)
    if type(pipe).__name__ == "QwenImageEditPlusPipeline":
        module = pipeline_qwenimage_edit_plus
        w, h = module.calculate_dimensions(module.VAE_IMAGE_SIZE, width / height)
    else:
        w, h, _ = pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, width / height)
    return h, w


def qwen_edit_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    """Each editing prompt encoded alone as the pipeline's __call__ encodes it: its instruction and its
    sources' resizes for the Qwen2.5-VL encoder (qwen_edit_sources) through encode_prompt (the edit template,
    its 64 tokens dropped; Plus: "Picture i: " before each image), the negative prompt " " with the same
    images under true CFG (pipeline_qwenimage_edit_plus.py:720-738), each padded to max_sequence_length
    with a mask (the pipeline cuts nothing: longer is a one-line error); the sources VAE-encoded (the
    posterior's mode, normalised per channel: _encode_vae_image, :421-443), packed and concatenated:
    "cond" [B, N, 4C], and their latent sizes / 2, "cond_shapes" [B, K, 2] (img_shapes, :753-761)."""
    plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
    counts = {len(getattr(p, "images", ())) for p in prompts}
    if 0 in counts or (not plus and counts != {1}) or len(counts) > 1:
        allowed = "source images, as many for every prompt" if plus else "one source image per prompt"
        raise SystemExit(f"error: this {type(pipe).__name__} edits {allowed}; these prompts have "
                         f"{sorted(counts)} (an editing prompt set: .jsonl rows with \"image\" or "
                         f"\"images\")")
    texts = [("", [str(p) for p in prompts])]
    texts += [("neg_", [FAMILIES["qwenimage_edit"]["negative"]] * len(prompts))] if guidance > 1 else []
    rows, tokens, shapes = {prefix: [] for prefix, _ in texts}, [], []
    for i, p in enumerate(prompts):
        seen, pixels = qwen_edit_sources(pipe, p.images)
        for prefix, batch in texts:
            embeds, _ = pipe.encode_prompt(batch[i], image=seen, device=device)
            if (n := embeds.shape[1]) > max_sequence_length:
                raise SystemExit(f"error: the prompt {str(p)[:60]!r} with its {len(p.images)} source "
                                 f"image(s) is {n} tokens for the text encoder, more than "
                                 f"--max-sequence-length {max_sequence_length}; pass "
                                 f"--max-sequence-length {n} or more")
            rows[prefix].append(embeds[0])
        z = [pipe._encode_vae_image(x.to(pipe.vae.device, pipe.vae.dtype), generator=None) for x in pixels]
        tokens.append(torch.cat([pack(latents[:, :, 0])[0] for latents in z]))
        shapes.append(torch.tensor([[latents.shape[3] // 2, latents.shape[4] // 2] for latents in z]))
    if len({t.shape for t in tokens}) > 1:
        raise SystemExit(MIXED_SIZES)
    out = {}
    for prefix, _ in texts:
        out[prefix + "embeds"], out[prefix + "mask"] = padded(rows[prefix], max_sequence_length)
    return {**out, "cond": torch.stack(tokens).to(device), "cond_shapes": torch.stack(shapes).to(device)}


# ======== SD3 (StableDiffusion3Pipeline) ========
def sd3_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    embeds, neg, pooled, neg_pooled = pipe.encode_prompt(
        prompts, prompts, prompts, device=device, do_classifier_free_guidance=guidance > 1,
        negative_prompt="", negative_prompt_2="", negative_prompt_3="",
        max_sequence_length=max_sequence_length)
    out = {"embeds": embeds, "pooled": pooled}
    return {**out, "neg_embeds": neg, "neg_pooled": neg_pooled} if guidance > 1 else out


def sd3_velocity(transformer, x, t, emb, *, guidance, detach_uncond):
    """Timestep 1000 sigma; CFG as one forward of [neg; pos]."""
    dtype = next(transformer.parameters()).dtype
    both = "neg_embeds" in emb and guidance > 1
    embeds = torch.cat([emb["neg_embeds"], emb["embeds"]]) if both else emb["embeds"]
    pooled = torch.cat([emb["neg_pooled"], emb["pooled"]]) if both else emb["pooled"]
    hidden, timestep = (torch.cat([x, x]), torch.cat([t, t]) * 1000) if both else (x, t * 1000)
    out = transformer(hidden_states=hidden.to(dtype), timestep=timestep,
                      encoder_hidden_states=embeds.to(dtype), pooled_projections=pooled.to(dtype),
                      return_dict=False)[0]
    return cfg(*out.chunk(2), guidance, detach_uncond=detach_uncond) if both else out


# ======== Qwen-Image (QwenImagePipeline) ========
def qwen_latent(pipe, resolution):
    f = pipe.vae_scale_factor
    return square(resolution, f=f, mult=2 * f, channels=pipe.transformer.config.in_channels // 4)


def qwen_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    """The pipeline's encode_prompt (its system template, the 34 template tokens dropped), padded to
    max_sequence_length with a mask; true CFG: the negative prompt " " (the model card's) for every row."""
    out = {}
    negative = [("neg_", [FAMILIES["qwenimage"]["negative"]] * len(prompts))] if guidance > 1 else []
    for prefix, texts in [("", prompts)] + negative:
        embeds, mask = pipe.encode_prompt(texts, device=device, max_sequence_length=max_sequence_length)
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device) if mask is None else mask
        rows = [e[:int(m.sum())] for e, m in zip(embeds, mask)]
        out[prefix + "embeds"], out[prefix + "mask"] = padded(rows, max_sequence_length)
    return out


def qwen_velocity(transformer, x, t, emb, *, guidance, detach_uncond):
    """Packed 2x2 latents, the timestep sigma (rounded in float32 as the pipeline's t / 1000), the text mask;
    true CFG with the guided prediction rescaled per token to the conditional one's norm
    (pipeline_qwenimage.py). Qwen-Image-Edit: the sources' tokens (emb "cond") after the target's, their
    shapes after its in img_shapes, each prediction cut back to the target's before CFG (:826, :840)."""
    b, c, h, w = x.shape
    dtype = next(transformer.parameters()).dtype
    timestep = (t * 1000) / 1000
    shapes = [[(1, h // 2, w // 2)]] * b
    tokens = pack(x.to(dtype))
    if "cond" in emb:  # Qwen-Image-Edit: cat([latents, image_latents], 1) (pipeline_qwenimage_edit_plus:811)
        tokens = torch.cat([tokens, emb["cond"].to(dtype)], 1)
        shapes = [[(1, h // 2, w // 2), *[(1, *map(int, s)) for s in shared_ids(emb["cond_shapes"])]]] * b

    def forward(prefix):
        embeds, mask = trim(emb, prefix)
        return transformer(hidden_states=tokens, timestep=timestep, guidance=None,
                           encoder_hidden_states_mask=mask, encoder_hidden_states=embeds.to(dtype),
                           img_shapes=shapes, return_dict=False)[0][:, :h * w // 4]
    v = forward("")
    if "neg_embeds" in emb and guidance > 1:
        combined = cfg(forward("neg_"), v, guidance, detach_uncond=detach_uncond)
        v = combined * (v.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    return unpack(v, x.shape)


def qwen_decode(pipe, z):
    """Per-channel latent mean and std undone (written as the pipeline writes it), one frame."""
    c = pipe.vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    z = (z[:, :, None] / std + mean).to(pipe.vae.dtype)
    return pipe.vae.decode(z, return_dict=False)[0][:, :, 0]


# ======== FLUX.2 [dev] and [klein] (Flux2Pipeline, Flux2KleinPipeline) ========
def flux2_latent(pipe, resolution):
    """The pipeline's noise space: 2x2-patchified, BatchNorm-standardised latents [4C, H / 2f, W / 2f]."""
    f = pipe.vae_scale_factor
    (c, h, w), mult = square(resolution, f=2 * f, mult=2 * f, channels=pipe.transformer.config.in_channels)
    return (c, h, w), mult


def flux2_mu(pipe, latent, num_steps):
    """compute_empirical_mu(image tokens, steps): FLUX.2's shift depends on the number of steps."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
    return compute_empirical_mu(image_seq_len=latent[1] * latent[2], num_steps=num_steps)


FLUX2_MAX_AREA = 1024 * 1024  # pipeline_flux2.py l. 895-896: a larger reference is resized to this area


def flux2_reference(pipe, image):
    """A reference image's pixels [1, 3, H, W] as the pipeline's __call__ prepares them (pipeline_flux2.py
    l. 893-903, pipeline_flux2_klein.py l. 772-782): over 1 MP resized to 1 MP (LANCZOS, sides truncated),
    then centre-cropped to sides of the multiple 2f. pipe.condition_size 0: no cap; S > 0: first resized
    (LANCZOS) to the area of an S x S square at its aspect ratio (condition_hw), as a source resized before
    the call."""
    from PIL import Image
    size = getattr(pipe, "condition_size", None)
    if size is None and image.width * image.height > FLUX2_MAX_AREA:
        image = pipe.image_processor._resize_to_target_area(image, FLUX2_MAX_AREA)
    elif size:
        h, w = condition_hw(image.height, image.width, size=size, multiple=1)
        image = image.resize((w, h), Image.Resampling.LANCZOS)
    h, w = condition_hw(image.height, image.width, size=0, multiple=2 * pipe.vae_scale_factor)
    return pipe.image_processor.preprocess(image, height=h, width=w, resize_mode="crop")  # crop: no resize


def flux2_reference_hw(pipe, height: int, width: int) -> tuple:
    """The (height, width) a reference of (height, width) pixels enters the VAE at (flux2_reference): over
    1 MP the sides of _resize_to_target_area (truncated), or pipe.condition_size's, then floored to 2f."""
    size = getattr(pipe, "condition_size", None)
    if size is None and width * height > FLUX2_MAX_AREA:
        scale = (FLUX2_MAX_AREA / (width * height)) ** 0.5
        height, width = int(height * scale), int(width * scale)
    elif size:
        height, width = condition_hw(height, width, size=size, multiple=1)
    return condition_hw(height, width, size=0, multiple=2 * pipe.vae_scale_factor)


def flux2_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    """The pipeline's encode_prompt (its chat template; hidden layers 10, 20, 30 of Mistral, or 9, 18, 27 of
    Qwen3 in [klein], stacked), padded to max_sequence_length; [klein] base with CFG: "" as the negative.
    Editing prompts: their reference images (flux2_reference) VAE-encoded (the posterior's mode), patchified,
    BatchNorm-standardised and packed one after the other: "cond" [B, N, 4C], and "cond_ids" [B, N, 4] with
    the time coordinate 10 + 10 i of the i-th reference (pipeline_flux2.py prepare_image_latents, l. 654-687,
    and _prepare_image_ids, l. 407-454)."""
    embeds, _ = pipe.encode_prompt(prompts, device=device, max_sequence_length=max_sequence_length)
    out = {"embeds": embeds}
    if flux2_cfg(pipe.transformer, guidance, getattr(pipe.config, "is_distilled", None)):
        out["neg_embeds"], _ = pipe.encode_prompt([""] * len(prompts), device=device,
                                                  max_sequence_length=max_sequence_length)
    counts = {len(getattr(p, "images", ())) for p in prompts}
    if counts == {0}:
        return out
    if len(counts) > 1:
        raise SystemExit(f"error: the prompts of one batch have {sorted(counts)} reference images; FLUX.2 "
                         f"batches prompts with as many references each: give every prompt as many images")
    tokens, ids = [], []
    for p in prompts:
        latents = [pipe._encode_vae_image(flux2_reference(pipe, source_image(image)).to(
            pipe.vae.device, pipe.vae.dtype), generator=None) for image in p.images]
        tokens.append(torch.cat([pipe._pack_latents(z)[0] for z in latents]))
        ids.append(pipe._prepare_image_ids(latents)[0])
    if len({t.shape for t in tokens}) > 1:
        raise SystemExit(MIXED_SIZES)
    return {**out, "cond": torch.stack(tokens).to(device), "cond_ids": torch.stack(ids).to(device)}


def flux2_cfg(transformer, guidance: float, distilled) -> bool:
    """True CFG in [klein] base (no guidance embedding, not step-distilled) when guidance > 1."""
    return not transformer.config.guidance_embeds and not distilled and guidance > 1


def flux2_velocity(transformer, x, t, emb, *, guidance, detach_uncond):
    """Tokens [B, H W, 4C], 4-axis position ids (T, H, W, L), the timestep sigma as the pipeline rounds it;
    [dev]: the guidance embedding; [klein] base: true CFG against "". An editing prompt's reference tokens
    (emb "cond") after the target's in both passes, the prediction cut back to the target's."""
    from diffusers import Flux2Pipeline
    b, c, h, w = x.shape
    dtype = next(transformer.parameters()).dtype
    tokens = x.reshape(b, c, h * w).permute(0, 2, 1).to(dtype)
    img_ids = Flux2Pipeline._prepare_latent_ids(x).to(x.device)
    g = torch.full((b,), guidance, device=x.device, dtype=torch.float32) \
        if transformer.config.guidance_embeds else None
    if "cond" in emb:  # pipeline_flux2.py l. 970-972; [klein] l. 846-848, its negative pass too (l. 872)
        tokens = torch.cat([tokens, emb["cond"].to(dtype)], 1)
        cond_ids = shared_ids(emb["cond_ids"]).to(img_ids).expand(b, -1, -1)
        img_ids = torch.cat([img_ids, cond_ids], 1)

    def forward(embeds):
        txt_ids = Flux2Pipeline._prepare_text_ids(embeds).to(x.device)
        return transformer(hidden_states=tokens, timestep=(t * 1000) / 1000, guidance=g,
                           encoder_hidden_states=embeds.to(dtype), txt_ids=txt_ids, img_ids=img_ids,
                           return_dict=False)[0][:, :h * w]
    v = forward(emb["embeds"])
    if "neg_embeds" in emb and guidance > 1:
        v = cfg(forward(emb["neg_embeds"]), v, guidance, detach_uncond=detach_uncond)
    return v.permute(0, 2, 1).reshape(b, c, h, w)


def flux2_vae_latents(pipe, z):
    """The pipeline's latents in the VAE's space: the BatchNorm standardisation undone, the 2x2 patches
    unfolded."""
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    z = z * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(z) + bn.running_mean.view(1, -1, 1, 1).to(z)
    b, c4, h, w = z.shape
    return z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)


def flux2_decode(pipe, z):
    return pipe.vae.decode(flux2_vae_latents(pipe, z).to(pipe.vae.dtype), return_dict=False)[0]


def flux2_lora_targets(transformer):
    """Flux's projections, FLUX.2's MLPs and the single blocks' fused projections (their `attn.to_out` named
    per block: the double blocks' `attn.to_out` is a ModuleList with the same suffix)."""
    singles = range(len(transformer.single_transformer_blocks))
    return _ATTN + ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                    "attn.to_qkv_mlp_proj"] + [f"single_transformer_blocks.{i}.attn.to_out" for i in singles]


# ======== Z-Image (ZImagePipeline) ========
def zimage_latent(pipe, resolution):
    f = pipe.vae_scale_factor
    return square(resolution, f=f, mult=2 * f, channels=pipe.transformer.config.in_channels)


def zimage_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    """The pipeline's encode_prompt (Qwen3's chat template, hidden_states[-2] without padding), padded to
    max_sequence_length with a mask; CFG (guidance > 0): "" as the negative."""
    pos, neg = pipe.encode_prompt(prompts, device=device, do_classifier_free_guidance=guidance > 0,
                                  max_sequence_length=max_sequence_length)
    out = dict(zip(("embeds", "mask"), padded(pos, max_sequence_length)))
    if guidance > 0:
        out.update(zip(("neg_embeds", "neg_mask"), padded(neg, max_sequence_length)))
    return out


def zimage_velocity(transformer, x, t, emb, *, guidance, detach_uncond):
    """Latents as a list of [C, 1, H, W], captions as a list without padding, the model's time 1 - sigma; its
    output is minus the velocity. CFG: pos + g (pos - neg), one forward of [pos; neg] as the pipeline's."""
    dtype = next(transformer.parameters()).dtype
    both = "neg_embeds" in emb and guidance > 0
    caps = [e[:int(m.sum())].to(dtype) for e, m in zip(emb["embeds"], emb["mask"])]
    if both:
        caps += [e[:int(m.sum())].to(dtype) for e, m in zip(emb["neg_embeds"], emb["neg_mask"])]
    n = 2 if both else 1
    time = (1000 - t.repeat(n) * 1000) / 1000
    out = transformer(list(x.to(dtype).repeat(n, 1, 1, 1).unsqueeze(2).unbind(0)), time, caps,
                      return_dict=False)[0]
    out = torch.stack([o.float() for o in out]).squeeze(2)
    v = out[:len(x)]
    if both:  # written as the pipeline's pos + g (pos - neg)
        neg = out[len(x):].detach() if detach_uncond else out[len(x):]
        v = v + guidance * (v - neg)
    return -v


ZIMAGE_BLOCKS = ("noise_refiner", "context_refiner", "layers")


# ======== Wan2.1 / Wan2.2 (WanPipeline): video, latents [B, C, F, H, W] ========
def wan_latent(pipe, resolution):
    """(z_dim, H / f, W / f) of a frame, f the VAE's spatial factor (Wan2.1 8, Wan2.2-TI2V-5B 16), in
    multiples of f times the transformer's 2x2 patches."""
    if getattr(pipe, "transformer_2", None) is not None or pipe.transformer is None:
        raise SystemExit(f"error: this {type(pipe).__name__} has two transformers (Wan2.2-T2V-A14B's high- "
                         f"and low-noise experts, switched at boundary_ratio): not supported, the files "
                         f"train one transformer (docs/video.md); use Wan2.1 or Wan2.2-TI2V-5B")
    f, patch = pipe.vae_scale_factor_spatial, pipe.transformer.config.patch_size[-1]
    return square(resolution, f=f, mult=f * patch, channels=pipe.vae.config.z_dim)


def wan_frames(pipe, num_frames):
    """The latent frames of a clip of `num_frames` (none: 33, Flow-GRPO's Wan recipe): the VAE keeps the first
    frame and compresses each next 4 into one (prepare_latents), or a one-line error."""
    k = pipe.vae_scale_factor_temporal
    num_frames = 33 if num_frames is None else num_frames
    if num_frames < 1 or (num_frames - 1) % k:
        raise SystemExit(f"error: --num-frames {num_frames} is not allowed for this {type(pipe).__name__}; "
                         f"use 1 + {k} k frames (1, {1 + k}, {1 + 2 * k}, ..., 33, ..., 81): its VAE keeps "
                         f"the first frame and compresses each next {k} into one")
    return (num_frames - 1) // k + 1


def wan_encode(pipe, prompts, *, max_sequence_length, guidance, device):
    """UMT5's last hidden states cut to each prompt's tokens and zero-padded to max_sequence_length (the
    pipeline's encode_prompt; no mask: the transformer attends to the zeros); true CFG: "" as the negative
    (the pipeline's default, and Flow-GRPO's train_wan2_1.py)."""
    embeds, neg = pipe.encode_prompt(prompts, negative_prompt=[""] * len(prompts),
                                     do_classifier_free_guidance=guidance > 1, device=device,
                                     max_sequence_length=max_sequence_length)
    return {"embeds": embeds, "neg_embeds": neg} if guidance > 1 else {"embeds": embeds}


def wan_velocity(transformer, x, t, emb, *, guidance, detach_uncond):
    """Latents [B, C, F, H, W] as they are; the timestep floor(1000 sigma), the integer timesteps the anchors'
    schedulers give Wan (the UniPC scheduler's int64 timesteps: Flow-GRPO's wan_pipeline_with_logprob,
    Flow-Factory's UniPCMultistepSDEScheduler; DanceGRPO: int(sigma * 1000)); true CFG as two forwards."""
    dtype = next(transformer.parameters()).dtype
    timestep = torch.floor(t.double() * 1000).float()

    def forward(embeds):
        return transformer(hidden_states=x.to(dtype), timestep=timestep,
                           encoder_hidden_states=embeds.to(dtype), return_dict=False)[0]
    v = forward(emb["embeds"])
    if "neg_embeds" in emb and guidance > 1:
        v = cfg(forward(emb["neg_embeds"]), v, guidance, detach_uncond=detach_uncond)
    return v


def wan_decode(pipe, z):
    """Per-channel latent mean and std undone (as the pipeline writes it), the VAE tiled where a frame is
    larger than its 256-pixel tiles (enable_tiling: 480x832 decodes in tiles, the toy's 32x32 in one):
    frames [B, 3, F', H, W] in [-1, 1]."""
    vae, c = pipe.vae, pipe.vae.config
    if not vae.use_tiling:
        vae.enable_tiling()
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return vae.decode((z / std + mean).to(vae.dtype), return_dict=False)[0]

FAMILIES = {
    "flux": {
        "call_guidance": lambda g: f"guidance_scale={g}",
        "pipelines": ("FluxPipeline",), "transformers": ("FluxTransformer2DModel",),
        "aliases": {"flux-dev": "black-forest-labs/FLUX.1-dev"},
        "latent": lambda pipe, r: square(r, f=pipe.vae_scale_factor, mult=2 * pipe.vae_scale_factor,
                                         channels=pipe.transformer.config.in_channels // 4),
        "mu": lambda pipe, latent, steps: calculate_shift(latent[1] * latent[2] // 4, pipe.scheduler.config),
        "base_sigmas": linspace_sigmas, "encode": flux_encode, "velocity": flux_velocity,
        "decode": vae_decode,
        "lora_targets": lambda t: _ATTN + ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                           "ff_context.net.2"],
        "blocks": flux_blocks, "guidance": lambda pipe: "embedded" if pipe.transformer.config.guidance_embeds
        else "none", "negative": None},
    "sd3": {
        "call_guidance": lambda g: f"guidance_scale={g}",
        "pipelines": ("StableDiffusion3Pipeline",), "transformers": ("SD3Transformer2DModel",),
        "aliases": {"sd3.5-medium": "stabilityai/stable-diffusion-3.5-medium"},
        "latent": lambda pipe, r: square(r, f=pipe.vae_scale_factor,
                                         mult=pipe.vae_scale_factor * pipe.transformer.config.patch_size,
                                         channels=pipe.transformer.config.in_channels),
        "mu": lambda pipe, latent, steps: calculate_shift(latent[1] * latent[2] // 4, pipe.scheduler.config)
        if pipe.scheduler.config.get("use_dynamic_shifting") else None,
        "base_sigmas": None, "encode": sd3_encode, "velocity": sd3_velocity, "decode": vae_decode,
        "lora_targets": lambda t: _ATTN, "blocks": flux_blocks, "guidance": lambda pipe: "cfg",
        "negative": ""},
    "qwenimage": {
        "call_guidance": lambda g: f"true_cfg_scale={g}, negative_prompt=' '",
        "pipelines": ("QwenImagePipeline",), "transformers": ("QwenImageTransformer2DModel",),
        "aliases": {"qwen-image": "Qwen/Qwen-Image"},
        "latent": qwen_latent,
        "mu": lambda pipe, latent, steps: calculate_shift(latent[1] * latent[2] // 4, pipe.scheduler.config),
        "base_sigmas": linspace_sigmas, "encode": qwen_encode, "velocity": qwen_velocity,
        "decode": qwen_decode,
        "lora_targets": lambda t: _ATTN + ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                           "txt_mlp.net.2"],
        "blocks": lambda t: list(t.transformer_blocks), "guidance": lambda pipe: "cfg", "negative": " "},
    "qwenimage_edit": {
        "call_guidance": lambda g: f"true_cfg_scale={g}, negative_prompt=' '",
        "pipelines": ("QwenImageEditPlusPipeline", "QwenImageEditPipeline"),
        "transformers": ("QwenImageTransformer2DModel",),
        "aliases": {"qwen-image-edit": "Qwen/Qwen-Image-Edit",
                    "qwen-image-edit-2509": "Qwen/Qwen-Image-Edit-2509",
                    "qwen-image-edit-2511": "Qwen/Qwen-Image-Edit-2511"},
        "latent": qwen_latent,
        "mu": lambda pipe, latent, steps: calculate_shift(latent[1] * latent[2] // 4, pipe.scheduler.config),
        "base_sigmas": linspace_sigmas, "encode": qwen_edit_encode, "velocity": qwen_velocity,
        "decode": qwen_decode, "editing": qwen_edit_source_hw,
        "call_image": lambda h, w, size: "image=source, ",  # (the pipeline resizes it itself)
        "lora_targets": lambda t: _ATTN + ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                           "txt_mlp.net.2"],
        "blocks": lambda t: list(t.transformer_blocks), "guidance": lambda pipe: "cfg", "negative": " "},
    "flux2": {
        "call_guidance": lambda g: f"guidance_scale={g}",
        "pipelines": ("Flux2Pipeline", "Flux2KleinPipeline"), "transformers": ("Flux2Transformer2DModel",),
        "aliases": {"flux2-dev": "black-forest-labs/FLUX.2-dev",
                    "flux2-klein-base-4b": "black-forest-labs/FLUX.2-klein-base-4B",
                    "flux2-klein-base-9b": "black-forest-labs/FLUX.2-klein-base-9B",
                    "flux2-klein-4b": "black-forest-labs/FLUX.2-klein-4B",
                    "flux2-klein-9b": "black-forest-labs/FLUX.2-klein-9B"},
        "latent": flux2_latent, "mu": flux2_mu, "base_sigmas": linspace_sigmas, "encode": flux2_encode,
        "velocity": flux2_velocity, "decode": flux2_decode, "lora_targets": flux2_lora_targets,
        "editing": flux2_reference_hw,  # one or several references per prompt (over 1 MP: resized to 1 MP)
        "call_image": lambda h, w, size: "image=[source], ",  # --condition-size > 0: resize the source first
        "blocks": flux_blocks, "guidance": lambda pipe: "embedded" if pipe.transformer.config.guidance_embeds
        else "none" if getattr(pipe.config, "is_distilled", False) else "cfg", "negative": ""},
    "zimage": {
        "call_guidance": lambda g: f"guidance_scale={g}",
        "pipelines": ("ZImagePipeline",), "transformers": ("ZImageTransformer2DModel",),
        "aliases": {"z-image": "Tongyi-MAI/Z-Image", "z-image-turbo": "Tongyi-MAI/Z-Image-Turbo"},
        "latent": zimage_latent,
        "mu": lambda pipe, latent, steps: calculate_shift(latent[1] * latent[2] // 4, pipe.scheduler.config),
        "base_sigmas": lambda steps: torch.linspace(1.0, 1 / steps, steps).tolist(),  # float32, as Z-Image
        "encode": zimage_encode, "velocity": zimage_velocity, "decode": vae_decode,
        "lora_targets": lambda t: ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"],
        "blocks": lambda t: [b for name in ZIMAGE_BLOCKS for b in getattr(t, name)],
        "guidance": lambda pipe: "cfg0", "negative": ""},
    "wan": {
        "call_guidance": lambda g: f"guidance_scale={g}, negative_prompt=''",
        "pipelines": ("WanPipeline",), "transformers": ("WanTransformer3DModel",),
        "aliases": {"wan2.1-t2v-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                    "wan2.1-t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                    "wan2.2-ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"},
        "latent": wan_latent, "frames": wan_frames,
        "mu": lambda pipe, latent, steps: None,  # the shipped UniPC scheduler's flow_shift, static
        "base_sigmas": None, "encode": wan_encode, "velocity": wan_velocity, "decode": wan_decode,
        "lora_targets": lambda t: [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v",
                                                                                   "to_out.0")]
        + ["ffn.net.0.proj", "ffn.net.2"],  # Flow-Factory's default_target_modules (models/wan/wan2_t2v.py)
        "blocks": lambda t: list(t.blocks), "guidance": lambda pipe: "cfg", "negative": ""},
}

FAMILIES["kontext"] = {  # FLUX.1 Kontext: FLUX.1-dev's entry, its sources' tokens after the target's
    **FAMILIES["flux"], "pipelines": ("FluxKontextPipeline",),
    "aliases": {"flux-kontext-dev": "black-forest-labs/FLUX.1-Kontext-dev"}, "encode": kontext_encode,
    "editing": kontext_source_hw, "call_image": lambda h, w, size: f"image=source, max_area={h * w}, "
    + ("" if size is None else "_auto_resize=False, ")}  # (--condition-size > 0: resize the source first)


def family_of(pipe) -> str | None:
    """The FAMILIES key whose entry handles this pipeline's class, or None."""
    name = type(pipe).__name__
    return next((k for k, f in FAMILIES.items() if name in f["pipelines"]), None)


def blocks(transformer) -> list:
    """The blocks of a family's transformer (FSDP2-wrapped or not), in order."""
    name = type(transformer).__name__.removeprefix("FSDP")
    kind = next(k for k, f in FAMILIES.items() if name in f["transformers"])
    return FAMILIES[kind]["blocks"](transformer)


def sigmas(pipe, kind: str, *, num_steps: int, latent: tuple):
    """The noise levels the pipeline itself samples with, then 0: a copy of its scheduler set as its
    __call__ sets it (the family's base levels and mu)."""
    entry = FAMILIES[kind]
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    mu = entry["mu"](pipe, latent, num_steps)
    if entry["base_sigmas"] is None:
        scheduler.set_timesteps(num_steps, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=entry["base_sigmas"](num_steps), mu=mu)
    return scheduler.sigmas.float().cpu()

