"""results/estimate.py checked on a real GPU: ONE whole training iteration of each single-GPU configuration
of the README (the "1 GPU" rows of estimate.COMMANDS, the FLUX.2 [klein] editing row's prompts a .jsonl of
sources of the target's size: edit_prompts) and of FAMILY_CHECKS (one command per newer family:
Qwen-Image, FLUX.2 [dev], Z-Image-Turbo; with COMMANDS' FLUX.2 [klein] base 4B row, the "families"), run
THROUGH THE ALGORITHM FILES THEMSELVES (runpy.run_path(file, run_name="__main__"), sys.argv = the command +
--num-iterations 1 --eval-every 0 --save-every 0 --output-dir <tmp> --prompts <tmp prompt file>
--eval-prompts <the same>; a --text-cache redirected to a directory under <tmp>), on random-initialised models
of the real sizes built from their configs, no downloads:
- common.load_pipeline returns an in-memory pipeline of the family (FluxPipeline, StableDiffusion3Pipeline,
  QwenImagePipeline, Flux2Pipeline, Flux2KleinPipeline(is_distilled=False), ZImagePipeline) around
  estimate.architectures' modules (built directly on the GPU in bf16, the text encoders then waiting on the
  CPU as load_pipeline leaves them), the released scheduler configs, toy/tiny.py's word tokenizers (FLUX.1,
  SD3) or toy/tiny_families.py's Qwen2Tokenizer / PixtralProcessor; with --text-cache it moves the
  transformer to the CPU as start_run asks (where the host has room: else it stays, and the encode phase
  counts its weights; transformer_off_the_gpu_while_filling says which) while fill_text_cache encodes, and
  the text encoders that fill_text_cache drops are put back (on the CPU) after the configuration;
- common.load_rewards returns rewards.py's own reward functions (open_clip_reward, pickscore_reward,
  imagereward_reward, aesthetic_reward) fed random models of estimate.reward_spec's sizes (open_clip ViT-H-14
  for hps / clip, PickScore's CLIP-H, ImageReward's BLIP): bf16 towers, float32 heads, as in training;
- rundir.save_state is counted, not run (writing a 1-3 GB checkpoint is not what this checks).
Per phase it records the peak of torch.cuda.max_memory_allocated (wrapped: common.encode_prompts -> encode,
common.velocity without grad -> rollout and with grad (or the reference's, inside training) -> training step,
common.decode -> decode, the reward functions -> rewards, common.optimizer_step -> optimizer step; the peak
counter is reset at each phase change and a phase's peak is the max over its calls; what runs between two
wrapped calls (the SDE math, CoCA's credit, the backward pass) counts to the phase before it), the
iteration's perf/seconds_per_iteration and perf/rollout_seconds from metrics.jsonl, the NFE against the
file's planned_nfe and train/first_ratio_max_dev, and prints per configuration a table: phase, measured GiB,
estimate.py's GiB of the same phase (read from results/estimate.md; --tiny: estimate.estimate(tiny=True),
through the same reader; a row estimate.md lacks prints "-"). The pipelines are built once per --model, in
the order of first appearance (SD3.5-M for five configurations, FLUX.1-dev for four, then FLUX.2 [klein]
base 4B, Qwen-Image, FLUX.2 [dev], Z-Image-Turbo for one each); the LoRA adapters are removed between runs
(diffusers' unload_lora) and the base weights checked untouched (every parameter's float64 sum, and the
names); the rest is freed in between.

    python results/gpu_check.py --out $OUT/gpu_check.json   # one H100 / H200: ~8 min, families skipped
    python results/gpu_check.py --only families             # the newer families' four rows: ~4-5 min
    python results/gpu_check.py --only dancegrpo mixgrpo    # some configurations (keys below, or names)
    python results/gpu_check.py --tiny                      # the same code on tiny architectures, on a CPU

With the device tool (one command; the JSON comes back under files_at):
    run(command="python results/gpu_check.py --out $OUT/gpu_check.json", timeout_s=540)
    run(command="python results/gpu_check.py --only families --out $OUT/families.json", timeout_s=420)
Keys: flow_grpo, flow_grpo-coca, densegrpo, dancegrpo, mixgrpo, g2rpo, diffusion_nft, diffusion_nft-flux,
awm; the families: flow_grpo-flux2-klein-base-4b, flow_grpo-qwen-image, diffusion_nft-flux2-dev,
awm-z-image-turbo (script-model for any further --model).

Time on one H100, from results/estimate.md's seconds per iteration at 40% MFU plus what this script adds:
  compute: Flow-GRPO 22 + Flow-GRPO + CoCA 22 + DenseGRPO 23 + AWM 5 + DiffusionNFT 13 (SD3.5-M) +
           DanceGRPO 44 + MixGRPO 38 + G2RPO 166 + DiffusionNFT 51 (FLUX.1-dev) = 384 s;
  builds: SD3.5-M ~8 s, FLUX.1-dev ~12 s (2.5 B / 11.9 B + T5-XXL's 4.8 B parameters initialised on the GPU,
           then T5 and CLIP, 9-10 GiB, to the CPU) = 20 s;
  per configuration ~10 s: its reward models (ViT-H-14s initialised on the GPU, sent to the CPU by open_clip
           and back, 3.7 GiB each way, ~2 s each), the text encoders' visit to the GPU (9-10 GiB each way,
           ~3 s, inside the iteration's seconds but not in the estimate's), LoRA set-up and removal, the
           file's imports and TensorBoard writer: 9 x 10 = 90 s;
  Python imports and CUDA start-up ~25 s;
  total 384 + 20 + 90 + 25 = ~520 s, more than the 480 s one call allows (an H200 computes as fast as an
  H100).
  Before each configuration its estimate x 1.15 + 10 s is checked against --budget (460 s): one that would end
  later is skipped and reported as such (a model none of whose rows fits is not even built); run the rest in
  a second call with --only. The families come after FLUX.1-dev and are skipped so: run them with --only
  families. results/estimate.md has no rows for FAMILY_CHECKS; ROUGH_SECONDS holds rough H100 seconds,
  estimate.md's 1-GPU rows scaled by transformer parameters x tokens x samples x NFE (Flow-GRPO Qwen-Image
  from SD3.5-M's 22 s: 8.2x the parameters, 1/6 the samples: ~30 s; DiffusionNFT FLUX.2 [dev] from
  FLUX.1-dev's 51 s: 2.7x, 1/3 the NFE, 0.75x the tokens: ~35 s; Flow-GRPO [klein] base 4B ~6 s; AWM
  Z-Image-Turbo, 8 steps, no CFG, ~2 s): ~75 s; builds ~60 s (20.4 B + 8.3 B, 32.2 B + 23.3 B (FLUX.2 [dev]
  needs ~104 GiB on the GPU while it is built: an H200, not an 80 GB card), 3.9 B + 4.0 B, 6.2 B + 4.0 B
  parameters, the text encoders then to the CPU); per configuration ~10 s plus the text encoders' visits
  (Mistral-Small's 43 GiB and FLUX.2 [dev]'s 60 GiB transformer to the CPU and back around the text cache:
  ~40 s): ~90 s; imports ~25 s: ~250-300 s.
"""
import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import runpy
import sys
import tempfile
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy"), os.path.join(ROOT, "results")]
GIB = 2**30
PHASES = ("encode", "rollout", "decode", "rewards", "training step", "optimizer step")
PROMPTS = ["a red circle on the left", "a blue square on the top", "a photo of a cat and a dog",
           "a green triangle at the bottom right", "a yellow picture of a dog"]


# one single-GPU command per newer family (models.py), in estimate.COMMANDS' format; with estimate.COMMANDS'
# "1 GPU (24 GB): Flow-GRPO, FLUX.2 [klein] base 4B" row they are the "families" (--only families). Each
# --text-cache of a command is redirected to a directory of this check's own.
FAMILY_CHECKS = [
    ("1 GPU: Flow-GRPO, Qwen-Image (LoRA)", "flow_grpo", "--model qwen-image --guidance 4 --lora-rank 64 "
     "--lora-alpha 128 --max-sequence-length 256 --prompts-per-iteration 1 --group-size 8 --micro-batch 4 "
     "--eval-num 64", 1),
    ("1 GPU: DiffusionNFT, FLUX.2 [dev] (LoRA, text cache)", "diffusion_nft", "--model flux2-dev "
     "--guidance 4 --lora-rank 64 --lora-alpha 128 --prompts-per-iteration 1 --group-size 8 --micro-batch 2 "
     "--eval-num 64 --text-cache /cache/flux2-dev", 1),
    ("1 GPU: AWM, Z-Image-Turbo (LoRA)", "awm", "--model z-image-turbo --guidance 0 --num-steps 8 "
     "--lora-rank 64 --lora-alpha 128 --prompts-per-iteration 1 --group-size 8 --micro-batch 4 "
     "--eval-num 64", 1),
]
# rough seconds per iteration on an H100 at 40% MFU of the rows results/estimate.md has none for (its 1-GPU
# rows of similar size scaled by parameters x tokens x samples x NFE; see the docstring): for --budget only
ROUGH_SECONDS = {"flow_grpo-qwen-image": 30, "diffusion_nft-flux2-dev": 35, "awm-z-image-turbo": 2,
                 "flow_grpo-flux2-klein-base-4b": 6}


def model_alias(argv: str) -> str:
    """The --model of an argument string ("" when it loads the default SD3.5-M)."""
    words = argv.split()
    return words[words.index("--model") + 1] if "--model" in words else ""


def key(name: str, script: str, argv: str) -> str:
    model = model_alias(argv)
    return script + ("-coca" if "--credit coca" in argv else "") + {"": "", "flux-dev": "-flux"}.get(model,
                                                                                                 "-" + model) \
        + ("-edit" if "--condition-size" in argv.split() else "")


def model_of(command) -> str:
    """The --model alias the command's Args load (sd3.5-medium by default): one pipeline build each."""
    import tyro

    return tyro.cli(importlib.import_module(command[1]).Args, args=command[2].split()).model


def configurations(only=None) -> list:
    """estimate.COMMANDS' single-GPU rows ("1 GPU: ...", "1 GPU (24 GB): ..."), then FAMILY_CHECKS."""
    import estimate

    rows = [c for c in estimate.COMMANDS if c[0].startswith("1 GPU") and c[3] == 1] + FAMILY_CHECKS
    older = (None, "sd3", "flux")
    families = {c[0] for c in rows if estimate.ARCHITECTURE.get(model_alias(c[2])) not in older}
    if only:
        rows = [c for c in rows if key(*c[:3]) in only or any(o.lower() in c[0].lower() for o in only)
                or ("families" in only and c[0] in families)]
    return rows


class Phases:
    """Per-phase peak memory: each wrapped call names its phase; at a phase change the peak since the last
    reset is the old phase's (the max over its calls) and the counter is reset."""

    def __init__(self, device):
        self.cuda, self.current, self.peak, self.calls = device.type == "cuda", None, {}, {}

    def enter(self, name: str):
        if name != self.current:
            self.close()
            self.current = name
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        self.calls[name] = self.calls.get(name, 0) + 1

    def close(self):
        if self.current is not None:
            value = torch.cuda.max_memory_allocated() / GIB if self.cuda else 0.0
            self.peak[self.current] = max(self.peak.get(self.current, 0.0), value)
        self.current = None


def wrapped(fn, phases: Phases, phase):
    """fn, announcing its phase (a name, or a function of the current phase) before each call."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        phases.enter(phase() if callable(phase) else phase)
        return fn(*args, **kwargs)
    return inner


def velocity_phase(phases: Phases):
    def phase():  # the reference's no-grad forward runs inside the training loop
        if torch.is_grad_enabled() or phases.current in ("training step", "optimizer step"):
            return "training step"
        return "rollout"
    return phase


# ---------------------------------------------------------------- random models of the real sizes
def scheduler_config(model: str) -> dict:
    """FlowMatchEulerDiscreteScheduler's config of the released model (its scheduler/scheduler_config.json):
    FLUX.1-dev and SD3.5-M as estimate.scheduler_config; Qwen/Qwen-Image's dynamic shifting with exponential
    time shift, base 0.5 -> max 0.9 over 256 -> 8192 tokens, shift_terminal 0.02 (as toy/tiny_families.py's
    build_qwenimage quotes it); black-forest-labs/FLUX.2-dev's and FLUX.2-klein's exponential dynamic shifting
    (the pipelines pass compute_empirical_mu; docs/models.md); Tongyi-MAI/Z-Image's static shift 6,
    Z-Image-Turbo's 3 (tiny_families.build_zimage)."""
    import estimate

    arch = estimate.ARCHITECTURE[model]
    if arch in ("flux", "sd3"):
        return estimate.scheduler_config(arch)
    if arch == "qwen-image":
        return dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                    shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
    if arch == "z-image":
        return dict(shift=3.0 if model == "z-image-turbo" else 6.0, use_dynamic_shifting=False)
    return dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, shift=3.0,
                time_shift_type="exponential", use_dynamic_shifting=True)


def wan_scheduler(model: str):
    """The UniPC scheduler Wan-AI's Diffusers checkpoints ship (scheduler/scheduler_config.json): flow sigmas,
    flow_shift 3.0 for Wan2.1 at 480p, 5.0 for Wan2.2-TI2V-5B (as toy/tiny_video.unipc)."""
    from tiny_video import unipc
    return unipc(5.0 if model == "wan2.2-ti2v-5b" else 3.0)


def tiny_text_encoders(arch: str) -> list:
    """Constructors of toy/tiny_families.py's text encoders with all their layers (estimate's tiny ones
    keep 2: FLUX.2's pipelines read hidden layers 9-30 by index)."""
    import tiny_families as tf

    pipe = {"qwen-image": tf.build_qwenimage, "flux2-dev": tf.build_flux2, "klein-4b": tf.build_flux2_klein,
            "klein-9b": tf.build_flux2_klein, "z-image": tf.build_zimage}[arch]()
    return [functools.partial(type(pipe.text_encoder), pipe.text_encoder.config)]


def build_pipeline(model: str, *, tiny: bool, device, dtype):
    """The pipeline of the --model alias's family (FluxPipeline, StableDiffusion3Pipeline, QwenImagePipeline,
    Flux2Pipeline, Flux2KleinPipeline, ZImagePipeline) around estimate.architectures' modules, every module
    initialised on `device` in `dtype`, the released scheduler config, left as common.load_pipeline leaves it
    (frozen, eval, the text encoders on the CPU). Tokenizers: toy/tiny.py's word tokenizers (FLUX.1, SD3),
    toy/tiny_families.py's Qwen2Tokenizer (Qwen-Image, FLUX.2 [klein], Z-Image) and PixtralProcessor (FLUX.2
    [dev]): their ids are in every real vocabulary."""
    import estimate
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline, FluxPipeline
    from diffusers import QwenImagePipeline, StableDiffusion3Pipeline, ZImagePipeline
    from tiny import word_tokenizer

    _, arch = estimate.model_architecture(model)
    make_t, texts, make_vae = estimate.architectures(arch, tiny=tiny)
    if tiny and arch not in ("flux", "sd3") and not arch.startswith("wan"):
        texts = tiny_text_encoders(arch)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            transformer, vae, encoders = make_t(), make_vae(), [make() for make in texts]
    finally:
        torch.set_default_dtype(torch.float32)

    def tokenizer(m):  # CLIP: its position embeddings; T5: the longest --max-sequence-length
        return word_tokenizer(m.config.max_position_embeddings if "CLIP" in type(m).__name__ else 512)

    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config(model)) if not arch.startswith("wan")
                 else wan_scheduler(model), vae=vae, transformer=transformer, text_encoder=encoders[0])
    if arch.startswith("wan"):  # UMT5 behind a word-level tokenizer of 512 tokens
        from diffusers import WanPipeline
        pipe = WanPipeline(**parts, tokenizer=tokenizer(encoders[0]), expand_timesteps=arch == "wan-5b")
    elif arch in ("flux", "sd3"):
        parts.update(tokenizer=tokenizer(encoders[0]), text_encoder_2=encoders[1],
                     tokenizer_2=tokenizer(encoders[1]))
    if arch.startswith("wan"):
        pass
    elif arch == "flux":
        pipe = FluxPipeline(**parts)
    elif arch == "sd3":
        parts.update(text_encoder_3=encoders[2], tokenizer_3=tokenizer(encoders[2]))
        pipe = StableDiffusion3Pipeline(**parts)
    else:
        from tiny_families import mistral_processor, qwen_tokenizer

        parts["tokenizer"] = mistral_processor() if arch == "flux2-dev" else qwen_tokenizer()
        if arch.startswith("klein"):
            pipe = Flux2KleinPipeline(**parts, is_distilled=model in estimate.DISTILLED)
        else:
            classes = {"qwen-image": QwenImagePipeline, "flux2-dev": Flux2Pipeline, "z-image": ZImagePipeline}
            pipe = classes[arch](**parts)
    pipe.set_progress_bar_config(disable=True)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.requires_grad_(False).eval().to("cpu" if name.startswith("text") else device)
    return pipe


def random_like(shape, name: str, device):
    """A random initialisation by name: norms' weights 1 and biases 0, everything else N(0, 0.02^2)."""
    if "norm" in name.lower():
        return (torch.ones if name.endswith("weight") else torch.zeros)(shape, device=device)
    return torch.randn(shape, device=device) * 0.02


# transformers' BlipVisionModel names -> ImageReward.pt's (timm-style, under blip.visual_encoder.): the
# inverse of rewards._IR_VISION
_TO_IMAGEREWARD = [(r"embeddings\.class_embedding", "cls_token"),
                   (r"embeddings\.position_embedding", "pos_embed"),
                   (r"embeddings\.patch_embedding\.(\w+)", r"patch_embed.proj.\1"),
                   (r"encoder\.layers\.(\d+)\.layer_norm([12])\.(\w+)", r"blocks.\1.norm\2.\3"),
                   (r"encoder\.layers\.(\d+)\.self_attn\.qkv\.(\w+)", r"blocks.\1.attn.qkv.\2"),
                   (r"encoder\.layers\.(\d+)\.self_attn\.projection\.(\w+)", r"blocks.\1.attn.proj.\2"),
                   (r"encoder\.layers\.(\d+)\.mlp\.(fc[12])\.(\w+)", r"blocks.\1.mlp.\2.\3"),
                   (r"post_layernorm\.(\w+)", r"norm.\1")]
HEAD_LAYERS = (0, 2, 4, 6, 7)  # the Linear layers of the original heads' nn.Sequential (between dropouts)


def imagereward_state(spec: dict, device) -> dict:
    """A random ImageReward.pt state_dict with the original key names, of the sizes in `spec`."""
    import re

    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    med = {k: v for k, v in spec["med"].items() if k not in ("encoder_width", "bos_token_id", "sep_token_id")}
    with torch.device("meta"):
        vision = BlipVisionModel(BlipVisionConfig(**spec["vision"]))
        config = BlipTextConfig(**med, encoder_hidden_size=spec["med"]["encoder_width"], is_decoder=True)
        text = BlipTextModel(config, add_pooling_layer=False)
    state = {}
    for name, t in vision.state_dict().items():
        timm = next(re.sub(f"^{a}$", b, name) for a, b in _TO_IMAGEREWARD if re.fullmatch(a, name))
        state["blip.visual_encoder." + timm] = random_like(t.shape, timm, device)
    for name, t in text.state_dict().items():
        state["blip.text_encoder." + name] = random_like(t.shape, name, device)
    dims = (med["hidden_size"], *spec["head"])
    for i, n_in, n_out in zip(HEAD_LAYERS, dims, dims[1:]):
        state[f"mlp.layers.{i}.weight"] = random_like((n_out, n_in), "weight", device)
        state[f"mlp.layers.{i}.bias"] = random_like((n_out,), "bias", device)
    return state


def clip_model(spec: dict, device):
    from transformers import CLIPConfig, CLIPModel

    with torch.device(device):
        return CLIPModel(CLIPConfig(text_config=spec["text"], vision_config=spec["vision"],
                                    projection_dim=spec["projection_dim"]))


def load_random_rewards(names, device, *, models, dtype, tiny: bool, tmp: str, phases: Phases, fps: int = 16):
    """common.load_rewards for this check: rewards.py's loaders fed random models (see the docstring), image
    rewards scoring a video's frames as --frame-reduce says (common.per_frame)."""
    import common
    import estimate
    import rewards
    from transformers import AutoProcessor, CLIPImageProcessor, CLIPModel

    from tiny import WORDS, word_tokenizer

    states = {}

    def load_safely(path, *, what):  # the checkpoints this check made in memory
        return states[path] if path in states else ORIGINAL["load_rewards_load_safely"](path, what=what)

    out = {}
    for name in dict.fromkeys(names):
        spec = estimate.reward_spec(name, tiny=tiny)
        if spec is None:  # jpeg, the toy worlds'
            out[name] = ORIGINAL["load_rewards"]([name], device, models=models, dtype=dtype, fps=fps)[name]
            continue
        where = os.path.join(tmp, name)
        os.makedirs(where, exist_ok=True)
        size = spec["size"]
        square = {"height": size, "width": size}
        processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size=square,
                                       image_mean=list(estimate.OPENAI_MEAN),
                                       image_std=list(estimate.OPENAI_STD))

        def random_clip(*args, **kwargs):
            return clip_model(spec, device)

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.device(device))  # random weights initialised where they will run
            stack.enter_context(estimate.patched(rewards, "load_safely", load_safely))
            if spec["family"] == "open_clip":
                with open(os.path.join(where, "open_clip_config.json"), "w") as f:
                    json.dump({"model_cfg": spec["config"], "preprocess_cfg": {}}, f)
                fn = rewards.open_clip_reward(where, device, pad_square=spec["pad_square"], dtype=dtype)
            elif spec["family"] == "clip":  # PickScore
                tok = word_tokenizer(77)
                tok.model_input_names = ["input_ids", "attention_mask"]
                both = types.SimpleNamespace(image_processor=processor, tokenizer=tok)
                stack.enter_context(estimate.patched(CLIPModel, "from_pretrained", random_clip))
                stack.enter_context(estimate.patched(AutoProcessor, "from_pretrained", lambda *a, **k: both))
                fn = rewards.pickscore_reward("random:pickscore", "random:processor", device, dtype=dtype)
            elif spec["family"] == "clip_vision":  # the aesthetic predictor
                head = os.path.join(where, "head.pth")
                open(head, "w").close()
                dims = (spec["projection_dim"], *spec["head"])
                states[head] = {f"layers.{i}.{p}": random_like((b, a) if p == "weight" else (b,), p, device)
                                for i, a, b in zip(HEAD_LAYERS, dims, dims[1:]) for p in ("weight", "bias")}
                stack.enter_context(estimate.patched(CLIPModel, "from_pretrained", random_clip))
                stack.enter_context(estimate.patched(CLIPImageProcessor, "from_pretrained",
                                                     lambda *a, **k: processor))
                fn = rewards.aesthetic_reward(head, "random:clip-vit-large-patch14", device, dtype=dtype)
            else:  # ImageReward: its checkpoint's original key names, med_config.json, a BERT vocab.txt
                checkpoint = os.path.join(where, "ImageReward.pt")
                med = os.path.join(where, "med_config.json")
                open(checkpoint, "w").close()
                states[checkpoint] = imagereward_state(spec, device)
                with open(med, "w") as f:
                    json.dump(spec["med"], f)
                with open(os.path.join(where, "vocab.txt"), "w") as f:
                    f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
                fn = rewards.imagereward_reward(checkpoint, med, where, device, dtype=dtype)
                states.clear()
        out[name] = wrapped(common.per_frame(fn, models.frame_reduce), phases, "rewards")
    return out


ORIGINAL = {}  # common's functions before this check wraps them


# ---------------------------------------------------------------- one configuration
def fingerprint(module):
    """(parameter names, every parameter's float64 sum): what the LoRA runs must leave unchanged."""
    names = tuple(n for n, _ in module.named_parameters())
    return names, torch.stack([p.detach().sum(dtype=torch.float64) for p in module.parameters()]).cpu()


def host_has_room(module, margin=16 * GIB) -> bool:
    """Whether the host's available memory (/proc/meminfo) takes `module` with `margin` to spare."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    return available > sum(p.numel() * p.element_size() for p in module.parameters()) + margin


def edit_prompts(directory: str, height: int, width: int) -> str:
    """An editing prompt set (common.read_prompts' .jsonl: "prompt" and "image", a path beside the file): each
    of PROMPTS with a random RGB source of the target's size (PNG), as a counting_edit row."""
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    rows = []
    for i, prompt in enumerate(PROMPTS):
        seed = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=seed)
        Image.fromarray(pixels.numpy()).save(os.path.join(directory, f"source-{i}.png"))
        rows.append(json.dumps({"prompt": prompt, "image": f"source-{i}.png"}))
    path = os.path.join(directory, "prompts.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")
    return path


def run_configuration(command, *, pipe, kind, tiny, device, tmp, prompts):
    """One iteration of the command through its algorithm file; what it measured. The pipeline is left as
    it came: a --text-cache run's text encoders (fill_text_cache drops them) put back on the CPU, its
    `text_cache` reader removed, the transformer and the VAE on `device`."""
    import estimate
    import tyro

    import common
    import rundir

    name, script, argv, world = command
    out_dir = tempfile.mkdtemp(prefix=key(name, script, argv) + "-", dir=tmp)
    words = argv.split()
    if "--condition-size" in words and tiny:  # the tiny target's size
        words[words.index("--condition-size") + 1] = "32"
    edits = estimate.editing(kind, tyro.cli(importlib.import_module(script).Args, args=words))
    if edits:  # an editing prompt set: one source of the target's size per prompt
        a = tyro.cli(importlib.import_module(script).Args, args=words)
        size = 32 if tiny else a.resolution
        prompts = edit_prompts(os.path.join(out_dir, "edit"), size, size if tiny else a.width or size)
    extra = ["--num-iterations", "1", "--eval-every", "0", "--save-every", "0", "--output-dir", out_dir,
             "--prompts", prompts, "--eval-prompts", prompts]
    if tiny:
        extra += ["--resolution", "32", "--width", "32", "--max-sequence-length", "16"]
    if "--text-cache" in words:  # a directory of this check's, filled by this run
        words[words.index("--text-cache") + 1] = os.path.join(out_dir, "text-cache")
    mod = importlib.import_module(script)
    args = tyro.cli(mod.Args, args=words + extra)
    planned = mod.planned_nfe(args)
    phases, saved = Phases(device), []

    texts = {n: getattr(pipe, n) for n in common.TEXT_ENCODERS if getattr(pipe, n, None) is not None}
    moved = []

    def load_pipeline(model, dev, *, dtype=torch.float32):
        # --text-cache: start_run loads onto the CPU, fills the cache with the text encoders alone on the
        # device, then places the pipeline there; the transformer leaves the GPU too where the host has room
        if torch.device(dev).type == "cpu" != device.type and host_has_room(pipe.transformer):
            common.place(pipe, dev)
            moved.append(True)
        return pipe, kind

    def save_state(path, **kwargs):  # rundir.Run.save calls it
        saved.append(path)

    step, with_gradient = common.optimizer_step, []

    def optimizer_step(params, optimizer, **kwargs):  # the trainable tensors that got a gradient
        phases.enter("optimizer step")
        with_gradient.append(sum(p.grad is not None for p in params.values()))
        return step(params, optimizer, **kwargs)

    load_rewards = functools.partial(load_random_rewards, tiny=tiny, tmp=os.path.join(out_dir, "rewards"),
                                     phases=phases)
    result = {"name": name, "key": key(name, script, argv), "script": script, "argv": argv, "ok": False}
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        stack.enter_context(estimate.patched(rundir, "save_state", save_state))
        patches = {"load_pipeline": load_pipeline, "load_rewards": load_rewards,
                   "optimizer_step": optimizer_step}
        for fn, phase in (("encode_prompts", "encode"), ("velocity", velocity_phase(phases)),
                          ("decode", "decode")):
            patches[fn] = wrapped(getattr(common, fn), phases, phase)
        for fn, patch in patches.items():  # common's, and the names rundir imported from it
            for module in (common, rundir):
                if hasattr(module, fn):
                    stack.enter_context(estimate.patched(module, fn, patch))
        argv_file = [os.path.join(ROOT, script + ".py"), *words, *extra]
        stack.enter_context(estimate.patched(sys, "argv", argv_file))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # its summary: stdout is the report's
        try:
            runpy.run_path(os.path.join(ROOT, script + ".py"), run_name="__main__")
            result["ok"] = True
        except (Exception, SystemExit) as e:  # a failed configuration must not stop the others
            result["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            phases.close()
            pipe.register_modules(**{n: m for n, m in texts.items() if getattr(pipe, n, None) is not m})
            pipe.__dict__.pop("text_cache", None)  # fill_text_cache's reader, which encode_prompts prefers
            common.place(pipe, device)  # the text encoders back on the CPU, the transformer on the device
    result["wall_seconds"] = round(time.time() - t0, 1)
    if args.text_cache:
        result["transformer_off_the_gpu_while_filling"] = bool(moved)
    rows = []
    for run in os.listdir(out_dir):
        path = os.path.join(out_dir, run, "metrics.jsonl")
        if os.path.isfile(path):
            rows = rundir.read_jsonl(path)
    iteration = {k: v for r in rows if r.get("iteration") == 1 for k, v in r.items()}
    result.update(iterations=len({r["iteration"] for r in rows}), checkpoints_saved=len(saved),
                  seconds_per_iteration=iteration.get("perf/seconds_per_iteration"),
                  rollout_seconds=iteration.get("perf/rollout_seconds"),
                  first_ratio_max_dev=iteration.get("train/first_ratio_max_dev"),
                  nfe={"rollout_per_prompt": iteration.get("perf/nfe_rollout_per_prompt"),
                       "planned_rollout_per_prompt": planned["rollout"],
                       "per_iteration": iteration.get("perf/nfe_per_iteration"),
                       "planned_per_iteration": args.prompts_per_iteration * sum(planned.values())},
                  measured_gib={k: round(v, 2) for k, v in phases.peak.items()}, calls=dict(phases.calls))
    result["lora gradients"] = max(with_gradient, default=0)  # (the name of the old check's field)
    return result


def estimated(commands, *, tiny: bool, paths: list) -> dict:
    """{command: {phase: GiB, "seconds, H100": s}} from estimate.md files; --tiny: the commands none of them has
    are estimated now (tiny architectures)."""
    import estimate

    have = set().union(*(estimate.read_table(p) for p in paths if os.path.isfile(p)))
    missing = [c for c in commands if c[0] not in have]
    if tiny and missing:
        paths = [*paths, os.path.join(tempfile.mkdtemp(), "estimate.md")]
        with contextlib.redirect_stdout(sys.stderr):
            estimate.report([estimate.estimate(*c, tiny=True) for c in missing], paths[-1],
                            made="A tiny estimate of the commands the estimate files lack (gpu_check.py --tiny).")
    out = {}
    for path in [p for p in paths if os.path.isfile(p)]:
        for name, row in estimate.read_table(path).items():
            cells = {p: float(row[p]) for p in estimate.PHASES if p in row}
            column = next((c for c in row if c.startswith("seconds / iteration")), None)
            if column:
                cells["seconds, H100"] = float(row[column].split("/")[-1].replace(",", ""))
            out[name] = cells
    return out


def markdown(results: list) -> str:
    lines = []
    for r in results:
        head = f"### {r['name']}: " + ("ok" if r.get("ok") else r.get("skipped") or r.get("error", "failed"))
        if "seconds_per_iteration" in r:
            est = r.get("estimate", {}).get("seconds, H100")
            it, roll = r["seconds_per_iteration"] or 0, r["rollout_seconds"] or 0
            head += (f"; {it:.1f} s / iteration (rollout {roll:.1f} s; "
                     f"estimate {est if est is not None else '-'} s on an H100 at 40% MFU), "
                     f"first_ratio_max_dev {r['first_ratio_max_dev']}, NFE {r['nfe']['per_iteration']} "
                     f"(planned {r['nfe']['planned_per_iteration']})")
        lines += [head, ""]
        if "measured_gib" in r:
            lines += ["| phase | measured peak GiB | estimate.py GiB | calls |", "|---|---|---|---|"]
            for p in PHASES:
                m, e = r["measured_gib"].get(p), r.get("estimate", {}).get(p)
                m, e = ("-" if v is None else f"{v:.1f}" for v in (m, e))
                lines.append(f"| {p} | {m} | {e} | {r['calls'].get(p, 0)} |")
            lines.append("")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny architectures on the CPU (the tests run this)")
    p.add_argument("--only", nargs="*", default=None, help="configuration keys or parts of their names")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--estimate", default=None, help="the estimate.md to compare with (default: results/estimate.md;"
                   " --tiny: a tiny estimate made now of the commands it lacks)")
    p.add_argument("--budget", type=float, default=460.0, help="skip a configuration estimated to end later")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="the models' dtype (default: bf16 on the GPU, fp32 with --tiny; --tiny --dtype bf16 "
                        "rehearses the GPU's dtypes on a CPU)")
    a = p.parse_args()
    import common
    import estimate
    import rewards

    ORIGINAL.update(load_rewards=common.load_rewards, load_rewards_load_safely=rewards.load_safely)
    t_start = time.time()
    device = torch.device("cpu" if a.tiny else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32,
             None: torch.float32 if a.tiny else torch.bfloat16}[a.dtype]
    commands = configurations(a.only)
    results_md = [os.path.join(ROOT, "results", "estimate.md")]
    figures = estimated(commands, tiny=a.tiny, paths=[a.estimate] if a.estimate else [] if a.tiny else results_md)
    tmp = tempfile.mkdtemp(prefix="gpu_check-")
    prompts = os.path.join(tmp, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    results, builds = [], {}
    models = {c[0]: model_of(c) for c in commands}

    def guess(command):  # its seconds on an H100 (estimate.md's, else ROUGH_SECONDS) x 1.15 + 10 s
        rough = ROUGH_SECONDS.get(key(*command[:3]), 0)
        return figures.get(command[0], {}).get("seconds, H100", rough) * 1.15 + 10

    def skip(command):
        why = f"budget: {time.time() - t_start:.0f} s + ~{guess(command):.0f} s > {a.budget:.0f} s"
        results.append({"name": command[0], "key": key(*command[:3]), "ok": False, "skipped": why})

    for model in dict.fromkeys(models.values()):  # one build per model, in the order of first appearance
        mine = [c for c in commands if models[c[0]] == model]
        kind = estimate.model_architecture(model)[0]
        if not a.tiny and time.time() - t_start + min(map(guess, mine)) > a.budget:  # not even built
            for command in mine:
                skip(command)
            continue
        t0 = time.time()
        pipe = build_pipeline(model, tiny=a.tiny, device=device, dtype=dtype)
        builds[model] = round(time.time() - t0, 1)
        base = fingerprint(pipe.transformer)
        for command in mine:
            if not a.tiny and time.time() - t_start + guess(command) > a.budget:
                skip(command)
                continue
            r = run_configuration(command, pipe=pipe, kind=kind, tiny=a.tiny, device=device, tmp=tmp,
                                  prompts=prompts)
            if getattr(pipe.transformer, "peft_config", None):
                pipe.transformer.unload_lora()
            r["estimate"] = figures.get(command[0], {})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                r["memory_after_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
            names, sums = fingerprint(pipe.transformer)
            r["base_weights_unchanged"] = names == base[0] and torch.equal(sums, base[1])
            results.append(r)
            state = "ok" if r["ok"] else r.get("error")
            print(f"{r['name']}: {state} ({r['wall_seconds']} s)", file=sys.stderr, flush=True)
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tiny": a.tiny,
              "build_seconds": builds, "total_seconds": round(time.time() - t_start, 1),
              "configurations": results}
    text = json.dumps(report, indent=1)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    print(markdown(results))


if __name__ == "__main__":
    main()
