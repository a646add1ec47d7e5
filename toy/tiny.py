"""Tiny diffusers pipelines built from configs (random weights, no downloads).

`build_flux` gives a genuine `FluxPipeline` (the embedded toy model is one of these, trained by `make_toy.py`);
`build_flux_kontext` a `FluxKontextPipeline` and `build_sd3` a `StableDiffusion3Pipeline` for tests. They use
word-level tokenizers that always put a BOS token first and an EOS token last, so an empty prompt never yields an
all-padding row and CLIP's pooled output (taken at the first EOS) is well defined.
"""
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, PreTrainedTokenizerFast
from transformers import T5Config, T5EncoderModel

SPECIAL = ["<pad>", "<bos>", "<unk>", "<eos>"]  # ids 0..3; CLIP's eos id must not be 2 (legacy argmax pooling)
WORDS = ("a an and the on of in at left right top bottom red green blue yellow circle square triangle "
         "cat dog photo picture image").split()


def word_tokenizer(max_length: int = 16, words=WORDS) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIAL + sorted(set(words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=max_length)


def _text_config(vocab_size: int, hidden: int, max_length: int, projection_dim: int = 32) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=max_length, projection_dim=projection_dim,
                          pad_token_id=0, bos_token_id=1, eos_token_id=3)


def _t5(vocab_size: int, d_model: int) -> T5EncoderModel:
    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model,
                                   num_layers=1, num_heads=2, pad_token_id=0, eos_token_id=3, decoder_start_token_id=0))


def tiny_vae(latent_channels: int = 4, channels=(16, 32), shift_factor: float = 0.0) -> AutoencoderKL:
    n = len(channels)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                         up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(channels), layers_per_block=1,
                         latent_channels=latent_channels, norm_num_groups=8, sample_size=32, scaling_factor=1.0,
                         shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False)


def build_flux(seed: int = 0, hidden_heads: int = 2, head_dim: int = 16, num_layers: int = 1, num_single_layers: int = 1,
               text_dim: int = 32, max_length: int = 16, guidance_embeds: bool = True, vae: AutoencoderKL | None = None,
               shift: float = 3.0, dynamic_shifting: bool = False) -> FluxPipeline:
    """A FluxPipeline with random weights. 32x32 images -> 16x16x4 latents -> 64 packed tokens of 16 channels.
    `dynamic_shifting`: FLUX.1-dev's scheduler config (resolution-dependent shift) instead of a static `shift`."""
    torch.manual_seed(seed)
    tok = word_tokenizer(max_length)
    vae = vae or tiny_vae()
    rope = [head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8]
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=num_layers,
        num_single_layers=num_single_layers, attention_head_dim=head_dim, num_attention_heads=hidden_heads,
        joint_attention_dim=text_dim, pooled_projection_dim=text_dim, guidance_embeds=guidance_embeds,
        axes_dims_rope=rope)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=dynamic_shifting, base_shift=0.5,
                                                  max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
        vae=vae,
        text_encoder=CLIPTextModel(_text_config(len(tok), text_dim, max_length)), tokenizer=tok,
        text_encoder_2=_t5(len(tok), text_dim), tokenizer_2=word_tokenizer(max_length), transformer=transformer)


def build_flux_kontext(seed: int = 0, **kwargs) -> FluxKontextPipeline:
    """A FluxKontextPipeline with random weights, of build_flux's components (FLUX.1 Kontext [dev] is a FLUX.1 [dev]
    transformer that also reads the source image's tokens)."""
    return FluxKontextPipeline(**build_flux(seed, **kwargs).components)


def build_sd3(seed: int = 0, max_length: int = 16) -> StableDiffusion3Pipeline:
    """A StableDiffusion3Pipeline with random weights (two CLIP encoders with projection, T5, CFG-ready); its block
    has SD3.5-M's second (dual) attention `attn2`."""
    torch.manual_seed(seed)
    tok = word_tokenizer(max_length)
    clip = lambda: CLIPTextModelWithProjection(_text_config(len(tok), 32, max_length, projection_dim=32))  # noqa: E731
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16,
                                        pooled_projection_dim=64, out_channels=4, dual_attention_layers=(0,))
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(shift_factor=0.1), transformer=transformer,
        text_encoder=clip(), tokenizer=tok, text_encoder_2=clip(), tokenizer_2=word_tokenizer(max_length),
        text_encoder_3=_t5(len(tok), 64), tokenizer_3=word_tokenizer(max_length))
