"""The learned reward models, each loaded as fn(images [B, 3, H, W] in [0, 1], prompts) -> float32 [B]:
HPS-v2.1 and the CLIP score (open_clip), PickScore, ImageReward (a port onto transformers' BLIP modules), the
LAION aesthetic predictor, UnifiedReward (a client for an OpenAI-compatible server), Flow-GRPO's OCR reward
(RapidOCR), GenEval and DeQA-Score (clients of Flow-GRPO's reward server), VideoAlign, and for editing the
CLIP image similarity of an edit to its source and an edit-judge VLM's client. common.load_rewards
imports this module only when one of them is asked for; where their weights come from is common.RewardModels
(read here by attribute: this module imports nothing of the project, so it can be copied alone).

The towers run in the given dtype (bf16 on GPUs), every projection, logit scale and head in float32.
A server's answer is outside data: read within a size bound, parsed within bounds (parse_json, plain_loads)
and quoted short and escaped (shown)."""
import io
import itertools
import json
import os
import pickle
import re
import reprlib

import numpy as np

import torch


def fail(message: str):
    """Stop with a one-line error (no traceback), as common.fail."""
    raise SystemExit(f"error: {message}")


# ---- Data from outside, as common.py's section 0 (copies: this module imports nothing of the project) ----
JSON_DEPTH, JSON_DIGITS = 32, 64


def parse_json(data: str | bytes, *, limit: int = 1 << 20, depth: int = JSON_DEPTH):
    """common.parse_json: JSON within `limit` bytes, `depth` levels, JSON_DIGITS digits; else ValueError."""
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


class _Short(reprlib.Repr):
    def repr_int(self, x, level):
        return repr(x) if abs(x) < 10**40 else f"<an integer of {x.bit_length():,} bits>"

    def repr_bytes(self, x, level):
        return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")


_SHORT = _Short()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel = 60, 60, 2
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def shown(value) -> str:
    """common.shown: a value from outside as a short repr, control characters escaped."""
    text = _SHORT.repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


REWARD_SOURCES = {  # the RewardModels fields each reward reads
    "hps": ["hps_checkpoint"], "clip": ["clip_model"], "aesthetic": ["aesthetic_head", "aesthetic_clip"],
    "image_similarity": ["similarity_clip"],
    "pickscore": ["pickscore_model", "pickscore_processor"],
    "imagereward": ["imagereward_checkpoint", "imagereward_med_config", "imagereward_tokenizer"]}


def is_local_path(spec: str) -> bool:
    """A reward model location meant as a local path (not 'owner/name', 'owner/name:file', 'hf-hub:...')."""
    if spec.startswith(("hf-hub:", "http://", "https://")):
        return False
    repo = spec.split(":")[0]
    return spec.startswith((".", "/", "~")) or repo.count("/") > 1 or repo.endswith((".pt", ".pth", ".json"))


def check(name: str, models):
    """The locations reward `name` reads from `models` (a common.RewardModels): a local file that does not
    exist, or UnifiedReward without a server, is a one-line error before any model loads."""
    if name == "unifiedreward" and not models.unifiedreward_url:
        fail("the unifiedreward reward needs --unifiedreward-url, the address of a server that serves it")
    server = name.split("_")[0] if name.startswith("videoalign_") else name
    servers = ("geneval", "deqa", "unifiedreward", "videoalign", "editreward")
    url = getattr(models, f"{server}_url") if server in servers else None
    if url is not None:
        check_url(url, f"--{server}-url")
    key = None if name != "unifiedreward" else (models.unifiedreward_api_key
                                                or os.environ.get("UNIFIEDREWARD_API_KEY"))
    if key and not all("!" <= c <= "~" for c in key):  # never shown: a secret
        fail("the UnifiedReward API key (--unifiedreward-api-key or $UNIFIEDREWARD_API_KEY) holds a space, a "
             "control or a non-ASCII character, which an HTTP header cannot carry; pass the key alone")
    if name == "ocr":
        import importlib.util
        missing = [m for m in ("rapidocr", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:
            fail(f"the ocr reward needs an OCR engine ({' and '.join(missing)} not installed): {OCR_INSTALL}")
    for field in REWARD_SOURCES.get(name, []):
        spec = getattr(models, field)
        if is_local_path(spec) and not os.path.exists(os.path.expanduser(spec)):
            fail(f"--{field.replace('_', '-')} {spec!r} does not exist; pass an existing path or a hub id")


def check_url(url: str, flag: str):
    """An http(s):// address with a host (a port in 1-65535), no space or control character; else one line."""
    import urllib.parse
    try:
        parts = urllib.parse.urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port beyond 65535, a bracket left open
        parts, port_ok = None, False
    if not url.startswith(("http://", "https://")) or not port_ok or not parts.hostname or \
            not all(" " < c <= "~" for c in url):
        fail(f"{flag} {shown(url)} is not an http:// address of the reward server (a host, a port in "
             f"1-65535, no spaces)")


def load_safely(path: str, *, what: str = "weights"):
    """Weights from safetensors, or a pickle read with weights_only=True (a downloaded pickle cannot run
    code); a file that cannot be read is a one-line error naming `what` (e.g. the flag that gave it)."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated download, another format, a pickle with code in it
        reason = (str(e).strip().splitlines() or [""])[0].split(". ")[0]  # the first sentence, whole
        reason = reason if len(reason) <= 200 else reason[:reason.rfind(" ", 0, 200)] + " ..."
        fail(f"{what} {path!r} cannot be read ({type(e).__name__}: {reason})")


def hub_file(spec: str, flag: str) -> str:
    """A local file, or 'repo:filename' downloaded from the hub; else a one-line error naming `flag`."""
    if os.path.isfile(spec):
        return spec
    repo, _, filename = spec.partition(":")
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download(repo, filename)
    except Exception as e:
        fail(f"{flag} {spec!r} is neither a local file nor downloadable ({type(e).__name__}); pass a local "
             f"path")


def load(name: str, device, *, models, dtype=torch.float32, fps: int = 16):
    """The reward `name` (one of common.LEARNED), from the locations in `models` (a common.RewardModels); a
    video reward sends `fps` with the frames."""
    if name == "hps":
        checkpoint = hub_file(models.hps_checkpoint, "--hps-checkpoint")
        return open_clip_reward("ViT-H-14", device, checkpoint, pad_square=True, dtype=dtype)
    if name == "clip":  # CLIP score (MixGRPO, G2RPO)
        return open_clip_reward(models.clip_model, device, dtype=dtype)
    if name == "pickscore":
        return pickscore_reward(models.pickscore_model, models.pickscore_processor, device, dtype=dtype)
    if name == "imagereward":
        return imagereward_reward(models.imagereward_checkpoint, models.imagereward_med_config,
                                  models.imagereward_tokenizer, device, dtype=dtype)
    if name == "aesthetic":
        return aesthetic_reward(models.aesthetic_head, models.aesthetic_clip, device, dtype=dtype)
    if name == "unifiedreward":
        key = models.unifiedreward_api_key or os.environ.get("UNIFIEDREWARD_API_KEY")
        return unifiedreward_reward(models.unifiedreward_url, model=models.unifiedreward_model, api_key=key,
                                    deadline=models.reward_timeout, retries=models.reward_retries)
    if name == "ocr":
        return ocr_reward()
    if name == "geneval":
        return geneval_reward(models.geneval_url, deadline=models.reward_timeout,
                              retries=models.reward_retries)
    if name == "deqa":
        return deqa_reward(models.deqa_url, deadline=models.reward_timeout, retries=models.reward_retries)
    if name == "image_similarity":
        return image_similarity_reward(models.similarity_clip, device, dtype=dtype)
    if name == "editreward":
        return editreward_reward(models.editreward_url, deadline=models.reward_timeout,
                                 retries=models.reward_retries)
    if name.startswith("videoalign_"):
        return videoalign_reward(models.videoalign_url, name[len("videoalign_"):].upper(), fps=fps,
                                 deadline=models.reward_timeout, retries=models.reward_retries)
    fail(f"{name!r} is not a reward model of rewards.py")


def _clip_preprocess(images, size: int, mean, std, *, pad_square: bool, crop_offset: str = "round"):
    """Resize the longest side to `size` and pad (HPS's ResizeMaxSize, sizes rounded), or the shortest side
    and centre-crop (sizes truncated; the crop offset rounded as torchvision's CenterCrop, crop_offset
    "round", or floored as transformers' CLIPImageProcessor, "floor"); normalise."""
    import torch.nn.functional as F

    h, w = images.shape[-2:]
    if pad_square:
        nh, nw = max(1, round(h * size / max(h, w))), max(1, round(w * size / max(h, w)))
    else:
        nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    x = images.float()
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    if pad_square:
        x = F.pad(x, (0, size - nw, 0, size - nh))
    else:
        if crop_offset == "floor":
            top, left = (nh - size) // 2, (nw - size) // 2
        else:
            top, left = round((nh - size) / 2), round((nw - size) / 2)
        x = x[..., top:top + size, left:left + size]
    mean, std = torch.tensor(mean).view(1, 3, 1, 1).to(x), torch.tensor(std).view(1, 3, 1, 1).to(x)
    return (x - mean) / std


def load_strictly(module, state: dict, *, what: str):
    """module.load_state_dict(state, strict=True), a mismatch being a one-line error that names `what`."""
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        fail(f"{what} does not fit the model ({str(e).strip().splitlines()[-1].strip()[:160]}); is it the "
             f"right file?")
    if missing or unexpected:
        fail(f"{what} does not fit the model: {len(missing)} missing keys ({', '.join(missing[:3])}), "
             f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])}); is it the right file?")


def float32_head(owner, name: str):
    """Take the projection owner.<name> (a matrix or a Linear) out of a tower about to run in bf16, so that it
    runs in float32 on the tower's output instead: fn(features) -> float32 features."""
    head = getattr(owner, name)
    setattr(owner, name, None)
    if isinstance(head, torch.nn.Linear):
        head = head.float()
        return lambda features: head(features.float())
    if head is None:
        return lambda features: features.float()
    weight = head.detach().float()
    return lambda features: features.float() @ weight


def open_clip_reward(name: str, device, checkpoint: str | None = None, *, pad_square: bool = False,
                     dtype=torch.float32):
    """Cosine of the L2-normalised open_clip image and text features (no logit scale), the towers in `dtype`,
    the projections in float32. `name`: an architecture ('ViT-H-14', built without pretrained weights),
    'hf-hub:...' or a local open_clip directory; `checkpoint`: a state_dict loaded strictly on top (HPS)."""
    import open_clip

    name = f"local-dir:{name}" if os.path.isdir(name) else name
    try:
        model = open_clip.create_model(name, pretrained=None)
    except Exception as e:
        fail(f"cannot load open_clip model {name!r} ({str(e).splitlines()[0][:200]}); pass a local directory")
    if checkpoint:
        state = load_safely(checkpoint, what="--hps-checkpoint")
        load_strictly(model, state.get("state_dict", state), what=f"--hps-checkpoint {checkpoint!r}")
    model.eval().requires_grad_(False).to(device)
    image_head, text_head = float32_head(model.visual, "proj"), float32_head(model, "text_projection")
    model.to(dtype)
    size, cfg = model.visual.image_size, open_clip.get_model_preprocess_cfg(model)  # its own mean / std
    size = size[0] if isinstance(size, (tuple, list)) else size
    tokenizer = open_clip.get_tokenizer(name)

    @torch.no_grad()
    def score(images, prompts):
        x = _clip_preprocess(images.to(device), size, cfg["mean"], cfg["std"], pad_square=pad_square)
        x = x.to(dtype)
        img = torch.nn.functional.normalize(image_head(model.encode_image(x)), dim=-1)
        txt = text_head(model.encode_text(tokenizer(list(prompts)).to(device)))
        return (img * torch.nn.functional.normalize(txt, dim=-1)).sum(-1)

    return score


def pickscore_reward(model_path: str, processor_path: str, device, *, dtype=torch.float32):
    """PickScore as Flow-GRPO's reward: logit_scale.exp() cos(text, image) / 26 (transformers CLIPModel); the
    towers in `dtype`, the projections and the logit scale in float32."""
    from transformers import AutoProcessor, CLIPModel

    try:
        processor = AutoProcessor.from_pretrained(processor_path)
        model = CLIPModel.from_pretrained(model_path).eval().requires_grad_(False)
    except Exception as e:
        fail(f"cannot load PickScore from {model_path!r} / {processor_path!r} ({type(e).__name__}); "
             f"pass --pickscore-model and --pickscore-processor local directories")
    scale = model.logit_scale.detach().float().exp().to(device)
    image_head = model.visual_projection.float().to(device)
    text_head = model.text_projection.float().to(device)
    vision, text = model.vision_model.to(device, dtype), model.text_model.to(device, dtype)
    ip = processor.image_processor
    size = ip.crop_size if isinstance(ip.crop_size, int) else ip.crop_size["height"]

    @torch.no_grad()
    def score(images, prompts):
        x = _clip_preprocess(images.to(device), size, ip.image_mean, ip.image_std, pad_square=False,
                            crop_offset="floor").to(dtype)
        tok = processor.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=77,
                                  return_tensors="pt").to(device)
        img = torch.nn.functional.normalize(image_head(vision(pixel_values=x).pooler_output.float()), dim=-1)
        txt = torch.nn.functional.normalize(text_head(text(**tok).pooler_output.float()), dim=-1)
        return scale * (img * txt).sum(-1) / 26

    return score


# ImageReward.pt's BLIP ViT (timm-style names under blip.visual_encoder.) -> transformers' BlipVisionModel
_IR_VISION = [(r"cls_token", "embeddings.class_embedding"), (r"pos_embed", "embeddings.position_embedding"),
              (r"patch_embed\.proj\.(\w+)", r"embeddings.patch_embedding.\1"),
              (r"blocks\.(\d+)\.norm([12])\.(\w+)", r"encoder.layers.\1.layer_norm\2.\3"),
              (r"blocks\.(\d+)\.attn\.qkv\.(\w+)", r"encoder.layers.\1.self_attn.qkv.\2"),
              (r"blocks\.(\d+)\.attn\.proj\.(\w+)", r"encoder.layers.\1.self_attn.projection.\2"),
              (r"blocks\.(\d+)\.mlp\.(fc[12])\.(\w+)", r"encoder.layers.\1.mlp.\2.\3"),
              (r"norm\.(\w+)", r"post_layernorm.\1")]
# keys the score never reads (the original loads with strict=False): BLIP's contrastive projections, a buffer
_IR_UNUSED = ("blip.vision_proj.weight", "blip.vision_proj.bias", "blip.text_proj.weight",
              "blip.text_proj.bias", "blip.text_encoder.embeddings.position_ids")


def imagereward_reward(checkpoint: str, med_config: str, tokenizer: str, device, *, dtype=torch.float32):
    """ImageReward as THUDM's image-reward package scores it, without that package, on transformers' BLIP
    modules: the BLIP ViT (BlipVisionModel, sizes read from the checkpoint, 64-wide heads) -> BERT with
    cross-attention to every image token (BlipTextModel from med_config.json) -> the [CLS] feature -> the MLP
    768-1024-128-64-16-1 (no activations) -> (r - 0.16717362830052426) / 1.0333394966054072. Prompts padded
    and truncated to 35 tokens, [CLS] first; CLIP preprocessing at 224. Towers in `dtype`, the head in
    float32."""
    import re

    from transformers import BertTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    state = load_safely(hub_file(checkpoint, "--imagereward-checkpoint"), what="--imagereward-checkpoint")
    try:
        with open(hub_file(med_config, "--imagereward-med-config"), "rb") as f:
            med = parse_json(f.read((1 << 20) + 1))
    except (OSError, ValueError) as e:
        fail(f"--imagereward-med-config {med_config!r} cannot be read as JSON ({type(e).__name__})")
    try:
        tok = BertTokenizer.from_pretrained(tokenizer)
    except Exception as e:
        fail(f"cannot load the ImageReward tokenizer {tokenizer!r} ({type(e).__name__}); pass "
             f"--imagereward-tokenizer /path/to/bert-base-uncased")
    tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})  # as BLIP's
    vision_sd, text_sd, head_sd, unknown = {}, {}, {}, []
    heads = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.layers.")})
    for key, value in state.items():
        name = key.split(".", 2)[-1]
        if key.startswith("blip.visual_encoder."):
            new = next((re.sub(f"^{a}$", b, name) for a, b in _IR_VISION if re.fullmatch(a, name)), None)
            vision_sd[new] = value
            unknown += [key] if new is None else []
        elif key.startswith("blip.text_encoder.") and key not in _IR_UNUSED:
            text_sd[name] = value  # BLIP's med.py BertModel names are BlipTextModel's
        elif key.startswith("mlp.layers."):  # Linear layers 0, 2, 4, 6, 7 of a Sequential with dropouts
            head_sd[f"{heads.index(int(name.split('.')[0]))}.{name.split('.')[1]}"] = value
        elif key not in _IR_UNUSED:
            unknown.append(key)
    if unknown:
        fail(f"the ImageReward checkpoint has keys that are not ImageReward's ({', '.join(unknown[:3])}); "
             f"pass --imagereward-checkpoint /path/to/ImageReward.pt")
    width, _, _, patch = vision_sd["embeddings.patch_embedding.weight"].shape
    grid = round((vision_sd["embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    layers = len({k.split(".")[2] for k in vision_sd if k.startswith("encoder.layers.")})
    vision = BlipVisionModel(BlipVisionConfig(  # BLIP's vit.py: GELU, LayerNorm eps 1e-6
        hidden_size=width, intermediate_size=vision_sd["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=layers, num_attention_heads=width // 64, image_size=patch * grid, patch_size=patch,
        hidden_act="gelu", layer_norm_eps=1e-6))
    text_cfg = {k: med[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "max_position_embeddings", "hidden_act",
                                    "layer_norm_eps", "pad_token_id")}
    # is_decoder only builds the cross-attention; the forward passes is_decoder=False (bidirectional)
    text = BlipTextModel(BlipTextConfig(**text_cfg, encoder_hidden_size=width, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0, is_decoder=True,
                                        bos_token_id=tok.bos_token_id, sep_token_id=tok.sep_token_id),
                         add_pooling_layer=False)
    shapes = [head_sd[f"{i}.weight"].shape for i in range(len(heads))]
    head = torch.nn.Sequential(*[torch.nn.Linear(n_in, n_out) for n_out, n_in in shapes])
    for module, sd in ((vision, vision_sd), (text, text_sd), (head, head_sd)):
        load_strictly(module, sd, what=f"--imagereward-checkpoint {checkpoint!r}")
        module.eval().requires_grad_(False).to(device, dtype if module is not head else torch.float32)
    size = vision.config.image_size
    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)

    def tokenize(prompts):
        return tok(list(prompts), padding="max_length", truncation=True, max_length=35, return_tensors="pt")

    @torch.no_grad()
    def score(images, prompts):
        x = _clip_preprocess(images.to(device), size, clip_mean, clip_std, pad_square=False).to(dtype)
        t = tokenize(prompts).to(device)
        image_tokens = vision(pixel_values=x).last_hidden_state  # every token attended to, as the original
        cls = text(input_ids=t.input_ids, attention_mask=t.attention_mask, encoder_hidden_states=image_tokens,
                   is_decoder=False).last_hidden_state[:, 0]
        return (head(cls.float()).squeeze(-1) - 0.16717362830052426) / 1.0333394966054072

    score.tokenize = tokenize  # the original's tokenisation (tests)
    return score


def aesthetic_reward(head: str, clip_model: str, device, *, dtype=torch.float32):
    """The LAION improved aesthetic predictor as Flow-GRPO's aesthetic_scorer.py: the L2-normalised projected
    CLIP ViT-L/14 image embedding through the MLP d-1024-128-64-16-1 (no activations; the state_dict keys
    layers.0/2/4/6/7) of sac+logos+ava1-l14-linearMSE.pth; about 1-10. CLIP in `dtype`, the head in
    float32."""
    from transformers import CLIPImageProcessor, CLIPModel

    state = load_safely(hub_file(head, "--aesthetic-head"), what="--aesthetic-head")  # the small file first
    try:
        ip = CLIPImageProcessor.from_pretrained(clip_model)
        model = CLIPModel.from_pretrained(clip_model).eval().requires_grad_(False)
    except Exception as e:
        fail(f"cannot load the aesthetic CLIP {clip_model!r} ({type(e).__name__}); pass --aesthetic-clip")
    linear = (0, 2, 4, 6, 7)  # the Linear layers between the dropouts of the official nn.Sequential
    if sorted(state) != sorted(f"layers.{i}.{p}" for i in linear for p in ("weight", "bias")) or \
            state["layers.0.weight"].shape[1] != model.config.projection_dim:
        fail(f"--aesthetic-head {head!r} is not the aesthetic predictor's head for {clip_model!r} (keys "
             f"layers.0/2/4/6/7, input {model.config.projection_dim})")
    mlp = torch.nn.Sequential(*[torch.nn.Linear(*state[f"layers.{i}.weight"].shape[::-1]) for i in linear])
    mlp.load_state_dict({f"{j}.{p}": state[f"layers.{i}.{p}"] for j, i in enumerate(linear)
                         for p in ("weight", "bias")})
    mlp.eval().requires_grad_(False).to(device)
    image_head = model.visual_projection.float().to(device)
    vision = model.vision_model.to(device, dtype)
    size = ip.crop_size if isinstance(ip.crop_size, int) else ip.crop_size["height"]

    @torch.no_grad()
    def score(images, prompts):
        x = _clip_preprocess(images.to(device), size, ip.image_mean, ip.image_std, pad_square=False,
                            crop_offset="floor").to(dtype)
        embedding = image_head(vision(pixel_values=x).pooler_output.float())
        return mlp(torch.nn.functional.normalize(embedding, dim=-1)).squeeze(-1)

    return score


# UnifiedReward's point-score question, as its sglang_inference.py and Flow-GRPO's rewards.py send it
UNIFIEDREWARD_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to "
    "evaluate this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this "
    "image aligns with the provided caption. Consider the accuracy of depicted objects, their relationships, "
    "and attributes as described in the caption.\n2. Overall Image Quality: Examine the visual quality of "
    "this image, including clarity, detail preservation, color accuracy, and overall aesthetic appeal.\n"
    "Based on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as "
    "follows:\nText Caption: [{prompt}]")


def unifiedreward_reward(url: str, *, model: str, api_key: str | None = None, scale: float = 5.0,
                         workers: int = 8, deadline: float = 600, retries: int = 3):
    """UnifiedReward from a server with the OpenAI chat-completions API (sglang, vLLM): one request per image
    (its 512 x 512 PNG as a data URL, then UNIFIEDREWARD_QUESTION), temperature 0, `workers` at a time (post:
    retries, and `deadline` seconds for a batch's requests); the first 'Final Score: x' of the answer, read as
    written and within the question's 1-5, / `scale` (5: Flow-GRPO's reward; 1: the papers' 1-5). `api_key`
    goes as 'Authorization: Bearer' (a server started with --api-key). A server that cannot be reached, a
    refused key or an answer without a score in 1-5 stops the run with a one-line error (never a silent 0)."""
    import base64
    import concurrent.futures
    import re
    import time

    from PIL import Image

    endpoint = url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
    what = f"the UnifiedReward server {endpoint}"

    def ask(pixels, prompt: str, until: float) -> str:
        buf = io.BytesIO()
        Image.fromarray(pixels).resize((512, 512), Image.BICUBIC).save(buf, format="PNG")
        data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": data}},
                   {"type": "text", "text": UNIFIEDREWARD_QUESTION.format(prompt=prompt)}]
        body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0}
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        why = "refused the API key" if api_key else "needs an API key and none was given"
        advice = ("pass the key it was started with (--api-key) as --unifiedreward-api-key or "
                  "$UNIFIEDREWARD_API_KEY")
        refused = {401: (why, advice), 403: (why, advice)}
        answer = post(endpoint, json.dumps(body).encode(), headers, until=until, retries=retries, what=what,
                      refused=refused, hint="start it or pass --unifiedreward-url")
        try:
            text = parse_json(answer, limit=ANSWER_LIMIT)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            if "levels" in str(e) or "digits" in str(e):  # parse_json's bounds
                fail(f"{what} answered with JSON {e}; is it the right server?")
            text = None
        if not isinstance(text, str):
            fail(f"{what} answered without choices[0].message.content ({shown(answer)})")
        return text

    def score(images, prompts):
        pixels = uint8_pixels(images)
        until = time.monotonic() + deadline
        with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(prompts)))) as pool:
            answers = list(pool.map(ask, pixels, prompts, [until] * len(prompts)))
        scores = []
        for answer in answers:
            match = re.search(r"Final Score:\s*([-+]?\d+(?:\.\d+)?)", answer)
            if match is None:
                fail(f"the UnifiedReward answer from {endpoint} has no 'Final Score: <1-5>': {shown(answer)}")
            value = float(match.group(1))
            if not 1 <= value <= 5:
                fail(f"{what} answered 'Final Score: {match.group(1)}', outside the question's scale of 1 "
                     f"to 5 (in {shown(answer)})")
            scores.append(value / scale)
        return torch.tensor(scores)

    return score


def uint8_pixels(images):
    """Images [B, 3, H, W] in [0, 1] as uint8 [B, H, W, 3] numpy, as Flow-GRPO's (x * 255).round().clamp()."""
    return (images.detach().float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()


# ---- OCR: Flow-GRPO's flow_grpo/ocr.py on RapidOCR (PaddleOCR's PP-OCR models as ONNX, in its wheel) ----
OCR_INSTALL = "pip install -r requirements-ocr.txt (rapidocr, onnxruntime)"


def ocr_target(prompt: str) -> str | None:
    """The text inside the prompt's first pair of double quotes (Flow-GRPO's ocr.py:31, prompt.split('"')[1]),
    None without a pair."""
    parts = str(prompt).split('"')
    return parts[1] if len(parts) >= 3 else None


def levenshtein(a: str, b: str) -> int:
    """The edit distance (insertions, deletions, substitutions of a character), as Levenshtein.distance."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_score(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR reward (ocr.py:44-60): spaces removed and lowercased on both sides; 1 if the target is
    a substring of the recognised text, else 1 - min(Levenshtein(recognised, target), len) / len."""
    recognised, target = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    distance = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1 - distance / len(target)


def ocr_engine():
    """RapidOCR (the rapidocr package on onnxruntime, its shipped PP-OCR detection and recognition models, no
    download) as fn(pixels [H, W, 3] uint8) -> [(text, confidence)] per detected line, without the angle
    classifier (Flow-GRPO: PaddleOCR(use_angle_cls=False), ocr(img, cls=False)); both drop lines below 0.5."""
    import logging

    try:
        from rapidocr import RapidOCR
    except ImportError:
        fail(f"the ocr reward needs an OCR engine: {OCR_INSTALL}")
    engine = RapidOCR(params={"Global.use_cls": False, "Global.log_level": "error"})
    logging.getLogger("RapidOCR").setLevel(logging.ERROR)

    def read(pixels):
        out = engine(pixels, use_cls=False)
        return list(zip(out.txts or (), out.scores or ()))

    return read


def ocr_reward(engine=None):
    """Flow-GRPO's OCR reward: each image read by `engine` (fn(pixels [H, W, 3] uint8) -> [(text,
    confidence)]; default ocr_engine()), the texts of the lines with confidence > 0 concatenated (ocr.py:44),
    scored by ocr_score against the prompt's quoted text. An engine error is a one-line error (the official
    code scores 0 and goes on)."""
    read = engine or ocr_engine()

    def score(images, prompts):
        targets = [ocr_target(p) for p in prompts]
        if any(t is None or not t.replace(" ", "") for t in targets):
            fail(f"the ocr reward needs a non-empty text in double quotes in every prompt: {prompts[0]!r}")
        out = []
        for image, target in zip(uint8_pixels(images), targets):
            try:
                lines = read(image)
            except Exception as e:
                fail(f"the OCR engine failed on an image ({type(e).__name__}: {str(e)[:120]})")
            out.append(ocr_score("".join(text for text, confidence in lines if confidence > 0), target))
        return torch.tensor(out)

    return score


# ---- Prompts with metadata (GenEval's .jsonl lines) ----
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
GENEVAL_RELATIONS = ("left of", "right of", "above", "below")


def geneval_metadata_problem(meta) -> str | None:
    """What is wrong with one line of GenEval metadata (as reward_server/gen_eval.py reads it: tag, include
    [{class, count, color?, position: [relation, index of an earlier include]?}], exclude? [{class, count}]),
    or None."""
    if not isinstance(meta, dict) or meta.get("tag") not in GENEVAL_TAGS:
        return f"its tag is not one of {', '.join(GENEVAL_TAGS)}"
    include, exclude = meta.get("include"), meta.get("exclude", [])
    if not isinstance(include, list) or not include or not isinstance(exclude, list):
        return "include must be a non-empty list of objects (and exclude a list)"
    for key, clauses in (("include", include), ("exclude", exclude)):
        for i, c in enumerate(clauses):
            c = c if isinstance(c, dict) else {}
            count = c.get("count")
            if not isinstance(c.get("class"), str) or isinstance(count, bool) or not isinstance(count, int) \
                    or count < 1:
                return f"{key}[{i}] needs a class (a string) and a count (an integer >= 1)"
            if "color" in c and not isinstance(c["color"], str):
                return f"{key}[{i}]'s color is not a string"
            position = c.get("position")
            if position is not None and not (isinstance(position, list) and len(position) == 2 and position[0]
                                             in GENEVAL_RELATIONS and position[1] in range(i)):
                return (f"{key}[{i}]'s position is not [relation, index of an earlier include] with a "
                        f"relation in {', '.join(GENEVAL_RELATIONS)}")
    return None


def check_prompts(names, prompts, where: list[str]):
    """The prompts the rewards `names` need, before any model loads: ocr a non-empty text in double quotes,
    geneval GenEval metadata (prompt.metadata, from a .jsonl file); `where` names each prompt (its line)."""
    for prompt, place in zip(prompts, where):
        target = ocr_target(prompt)
        if "ocr" in names and target is None:
            fail(f"{place} has no text in double quotes for the ocr reward: {str(prompt)[:60]!r}")
        if "ocr" in names and not target.replace(" ", ""):
            fail(f"{place} quotes an empty text; the ocr reward needs a text to render: {str(prompt)[:60]!r}")
        if "geneval" in names:
            meta = getattr(prompt, "metadata", None)
            if meta is None:
                fail(f"the geneval reward needs GenEval metadata; {place} is plain text: pass a .jsonl "
                     f"metadata file (data/geneval/test_metadata.jsonl)")
            problem = geneval_metadata_problem(meta)
            if problem:
                fail(f"{place}: {problem} (GenEval metadata)")


# ---- Clients of Flow-GRPO's reward server (github.com/yifan123/reward-server): GenEval and DeQA-Score ----
class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain values only (dict, list, tuple, str, bytes, int, float, bool, None: pickle's own
    opcodes; what the reward server sends): every class or function lookup, the only way a pickle can run
    code, is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id")


PLAIN_VALUES = 100_000  # values a server's answer may hold, each shared reference counted where it is used


def plain_bounds(value, *, values: int = PLAIN_VALUES, depth: int = JSON_DEPTH) -> str | None:
    """Why an unpickled value is too large to handle (more than `values` values when every shared reference is
    counted where it is used, as printing or comparing it would visit them: a small pickle can reference one
    list 64 times 7 levels deep) or too deep (more than `depth` levels), else None. Stops at the bound."""
    stack, count = [(value, 0)], 0
    while stack:
        v, level = stack.pop()
        if level > depth:
            return f"nested deeper than {depth} levels"
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else \
            v if isinstance(v, (list, tuple, set, frozenset)) else ()
        count += 1 + len(items)
        if count > values:
            return f"more than {values:,} values"
        stack += [(x, level + 1) for x in items]
    return None


def plain_loads(data: bytes, url: str):
    """A reward server's pickled answer, plain values only and within plain_bounds; anything else is a
    one-line error naming `url`."""
    try:
        value = PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if str(e).startswith("refused"):
            fail(f"the reward server {url} answered with a pickle that is not plain data ({e}); nothing of "
                 f"it was run: is it the reward server?")
        why = shown(str(e))[1:-1]  # (unquoted)
    except Exception as e:  # not a pickle at all: a web page, a truncated answer
        why = f"{type(e).__name__}: {shown(str(e))[1:-1]}"
    else:
        too_large = plain_bounds(value)
        if too_large is None:
            return value
        fail(f"the reward server {url} answered with a pickle of {too_large} ({len(data):,} bytes); is it "
             f"the reward server?")
    fail(f"the reward server {url} answered with no pickle ({why}; {len(data)} bytes: {shown(data)})")


def jpeg_batches(images, size: int = 64):
    """Each image as JPEG bytes (PIL's default quality 75, as Flow-GRPO's clients) and the batches of the
    official np.array_split(..., ceil(n / size)): index tensors of near-equal length."""
    from PIL import Image

    jpegs = []
    for pixels in uint8_pixels(images):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    return jpegs, torch.arange(len(jpegs)).tensor_split(-(-len(jpegs) // size))


TRANSIENT = (500, 502, 503, 504, 429)  # HTTP answers that a later try may not get (the rest stay as they are)
ANSWER_LIMIT = 64 << 20  # bytes of a server's answer (GenEval's for 64 images: a few kB)


def post(url: str, body: bytes, headers: dict, *, until: float, retries: int, what: str, refused=None,
         hint: str = "start it (docs/rewards.md: reward servers) or pass its URL") -> bytes:
    """POST `body` to `url` and return the whole answer, or stop with one line naming `what` (the server)
    and what it did. Every try ends by `until` (time.monotonic()): a server that stalls or sends a byte at a
    time cannot hold a run longer (each try runs in a watchdog thread). A refused connection, a reset or a
    connection dropped mid-answer, 120 s without a byte and HTTP 5xx / 429 are retried `retries` times, 0.5,
    1, 2 ... s apart; `refused` {HTTP code: (why, what to do)} stops at once."""
    import http.client
    import threading
    import time
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local or in-cluster server
    request = urllib.request.Request(url, body, headers)

    def attempt(box: dict):
        try:
            # a socket timeout past the deadline: the watchdog, not the socket, ends a try that reaches it
            with opener.open(request, timeout=min(120.0, until - time.monotonic() + 1.0)) as response:
                whole = response.length is not None and response.length <= ANSWER_LIMIT  # a Content-Length
                box["answer"] = response.read(None if whole else ANSWER_LIMIT + 1)  # no more than the bound
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    error, tries = "no answer", 0
    for tries in range(1, retries + 2):
        box = {}
        thread = threading.Thread(target=attempt, args=(box,), daemon=True)  # abandoned if it overruns
        thread.start()
        thread.join(max(0.0, until - time.monotonic()))
        if thread.is_alive():
            error = f"no whole answer within the deadline (--reward-timeout); {error} before" if tries > 1 \
                else "no whole answer within the deadline (--reward-timeout)"
            break
        if "answer" in box and len(box["answer"]) > ANSWER_LIMIT:
            fail(f"{what} answered with more than {ANSWER_LIMIT:,} bytes; is it the right server?")
        if "answer" in box:
            return box["answer"]
        e = box["error"]
        if isinstance(e, urllib.error.HTTPError):
            last = (e.read(1 << 16).decode("utf-8", "replace").strip().splitlines() or [""])[-1]  # its error
            error = f"HTTP {e.code}" + (f": {shown(last)[1:-1]}" if last else "")  # escaped, unquoted
            if refused and e.code in refused:
                fail(f"{what} {refused[e.code][0]} (HTTP {e.code}); {refused[e.code][1]}")
            if e.code not in TRANSIENT:  # a bad request stays bad
                break
        elif isinstance(e, (OSError, http.client.HTTPException)):  # refused, reset, cut short, timed out
            error = f"{type(e).__name__}: {shown(str(getattr(e, 'reason', e)))[1:-1]}"  # escaped
        else:
            raise e
        pause = 0.5 * 2 ** (tries - 1)
        if tries <= retries and time.monotonic() + pause >= until:
            error += "; no time left for another try (--reward-timeout)"
            break
        time.sleep(pause if tries <= retries else 0)
    fail(f"{what} failed after {tries} {'try' if tries == 1 else 'tries'} ({error}); {hint}")


def server_post(url: str, payload: dict, *, until: float, retries: int = 3) -> dict:
    """POST pickle.dumps(payload) to a reward server (post: retries, a deadline); its answer as plain data."""
    answer = post(url, pickle.dumps(payload), {"Content-Type": "application/octet-stream"}, until=until,
                  retries=retries, what=f"the reward server {url}")
    return plain_loads(answer, url)


def numbers(answer, key: str, n: int, url: str, *, low: float, high: float) -> list:
    """answer[key] as n finite numbers in [low, high], else a one-line error naming `url`, the field and the
    value."""
    values = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(values, (list, tuple)) or len(values) != n:
        fail(f"the reward server {url} answered without {n} numbers in {key!r} "
             f"(got {shown(values if values is not None else answer)})")
    for i, v in enumerate(values):
        try:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and low <= float(v) <= high
        except OverflowError:  # an int beyond any float (NaN fails the comparison)
            ok = False
        if not ok:
            what = f"an integer of {v.bit_length()} bits" if isinstance(v, int) and abs(v) > 10**30 else \
                shown(v)
            fail(f"the reward server {url} answered {key}[{i}] = {what}, not a number in [{low}, {high}]")
    return [float(v) for v in values]


def geneval_reward(url: str, *, deadline: float = 600, retries: int = 3):
    """GenEval from the reward server (Flow-GRPO's rewards.py geneval_score): per batch of <= 64 images their
    JPEG bytes and the prompts' metadata with only_strict (True in training: the server skips the original
    GenEval check). In training the reward is the server's partial `score`; called with evaluation=True
    (common.score in evaluations) also the original GenEval `accuracy` and `strict_accuracy` per image, and
    .breakdown gives them per tag. Every value is checked to be in [0, 1]; `deadline` seconds for a batch's
    requests (post)."""
    import time

    def score(images, prompts, evaluation: bool = False):
        metadata = [getattr(p, "metadata", None) for p in prompts]
        if any(m is None or geneval_metadata_problem(m) for m in metadata):
            fail(f"the geneval reward needs prompts with GenEval metadata (a .jsonl file): "
                 f"{str(prompts[0])[:60]!r}")
        jpegs, batches = jpeg_batches(images)
        until = time.monotonic() + deadline
        out = {"geneval": [], "geneval_accuracy": [], "geneval_strict_accuracy": []}
        for batch in batches:
            idx = batch.tolist()
            body = {"images": [jpegs[i] for i in idx], "meta_datas": [metadata[i] for i in idx],
                    "only_strict": not evaluation}
            answer = server_post(url, body, until=until, retries=retries)
            for name, key in (("geneval", "scores"), ("geneval_accuracy", "rewards"),
                              ("geneval_strict_accuracy", "strict_rewards")):
                out[name] += numbers(answer, key, len(idx), url, low=0.0, high=1.0)
        out = {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}
        return out if evaluation else out["geneval"]

    def breakdown(scores: dict, prompts) -> dict:
        """{geneval_<tag>_accuracy, geneval_<tag>_strict_accuracy: the values of that tag's pairs} of
        evaluation scores of all pairs (the server's group_rewards without its -10 placeholders)."""
        if "geneval_accuracy" not in scores:
            return {}
        tags = [p.metadata["tag"] for p in prompts]
        out = {}
        for tag in sorted(set(tags)):
            rows = torch.tensor([t == tag for t in tags])
            for kind in ("accuracy", "strict_accuracy"):
                out[f"geneval_{tag}_{kind}"] = scores[f"geneval_{kind}"][rows]
        return out

    score.evaluation, score.breakdown = True, breakdown
    return score


def deqa_reward(url: str, *, deadline: float = 600, retries: int = 3):
    """DeQA-Score from the reward server (Flow-GRPO's rewards.py deqa_score_remote): per batch of <= 64 images
    their JPEG bytes; the server's `outputs`, DeQA-Score-Mix3's 1-5 score / 5 (reward-server
    reward_server/deqa.py: `score / 5`), so each is checked to be in [0.2, 1] (+- 0.001: its float16).
    Prompts are not used; `deadline` seconds for a batch's requests (post)."""
    import time

    def score(images, prompts):
        jpegs, batches = jpeg_batches(images)
        until = time.monotonic() + deadline
        out = []
        for batch in batches:
            idx = batch.tolist()
            answer = server_post(url, {"images": [jpegs[i] for i in idx]}, until=until, retries=retries)
            out += numbers(answer, "outputs", len(idx), url, low=0.199, high=1.001)
        return torch.tensor(out, dtype=torch.float32)

    return score


VIDEOALIGN_RANGE = 100.0  # |score| beyond this is no VideoAlign answer (its normalised scores: within +-10)
_VIDEOALIGN_LAST = {}  # the last batch's answer: the three dimensions of one batch cost one request


def videoalign_reward(url: str, dimension: str, *, fps: int, deadline: float = 600, retries: int = 3):
    """One dimension (VQ visual quality, MQ motion quality, TA text alignment) of VideoAlign's VideoReward
    model (KwaiVGI/VideoAlign; DanceGRPO's train_grpo_hunyuan.py calls its inferencer.reward(paths, prompts,
    use_norm=True)) from a reward server. Per batch of <= 16 videos [B, 3, F, H, W] one request {"videos":
    each video's frames as JPEG bytes, "fps": fps, "prompts": the prompts}; the answer {"VQ": [B], "MQ": [B],
    "TA": [B]}, each value a finite number within +-VIDEOALIGN_RANGE. The three dimensions of the same videos
    share one request (the answer is kept for the last batch, keyed by a hash of the frames)."""
    import hashlib
    import time

    if dimension not in ("VQ", "MQ", "TA"):
        fail(f"videoalign_{dimension.lower()} is not a VideoAlign dimension; use videoalign_vq, _mq or _ta")

    def score(videos, prompts):
        if videos.ndim != 5:
            fail(f"videoalign_{dimension.lower()} scores videos [B, 3, F, H, W]; got {tuple(videos.shape)}")
        b, c, f, h, w = videos.shape
        frames, _ = jpeg_batches(videos.transpose(1, 2).reshape(b * f, c, h, w))
        digest = hashlib.sha256(b"".join(frames) + repr((list(map(str, prompts)), fps, f)).encode())
        key = (url, digest.hexdigest())
        if _VIDEOALIGN_LAST.get("key") != key:
            until = time.monotonic() + deadline
            answer = {"VQ": [], "MQ": [], "TA": []}
            for batch in torch.arange(b).split(16):
                idx = batch.tolist()
                body = {"videos": [frames[i * f:(i + 1) * f] for i in idx], "fps": fps,
                        "prompts": [str(prompts[i]) for i in idx]}
                reply = server_post(url, body, until=until, retries=retries)
                for k in answer:
                    answer[k] += numbers(reply, k, len(idx), url, low=-VIDEOALIGN_RANGE,
                                         high=VIDEOALIGN_RANGE)
            _VIDEOALIGN_LAST.update(key=key, answer=answer)
        return torch.tensor(_VIDEOALIGN_LAST["answer"][dimension], dtype=torch.float32)

    score.video = True
    return score


# ======== Editing: the result against its source image ========
def source_pixels(prompt, size: tuple | None = None, *, index: int = 0) -> torch.Tensor:
    """An editing prompt's source image `index` (common.Prompt.images: a path or uint8 [3, H, W]; the first by
    default) as float [3, H, W] in [0, 1], resized to `size` (H, W) if given; a prompt without one is a
    one-line error."""
    from PIL import Image
    images = getattr(prompt, "images", ())
    if not images:
        fail(f"this reward compares an edit with its source image; the prompt {str(prompt)[:60]!r} has "
             f"none (an editing prompt set: .jsonl rows with \"image\")")
    image = images[index]
    if isinstance(image, str):
        with Image.open(image) as f:
            image = torch.from_numpy(np.asarray(f.convert("RGB")).copy()).permute(2, 0, 1)
    x = image.float() / 255
    if size is not None and tuple(x.shape[-2:]) != tuple(size):
        x = torch.nn.functional.interpolate(x[None], size=size, mode="bilinear", antialias=True,
                                            align_corners=False)[0].clamp(0, 1)
    return x


def image_similarity_reward(model_path: str, device, *, dtype=torch.float32):
    """Cosine of the CLIP image features of the edit and of its source (Flow-GRPO's image_similarity_score,
    the similarity half of its counting_edit reward: clip_scorer.py ClipScorer.image_similarity with
    openai/clip-vit-large-patch14): each image's shorter side resized to the processor's size (bilinear,
    antialiased, the longer side truncated, as torchvision's Resize), centre-cropped (offsets rounded, as
    CenterCrop) and normalised; the tower in `dtype`, the projection in float32."""
    from transformers import CLIPImageProcessor, CLIPModel
    try:
        model = CLIPModel.from_pretrained(model_path).eval().requires_grad_(False).to(device)
        processor = CLIPImageProcessor.from_pretrained(model_path)
    except Exception as e:
        fail(f"--similarity-clip {model_path!r} cannot be loaded ({type(e).__name__}); pass a transformers "
             f"CLIPModel directory")
    project = float32_head(model, "visual_projection")
    model.vision_model.to(dtype)
    size = processor.size.get("shortest_edge", 224)
    crop = processor.crop_size
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)

    def features(x):
        h, w = x.shape[-2:]
        nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
        x = torch.nn.functional.interpolate(x.float(), size=(nh, nw), mode="bilinear", antialias=True,
                                            align_corners=False)
        top, left = int(round((nh - crop["height"]) / 2)), int(round((nw - crop["width"]) / 2))
        x = x[..., top:top + crop["height"], left:left + crop["width"]]
        x = ((x - mean.to(x)) / std.to(x)).to(device, dtype)
        pooled = model.vision_model(pixel_values=x).pooler_output
        return torch.nn.functional.normalize(project(pooled), dim=-1)

    @torch.no_grad()
    def score(images, prompts):
        keys = [getattr(p, "key", str(p)) for p in prompts]  # a group's prompt: its source once
        unique = {k: p for k, p in zip(keys, prompts)}
        refs = {k: features(source_pixels(p)[None])[0] for k, p in unique.items()}
        return (features(images) * torch.stack([refs[k] for k in keys])).sum(-1).float()

    return score


EDITREWARD_RANGE = 100.0  # |score| beyond this is no edit judge's answer


def editreward_reward(url: str, *, deadline: float = 600, retries: int = 3):
    """An edit-judge VLM (EditReward, TIGER-Lab/EditReward-MiMo-VL-7B-SFT-2508; EditScore; any model that
    scores an edit from its instruction, its source and its result) from a reward server: per batch of <= 16
    edits one request {"images": each result as JPEG bytes, "sources": each edit's source images as a list of
    JPEG bytes (at their own size), "prompts": the instructions}; the answer {"scores": [B]}, each a finite
    number within +-EDITREWARD_RANGE (the judge's own scale: docs/editing.md)."""
    import time
    from PIL import Image

    def jpeg(pixels):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG")
        return buf.getvalue()

    def score(images, prompts):
        results, _ = jpeg_batches(images)
        until, out = time.monotonic() + deadline, []
        for batch in torch.arange(len(results)).split(16):
            idx = batch.tolist()
            sources = [[jpeg(uint8_pixels(source_pixels(prompts[i], index=k)[None])[0])
                        for k in range(len(prompts[i].images))] for i in idx]
            body = {"images": [results[i] for i in idx], "sources": sources,
                    "prompts": [str(prompts[i]) for i in idx]}
            answer = server_post(url, body, until=until, retries=retries)
            out += numbers(answer, "scores", len(idx), url, low=-EDITREWARD_RANGE, high=EDITREWARD_RANGE)
        return torch.tensor(out, dtype=torch.float32)

    return score
