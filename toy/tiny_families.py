"""Tiny random-weight diffusers pipelines of four newer families, built offline from configs (no downloads).

    build_qwenimage()            QwenImagePipeline     Qwen2.5-VL text encoder, AutoencoderKLQwenImage, true CFG
    build_flux2()                Flux2Pipeline         FLUX.2 [dev]: Mistral3 (+ Pixtral tower), guidance embedding
    build_flux2_klein()          Flux2KleinPipeline    Qwen3 causal LM, true CFG against "" (distilled=True: none)
    build_zimage()               ZImagePipeline        Qwen3 encoder, hidden_states[-2]; turbo=True: shift 3, no CFG
    build_qwenimage_edit_plus()  QwenImageEditPlusPipeline  Qwen-Image-Edit-2509 (zero_cond_t=True: 2511's transformer):
                                 Qwen2.5-VL with its vision tower and a Qwen2VLProcessor, a 4x VAE, true CFG
    build_qwenimage_edit()       QwenImageEditPipeline  Qwen-Image-Edit (2508): one source image, built as above

Every VAE compresses 2x, so a 32x32 image has 16x16 latents and, after the families' 2x2 patching, 64 image tokens
(the real VAEs compress 8x); any height and width divisible by 4 works, the smallest being 4x4 (one token).
Tokenizers are built here: Qwen's families get a genuine `Qwen2Tokenizer` (byte-level BPE, Qwen's pre-tokenizer)
whose merges make every word of tiny.py's WORDS, and every piece of the chat templates and of Qwen-Image's system
prompt, a single token (so Qwen-Image's 34 dropped template tokens end exactly where the prompt starts, as with the
real vocabulary); FLUX.2 gets a word-level tokenizer inside a `PixtralProcessor` with a Mistral-style chat template.
`CALL_DEFAULTS` holds the released models' recommended call arguments, `LORA_TARGETS` adapter target names and
`transformer_blocks` the block lists (FSDP2 units); `sample` is a sampling loop written against the components
(prompt encoding, noise, sigmas, transformer calls, CFG, Euler steps, decoding) that the checks compare with the
pipelines.

    python toy/tiny_families.py     # per family: save/load round trip, the pipeline's latents against the loop below
"""
import math
import os
import sys
import tempfile

import numpy as np
import torch
from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage, DiffusionPipeline
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline, QwenImageTransformer2DModel
from diffusers import ZImagePipeline, ZImageTransformer2DModel
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil, PixtralProcessor
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor, Qwen3Config, Qwen3ForCausalLM
from transformers import Qwen3Model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import WORDS  # noqa: E402

# ======== tokenizers ========
QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen3's chat template for plain user/assistant/system turns; enable_thinking=False adds the empty think block
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
QWENIMAGE_SYSTEM = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
                    "relationships of the objects and background:")  # pipeline_qwenimage.py:175
QWENIMAGE_DROP = 34  # template tokens before the prompt, dropped from the hidden states (pipeline_qwenimage.py:176)
# Qwen-Image-Edit's system prompt (pipeline_qwenimage_edit.py:212, pipeline_qwenimage_edit_plus.py:215); its template's
# 64 tokens before the user's turn are dropped (prompt_template_encode_start_idx, :213 and :216)
QWENIMAGE_EDIT_SYSTEM = ("Describe the key features of the input image (color, shape, size, texture, objects, "
                         "background), then explain how the user's text instruction should alter or modify the image. "
                         "Generate a new image that meets the user's requirements while maintaining consistency with "
                         "the original input where appropriate.")
QWENIMAGE_EDIT_DROP = 64
# the edit templates' pieces, one token each in qwen_tokenizer(extra=...) (the real vocabulary's 64 dropped tokens)
QWENIMAGE_EDIT_PIECES = ("system\n" + QWENIMAGE_EDIT_SYSTEM, "user\n", *(f"Picture {i}: " for i in range(1, 9)))
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                   "[IMG_BREAK]", "[IMG_END]", "<pad>"]
# Mistral-Small-3.1-style template over the message format of pipeline_flux2.format_input (content: list of blocks)
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- set ns = namespace(text='') %}"
    "{%- if message['content'] is string %}{%- set ns.text = message['content'] %}{%- else %}"
    "{%- for block in message['content'] %}{%- if block['type'] == 'text' %}{%- set ns.text = ns.text + block['text'] %}"
    "{%- else %}{%- set ns.text = ns.text + '[IMG]' %}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + ns.text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + ns.text + '[/INST]' }}"
    "{%- else %}{{- ns.text + eos_token }}{%- endif %}{%- endfor %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table (the alphabet of byte-level BPE), in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # stand for themselves
    others = [b for b in range(256) if b not in printable]  # shifted to 256, 257, ...
    table = {**{b: b for b in printable}, **{b: 256 + i for i, b in enumerate(others)}}
    return [chr(table[b]) for b in range(256)]


def qwen_tokenizer(words=WORDS, *, extra=()) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer (byte-level BPE with Qwen's pre-tokenizer, so it saves and loads as itself) whose merges make
    each word (with and without its leading space) and each piece of the chat templates (and of the `extra` texts)
    one token; other text falls back to bytes. Merges are appended piece by piece: a later merge never fires inside an
    earlier piece, whose own merges always rank lower, so every piece stays one token."""
    pre_tokenizer = Qwen2Tokenizer().backend_tokenizer.pre_tokenizer
    texts = [*words, *(" " + w for w in words), "system\n" + QWENIMAGE_SYSTEM, "user\n\n", "assistant", *extra]
    pieces = list(dict.fromkeys(p for text in texts for p, _ in pre_tokenizer.pre_tokenize_str(text)))
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        tokens = [t.value for t in models.BPE(vocab=dict(vocab), merges=list(merges)).tokenize(piece)]
        for token in tokens[1:]:
            if (tokens[0], token) not in merges:
                merges.append((tokens[0], token))
            tokens[0] += token
            vocab.setdefault(tokens[0], len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    bpe = models.BPE(vocab=dict(vocab), merges=list(merges))
    assert all(len(bpe.tokenize(p)) == 1 for p in pieces)
    return tok


def mistral_processor(words=WORDS) -> PixtralProcessor:
    """FLUX.2 [dev]'s `tokenizer` component: a PixtralProcessor (pixtral image processor at the tiny vision tower's
    patch size) around a word-level tokenizer (case-folded words of `words`, Mistral's control tokens)."""
    vocab = {w: i for i, w in enumerate(MISTRAL_SPECIAL + sorted(set(words)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(MISTRAL_SPECIAL)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", model_max_length=1024)
    images = PixtralImageProcessorPil(patch_size=2, size={"longest_edge": 16})
    return PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=2, spatial_merge_size=2,
                            chat_template=MISTRAL_CHAT_TEMPLATE)


# ======== components ========
def _qwen2_5_vl(tok: Qwen2Tokenizer, hidden: int = 16, layers: int = 2) -> Qwen2_5_VLForConditionalGeneration:
    ids = tok.convert_tokens_to_ids
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, rope_theta=1e6,
                rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}, pad_token_id=tok.pad_token_id,
                bos_token_id=None, eos_token_id=ids("<|im_end|>"))
    vision = dict(depth=1, hidden_size=8, intermediate_size=8, num_heads=1, out_hidden_size=hidden, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwen3_config(tok: Qwen2Tokenizer, hidden: int, layers: int) -> Qwen3Config:
    return Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=1024,
                       rope_theta=1e6, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                       bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))


def _mistral3(proc: PixtralProcessor, hidden: int = 8, layers: int = 31) -> Mistral3ForConditionalGeneration:
    ids = proc.tokenizer.convert_tokens_to_ids
    text = dict(model_type="mistral", vocab_size=len(proc.tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                max_position_embeddings=1024, rope_theta=1e9, sliding_window=None, pad_token_id=ids("<pad>"),
                bos_token_id=ids("<s>"), eos_token_id=ids("</s>"))
    vision = dict(model_type="pixtral", hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                  head_dim=8, image_size=16, patch_size=2, num_channels=3)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=ids("[IMG]"),
                            spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)
    return Mistral3ForConditionalGeneration(config).eval()


def _kl_blocks(channels) -> dict:
    n = len(channels)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(channels), layers_per_block=1,
                norm_num_groups=8, sample_size=32)


def _flux2_parts(latent_channels: int, text_dim: int, guidance_embeds: bool, heads: int, head_dim: int,
                 num_layers: int, num_single_layers: int):
    """FLUX.2's VAE (BatchNorm statistics over the 2x2-patchified latents drawn from the seed: a trained toy would
    store measured ones), transformer and scheduler (the released configs: exponential dynamic shifting, the
    pipelines supply mu)."""
    vae = AutoencoderKLFlux2(**_kl_blocks((8, 16)), latent_channels=latent_channels, use_quant_conv=True,
                             use_post_quant_conv=True, patch_size=(2, 2))
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.num_features))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
        timestep_guidance_channels=256, axes_dims_rope=(head_dim // 4,) * 4, guidance_embeds=guidance_embeds)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    return vae, transformer, scheduler


# ======== builders ========
def build_qwenimage(seed: int = 0, num_layers: int = 2, heads: int = 2, head_dim: int = 16, z_dim: int = 4,
                    text_dim: int = 16) -> QwenImagePipeline:
    """A QwenImagePipeline with random weights. 32x32 -> 16x16 x z_dim latents -> 64 packed tokens of 4*z_dim."""
    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    text_encoder = _qwen2_5_vl(tok, hidden=text_dim)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False], latents_mean=(0.1 * torch.randn(z_dim)).tolist(),
                                 latents_std=(0.5 + torch.rand(z_dim)).tolist())
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=num_layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=text_dim, guidance_embeds=False,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8))
    # Qwen/Qwen-Image's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                             transformer=transformer)


def qwen_vl_processor(tok: Qwen2Tokenizer, max_pixels: int = 16 * 16) -> Qwen2VLProcessor:
    """Qwen-Image-Edit's `processor`: a Qwen2VLProcessor at the tiny vision tower's patch size 2 (merged 2x2: a token per
    4x4 pixels, as Qwen2.5-VL's 28x28), its images scaled to at most `max_pixels` (the released 12,845,056; here a
    384x384 source becomes 16x16 pixels, 16 tokens)."""
    size = {"shortest_edge": 8 * 8, "longest_edge": max_pixels}
    images = Qwen2VLImageProcessor(patch_size=2, temporal_patch_size=2, merge_size=2, size=size)
    videos = Qwen2VLVideoProcessor(patch_size=2, temporal_patch_size=2, merge_size=2)
    return Qwen2VLProcessor(image_processor=images, tokenizer=tok, video_processor=videos)


def build_qwenimage_edit_plus(*, seed: int = 0, zero_cond_t: bool = False, num_layers: int = 2, heads: int = 2,
                              head_dim: int = 16, z_dim: int = 4, text_dim: int = 16,
                              edit_class=None) -> DiffusionPipeline:
    """A QwenImageEditPlusPipeline (Qwen-Image-Edit-2509; `zero_cond_t`: 2511's transformer, the sources' tokens
    modulated at timestep 0) with random weights: Qwen2.5-VL with its vision tower, a Qwen2VLProcessor
    (qwen_vl_processor), a VAE compressing 4x (the released 8x; a source at the pipeline's ~1 MP would be 65,536
    tokens at 2x). 32x32 -> 8x8 x z_dim latents -> 16 packed tokens of 4*z_dim. `edit_class` QwenImageEditPipeline:
    Qwen-Image-Edit (2508, one source image)."""
    torch.manual_seed(seed)
    tok = qwen_tokenizer(extra=QWENIMAGE_EDIT_PIECES)
    text_encoder = _qwen2_5_vl(tok, hidden=text_dim)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False, False], latents_mean=(0.1 * torch.randn(z_dim)).tolist(),
                                 latents_std=(0.5 + torch.rand(z_dim)).tolist())
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=num_layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=text_dim, guidance_embeds=False, zero_cond_t=zero_cond_t,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8))
    # Qwen/Qwen-Image-Edit-2509's scheduler_config.json (Qwen-Image's)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    return (edit_class or QwenImageEditPlusPipeline)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, processor=qwen_vl_processor(tok),
        transformer=transformer)


def build_qwenimage_edit(*, seed: int = 0, **kwargs) -> QwenImageEditPipeline:
    """A QwenImageEditPipeline (Qwen-Image-Edit, 2508: one source image, its Qwen2.5-VL input the VAE's ~1 MP
    resize) with random weights, built as build_qwenimage_edit_plus."""
    return build_qwenimage_edit_plus(seed=seed, edit_class=QwenImageEditPipeline, **kwargs)


def build_flux2(seed: int = 0, num_layers: int = 1, num_single_layers: int = 1, heads: int = 2, head_dim: int = 16,
                latent_channels: int = 4, text_dim: int = 8) -> Flux2Pipeline:
    """A Flux2Pipeline (FLUX.2 [dev]) with random weights; the Mistral3 text encoder has 31 layers of width
    `text_dim` (the pipeline stacks hidden_states 10, 20, 30: joint_attention_dim = 3 * text_dim). 32x32 -> 16x16 x
    latent_channels latents -> 64 tokens of 4*latent_channels."""
    torch.manual_seed(seed)
    proc = mistral_processor()
    text_encoder = _mistral3(proc, hidden=text_dim, layers=31)
    vae, transformer, scheduler = _flux2_parts(latent_channels, 3 * text_dim, True, heads, head_dim, num_layers,
                                               num_single_layers)
    return Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=proc,
                         transformer=transformer)


def build_flux2_klein(seed: int = 0, distilled: bool = False, num_layers: int = 1, num_single_layers: int = 1,
                      heads: int = 2, head_dim: int = 16, latent_channels: int = 4, text_dim: int = 8) -> Flux2KleinPipeline:
    """A Flux2KleinPipeline with random weights: Qwen3 causal LM of 28 layers (hidden_states 9, 18, 27 stacked),
    no guidance embedding. `distilled`: the step-distilled variant (config is_distilled: no CFG)."""
    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(_qwen3_config(tok, text_dim, 28)).eval()
    vae, transformer, scheduler = _flux2_parts(latent_channels, 3 * text_dim, False, heads, head_dim, num_layers,
                                               num_single_layers)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                              transformer=transformer, is_distilled=distilled)


def build_zimage(seed: int = 0, turbo: bool = False, dim: int = 32, heads: int = 2, n_layers: int = 2,
                 n_refiner_layers: int = 1, latent_channels: int = 4, text_dim: int = 16) -> ZImagePipeline:
    """A ZImagePipeline with random weights: Qwen3Model text encoder (hidden_states[-2]), FLUX.1-style AutoencoderKL
    (scaling 0.3611, shift 0.1159), static-shift scheduler (Z-Image 6.0; `turbo`: Z-Image-Turbo's 3.0; use it with
    CALL_DEFAULTS["zimage-turbo"]: guidance 0, 8 steps). 32x32 -> 16x16 x latent_channels -> 64 tokens (2x2 patches)."""
    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    text_encoder = Qwen3Model(_qwen3_config(tok, text_dim, 2)).eval()
    vae = AutoencoderKL(**_kl_blocks((8, 16)), latent_channels=latent_channels, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    head_dim = dim // heads
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=dim, n_layers=n_layers,
        n_refiner_layers=n_refiner_layers, n_heads=heads, n_kv_heads=heads, cap_feat_dim=text_dim,
        axes_dims=[head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8])
    with torch.no_grad():  # learned padding embeddings (zeros at construction)
        transformer.x_pad_token.normal_(0.0, 0.02)
        transformer.cap_pad_token.normal_(0.0, 0.02)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0 if turbo else 6.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                          transformer=transformer)


# the released models' recommended call arguments (model cards; Z-Image-Turbo: pipeline_z_image.py's example)
CALL_DEFAULTS = {
    "qwenimage": dict(negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=50),
    "flux2": dict(guidance_scale=4.0, num_inference_steps=50),
    "flux2-klein": dict(guidance_scale=4.0, num_inference_steps=50),
    "flux2-klein-distilled": dict(guidance_scale=1.0, num_inference_steps=4),
    "zimage": dict(guidance_scale=4.0, num_inference_steps=50),
    "zimage-turbo": dict(guidance_scale=0.0, num_inference_steps=8),
}
_ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
         "attn.add_v_proj", "attn.to_add_out"]
# adapter targets (peft suffix match); FLUX.2's single-block output projection `attn.to_out` shares its suffix with
# the double blocks' ModuleList `attn.to_out`, so lora_targets() names it per block
LORA_TARGETS = {
    "qwenimage": _ATTN + ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"],
    "flux2": _ATTN + ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                      "attn.to_qkv_mlp_proj"],
    "zimage": ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
               "feed_forward.w2", "feed_forward.w3"],
}


def family(pipe_or_transformer) -> str:
    t = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    return {QwenImageTransformer2DModel: "qwenimage", Flux2Transformer2DModel: "flux2",
            ZImageTransformer2DModel: "zimage"}[type(t)]


def lora_targets(transformer) -> list[str]:
    """LORA_TARGETS of the transformer's family, FLUX.2's single-block output projections named in full."""
    singles = range(len(getattr(transformer, "single_transformer_blocks", [])))
    return LORA_TARGETS[family(transformer)] + [f"single_transformer_blocks.{i}.attn.to_out" for i in singles]


def transformer_blocks(transformer) -> list:
    """The transformer's blocks in execution order (the FSDP2 units): Qwen-Image transformer_blocks; FLUX.2
    transformer_blocks + single_transformer_blocks; Z-Image noise_refiner + context_refiner + layers."""
    names = {"qwenimage": ["transformer_blocks"], "flux2": ["transformer_blocks", "single_transformer_blocks"],
             "zimage": ["noise_refiner", "context_refiner", "layers"]}[family(transformer)]
    return [block for name in names for block in getattr(transformer, name)]


# ======== sampling written against the components (the checks compare it with the pipelines) ========
def flow_sigmas(config, steps: int, mu: float, base=None) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=base, mu=mu), float32 like it, with the final 0."""
    s = np.array(np.linspace(1.0, 1 / steps, steps) if base is None else base).astype(np.float32)
    if config.use_dynamic_shifting:
        s = math.exp(mu) / (math.exp(mu) + (1 / s - 1) ** 1.0) if config.time_shift_type == "exponential" else \
            mu / (mu + (1 / s - 1) ** 1.0)
    else:
        s = config.shift * s / (1 + (config.shift - 1) * s)
    if config.shift_terminal:
        s = 1 - (1 - s) / ((1 - s[-1]) / (1 - config.shift_terminal))
    return torch.cat([torch.from_numpy(s).float(), torch.zeros(1)])


def linear_mu(seq_len: int, config) -> float:
    """calculate_shift: mu linear in the image token count between (base_image_seq_len, base_shift) and
    (max_image_seq_len, max_shift)."""
    m = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
    return seq_len * m + config.base_shift - m * config.base_image_seq_len


def empirical_mu(seq_len: int, steps: int) -> float:
    """FLUX.2's compute_empirical_mu: mu fitted in the token count and the number of steps."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq_len > 4300:
        return float(a2 * seq_len + b2)
    m_200, m_10 = a2 * seq_len + b2, a1 * seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + m_200 - 200.0 * a)


def encode_qwenimage(pipe, prompts: list[str], max_sequence_length: int):
    """Template around each prompt, last hidden state, the 34 template tokens dropped, zero-padded to the longest
    (mask None when nothing is padded), cut at max_sequence_length."""
    template = "<|im_start|>system\n" + QWENIMAGE_SYSTEM + "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n" \
                                                           "<|im_start|>assistant\n"
    batch = pipe.tokenizer([template.format(p) for p in prompts], padding=True, return_tensors="pt")
    hidden = pipe.text_encoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               output_hidden_states=True).hidden_states[-1]
    rows = [h[m.bool()][QWENIMAGE_DROP:] for h, m in zip(hidden, batch.attention_mask)]
    length = max(len(r) for r in rows)
    emb = torch.stack([torch.cat([r, r.new_zeros(length - len(r), r.shape[1])]) for r in rows])[:, :max_sequence_length]
    mask = torch.stack([torch.arange(length) < len(r) for r in rows]).long()[:, :max_sequence_length]
    return emb, (None if mask.all() else mask)


def sample_qwenimage(pipe, prompt: str, height: int, width: int, steps: int, generator, negative_prompt=None,
                     true_cfg_scale: float = 4.0, max_sequence_length: int = 512) -> torch.Tensor:
    emb, mask = encode_qwenimage(pipe, [prompt], max_sequence_length)
    cfg = negative_prompt is not None and true_cfg_scale > 1
    if cfg:
        neg, neg_mask = encode_qwenimage(pipe, [negative_prompt], max_sequence_length)
    f = 2 ** len(pipe.vae.temperal_downsample)
    h, w, c = 2 * (height // (2 * f)), 2 * (width // (2 * f)), pipe.transformer.config.in_channels // 4
    noise = torch.randn((1, 1, c, h, w), generator=generator, dtype=emb.dtype)  # (B, frames, C, H, W)
    x = noise.view(1, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, h * w // 4, 4 * c)
    sigmas = flow_sigmas(pipe.scheduler.config, steps, linear_mu(x.shape[1], pipe.scheduler.config))
    shapes = [[(1, h // 2, w // 2)]]
    for i in range(steps):
        t = (sigmas[i] * 1000).expand(1) / 1000
        v = pipe.transformer(hidden_states=x, timestep=t, guidance=None, encoder_hidden_states_mask=mask,
                             encoder_hidden_states=emb, img_shapes=shapes, return_dict=False)[0]
        if cfg:
            v_neg = pipe.transformer(hidden_states=x, timestep=t, guidance=None, encoder_hidden_states_mask=neg_mask,
                                     encoder_hidden_states=neg, img_shapes=shapes, return_dict=False)[0]
            comb = v_neg + true_cfg_scale * (v - v_neg)
            v = comb * (v.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))  # back to the cond. norm
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def decode_qwenimage(pipe, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    f, c = 2 ** len(pipe.vae.temperal_downsample), pipe.vae.config.z_dim
    h, w = 2 * (height // (2 * f)), 2 * (width // (2 * f))
    z = x.view(-1, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(-1, c, 1, h, w)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, c, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, c, 1, 1, 1)
    z = z / (1.0 / std) + mean  # written as the pipeline writes it (bit-identical)
    return (pipe.vae.decode(z, return_dict=False)[0][:, :, 0] * 0.5 + 0.5).clamp(0, 1)


def encode_flux2(pipe, prompts: list[str], max_sequence_length: int, layers=(10, 20, 30)) -> torch.Tensor:
    """System message + prompt through the processor's chat template, padded to max_sequence_length; hidden states
    of `layers` stacked on the channel axis: [B, L, 3 * hidden]."""
    messages = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                 {"role": "user", "content": [{"type": "text", "text": p}]}] for p in prompts]
    batch = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True,
                                               return_tensors="pt", padding="max_length", truncation=True,
                                               max_length=max_sequence_length)
    out = pipe.text_encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[k] for k in layers], dim=-1)


def encode_klein(pipe, prompts: list[str], max_sequence_length: int, layers=(9, 18, 27)) -> torch.Tensor:
    """Qwen3 chat template (generation prompt, enable_thinking=False), padded to max_sequence_length; hidden states
    of `layers` stacked on the channel axis."""
    texts = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False) for p in prompts]
    batch = pipe.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                           max_length=max_sequence_length)
    out = pipe.text_encoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                            use_cache=False)
    return torch.cat([out.hidden_states[k] for k in layers], dim=-1)


def _flux2_ids(length: int, h: int, w: int):
    """RoPE positions (T, H, W, L): text (0, 0, 0, l), image tokens (0, h, w, 0)."""
    one = torch.arange(1)
    return (torch.cartesian_prod(one, one, one, torch.arange(length))[None],
            torch.cartesian_prod(one, torch.arange(h), torch.arange(w), one)[None])


def sample_flux2(pipe, prompt: str, height: int, width: int, steps: int, generator, guidance_scale: float = 4.0,
                 max_sequence_length: int = 512) -> torch.Tensor:
    """Flux2Pipeline and Flux2KleinPipeline: returns packed tokens [B, h/2 * w/2, 4C] (what Flux2Pipeline returns
    for output_type="latent"; unpack_flux2_latents() gives Flux2KleinPipeline's, the VAE's latent space)."""
    klein = isinstance(pipe, Flux2KleinPipeline)
    encode = encode_klein if klein else encode_flux2
    emb = encode(pipe, [prompt], max_sequence_length)
    cfg = klein and guidance_scale > 1 and not pipe.config.is_distilled
    if cfg:
        neg = encode(pipe, [""], max_sequence_length)
    f = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    h, w, c4 = height // (2 * f), width // (2 * f), pipe.transformer.config.in_channels
    noise = torch.randn((1, c4, h, w), generator=generator, dtype=emb.dtype)  # drawn already 2x2-patchified
    x = noise.reshape(1, c4, h * w).permute(0, 2, 1)
    txt_ids, img_ids = _flux2_ids(emb.shape[1], h, w)
    sigmas = flow_sigmas(pipe.scheduler.config, steps, empirical_mu(h * w, steps))
    guidance = None if klein else torch.full((1,), guidance_scale, dtype=torch.float32)
    for i in range(steps):
        t = (sigmas[i] * 1000).expand(1) / 1000
        v = pipe.transformer(hidden_states=x, timestep=t, guidance=guidance, encoder_hidden_states=emb,
                             txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        if cfg:
            v_neg = pipe.transformer(hidden_states=x, timestep=t, guidance=None, encoder_hidden_states=neg,
                                     txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
            v = v_neg + guidance_scale * (v - v_neg)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def unpack_flux2_latents(pipe, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed tokens -> the VAE's latent space [B, C, H, W]: unpack, undo the BatchNorm standardisation, unpatchify."""
    f = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    h, w, c4 = height // (2 * f), width // (2 * f), x.shape[-1]
    z = x.permute(0, 2, 1).reshape(-1, c4, h, w)
    z = z * torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps) \
        + pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    return z.reshape(-1, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(-1, c4 // 4, 2 * h, 2 * w)


def decode_flux2(pipe, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    z = x if isinstance(pipe, Flux2KleinPipeline) else unpack_flux2_latents(pipe, x, height, width)
    return (pipe.vae.decode(z, return_dict=False)[0] * 0.5 + 0.5).clamp(0, 1)


def encode_zimage(pipe, prompts: list[str], max_sequence_length: int) -> list[torch.Tensor]:
    """Qwen3 chat template (generation prompt, enable_thinking=True: no think block), padded to max_sequence_length;
    hidden_states[-2] with the padding dropped: one [len_i, hidden] tensor per prompt."""
    texts = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=True) for p in prompts]
    batch = pipe.tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                           return_tensors="pt")
    mask = batch.attention_mask.bool()
    hidden = pipe.text_encoder(input_ids=batch.input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    return [h[m] for h, m in zip(hidden, mask)]


def sample_zimage(pipe, prompt: str, height: int, width: int, steps: int, generator, guidance_scale: float = 5.0,
                  negative_prompt: str = "", cfg_normalization: float = 0.0, cfg_truncation: float = 1.0,
                  max_sequence_length: int = 512) -> torch.Tensor:
    caps = encode_zimage(pipe, [prompt], max_sequence_length)
    if guidance_scale > 0:
        caps = caps + encode_zimage(pipe, [negative_prompt], max_sequence_length)  # one batch: [cond, uncond]
    f = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    h, w = 2 * (height // (2 * f)), 2 * (width // (2 * f))
    x = torch.randn((1, pipe.transformer.config.in_channels, h, w), generator=generator, dtype=torch.float32)
    sigmas = flow_sigmas(pipe.scheduler.config, steps, mu=0.0, base=torch.linspace(1.0, 1 / steps, steps).tolist())
    for i in range(steps):
        t = (1000 - (sigmas[i] * 1000).expand(1)) / 1000  # the model's time is 1 - sigma
        scale = guidance_scale if guidance_scale > 0 and t.item() <= cfg_truncation else 0.0
        n = 2 if scale > 0 else 1
        out = pipe.transformer(list(x.repeat(n, 1, 1, 1).unsqueeze(2).unbind(0)), t.repeat(n), caps[:n],
                               return_dict=False)[0]
        v = out[0].float()
        if scale > 0:
            pos, neg = out[0].float(), out[1].float()
            v = pos + scale * (pos - neg)
            if cfg_normalization and v.norm() > pos.norm() * float(cfg_normalization):
                v = v * (pos.norm() * float(cfg_normalization) / v.norm())
        x = x + (sigmas[i + 1] - sigmas[i]) * -v.squeeze(1)[None]  # the transformer predicts minus the velocity
    return x


def decode_zimage(pipe, x: torch.Tensor) -> torch.Tensor:
    z = x / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return (pipe.vae.decode(z, return_dict=False)[0] * 0.5 + 0.5).clamp(0, 1)


# ======== checks ========
PROMPT = "a red circle on the left"
# name: (builder, builder kwargs, call kwargs of the check: 2 steps, a short max_sequence_length that holds the prompt)
CHECKS = {
    "qwenimage": (build_qwenimage, {}, dict(negative_prompt=" ", true_cfg_scale=4.0, max_sequence_length=16)),
    "flux2": (build_flux2, {}, dict(guidance_scale=4.0, max_sequence_length=48)),
    "flux2-klein": (build_flux2_klein, {}, dict(guidance_scale=4.0, max_sequence_length=24)),
    "flux2-klein-distilled": (build_flux2_klein, dict(distilled=True), dict(guidance_scale=1.0, max_sequence_length=24)),
    "zimage": (build_zimage, {}, dict(guidance_scale=4.0, cfg_normalization=True, max_sequence_length=16)),
    "zimage-turbo": (build_zimage, dict(turbo=True), dict(guidance_scale=0.0, max_sequence_length=16)),
}


def sample(pipe, prompt: str, height: int, width: int, steps: int, generator, **call):
    """(latents as the pipeline returns them for output_type="latent", images in [0, 1] as for "pt")."""
    if isinstance(pipe, QwenImagePipeline):
        x = sample_qwenimage(pipe, prompt, height, width, steps, generator, **call)
        return x, decode_qwenimage(pipe, x, height, width)
    if isinstance(pipe, (Flux2Pipeline, Flux2KleinPipeline)):
        x = sample_flux2(pipe, prompt, height, width, steps, generator, **call)
        x = unpack_flux2_latents(pipe, x, height, width) if isinstance(pipe, Flux2KleinPipeline) else x
        return x, decode_flux2(pipe, x, height, width)
    x = sample_zimage(pipe, prompt, height, width, steps, generator, **call)
    return x, decode_zimage(pipe, x)


def _encoding_facts(pipe, name: str, call: dict) -> str:
    """The text conditioning as the loop builds it, checked against the pipeline's encode_prompt."""
    msl = call["max_sequence_length"]
    if name == "qwenimage":
        ids = pipe.tokenizer(pipe.prompt_template_encode.format(PROMPT)).input_ids
        assert pipe.tokenizer.decode(ids[pipe.prompt_template_encode_start_idx:]).startswith(PROMPT + "<|im_end|>")
        mine, theirs = encode_qwenimage(pipe, [PROMPT], msl)[0], pipe.encode_prompt(PROMPT, max_sequence_length=msl)[0]
    elif name.startswith("flux2"):
        mine = (encode_klein if "klein" in name else encode_flux2)(pipe, [PROMPT], msl)
        theirs = pipe.encode_prompt(PROMPT, max_sequence_length=msl)[0]
    else:
        mine, theirs = encode_zimage(pipe, [PROMPT], msl)[0], pipe.encode_prompt(PROMPT, max_sequence_length=msl,
                                                                                 do_classifier_free_guidance=False)[0][0]
    assert mine.shape == theirs.shape, (mine.shape, theirs.shape)
    return f"text {tuple(mine.shape)} |d|={(mine - theirs).abs().max().item():.1e}"


def _lora_facts(transformer) -> str:
    from peft import LoraConfig, inject_adapter_in_model
    targets = lora_targets(transformer)
    names = [n for n, _ in transformer.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    assert not missing, missing
    probe = inject_adapter_in_model(LoraConfig(r=2, target_modules=targets), type(transformer).from_config(
        transformer.config))
    wrapped = sum(1 for n, _ in probe.named_modules() if n.endswith(".lora_A"))
    return f"LoRA {len(targets)} targets -> {wrapped} adapters"


def check_family(name: str, size: int = 32, steps: int = 2, seed: int = 0) -> float:
    """Build, save, load with DiffusionPipeline.from_pretrained, sample with the loaded pipeline (output_type
    "latent" and "pt") and with the loop above; returns max |pipeline latents - loop latents|."""
    builder, build_kw, call = CHECKS[name]
    pipe = builder(seed=seed, **build_kw)
    with tempfile.TemporaryDirectory() as path:
        pipe.save_pretrained(path)
        mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2 ** 20
        loaded = DiffusionPipeline.from_pretrained(path)
    assert type(loaded) is type(pipe), type(loaded)
    for p in (pipe, loaded):
        p.set_progress_bar_config(disable=True)
    run = dict(prompt=PROMPT, height=size, width=size, num_inference_steps=steps, **call)
    with torch.no_grad():
        ref = pipe(**run, generator=torch.Generator().manual_seed(seed), output_type="latent").images
        lat = loaded(**run, generator=torch.Generator().manual_seed(seed), output_type="latent").images
        img = loaded(**run, generator=torch.Generator().manual_seed(seed), output_type="pt").images
        mine, mine_img = sample(loaded, PROMPT, size, size, steps, torch.Generator().manual_seed(seed), **call)
        text = _encoding_facts(loaded, name, call)
    # not bit-equal: loaded weights can sit at unaligned addresses (safetensors), which changes CPU matmul rounding
    reload_diff = (ref - lat).abs().max().item()
    diff, img_diff = (lat - mine).abs().max().item(), (img - mine_img).abs().max().item()
    params = sum(p.numel() for p in loaded.transformer.parameters())
    ok = max(diff, img_diff, reload_diff) < 1e-5
    print(f"{name:22s} max |pipeline - loop| latents {diff:.1e}, images {img_diff:.1e}  {'ok' if ok else 'FAIL'}\n"
          f"{'':24s}built vs loaded {reload_diff:.0e}, latents {tuple(lat.shape)}, {text}, transformer "
          f"{params / 1e3:.0f}k params in {len(transformer_blocks(loaded.transformer))} blocks, "
          f"{_lora_facts(loaded.transformer)}, {mb:.2f} MB on disk")
    assert ok, name
    return diff


if __name__ == "__main__":
    import diffusers
    import transformers
    torch.set_num_threads(1)
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()  # the processor's advice about FLUX.2's own call style
    for key in CHECKS:
        check_family(key)
