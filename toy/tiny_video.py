"""Tiny random-weight WanPipelines built offline from configs (no downloads), the two VAE layouts of the family.

    build_wan()                  WanPipeline  Wan2.1-style: AutoencoderKLWan z_dim 4 (the real one 16), 4x time and 4x
                                 space compression here (8x in the real one), UniPC with flow_shift 3.0 (480p)
    build_wan(version="2.2")     WanPipeline  Wan2.2-TI2V-5B-style: a residual VAE with 2x2 patchification, 48 latent
                                 channels and 16x space compression (as the real one), expand_timesteps, flow_shift 5.0

Both keep the family's 4x temporal compression (a clip of 1 + 4k frames has 1 + k latent frames), its UMT5 text encoder
(tiny) behind a word-level tokenizer, its WanTransformer3DModel (2x2 patches, RoPE over frames, rows and columns) and
the UniPC scheduler with a flow shift that the released checkpoints ship (scheduler_config.json). `euler_scheduler` is
the anchors' rollout schedule as a diffusers scheduler: UniPC's sigmas and int64 timesteps, stepped by Euler
(Flow-GRPO's wan_pipeline_with_logprob, Flow-Factory's UniPCMultistepSDEScheduler in ODE mode).

    python toy/tiny_video.py     # both layouts: save/load round trip, the pipeline against the project's sampler
"""
import os
import sys

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline
from diffusers import WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import WORDS, word_tokenizer  # noqa: E402

VIDEO_WORDS = list(WORDS) + "moving to falling rising slowly quickly".split()


def unipc(flow_shift: float) -> UniPCMultistepScheduler:
    """The scheduler of Wan-AI's Diffusers checkpoints (scheduler_config.json): UniPC, flow sigmas, a static shift."""
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=flow_shift, solver_order=2, solver_type="bh2", final_sigmas_type="zero")


def tiny_wan_vae(version: str = "2.1", z_dim: int | None = None, base_dim: int = 8,
                 latents_mean=None, latents_std=None) -> AutoencoderKLWan:
    """An AutoencoderKLWan with the family's causal 3D convolutions and 4x temporal compression. 2.1: two spatial
    downsamplings (4x), z_dim 4; 2.2: the residual, 2x2-patchified layout with three (16x), z_dim 48."""
    z = z_dim or (4 if version == "2.1" else 48)
    stats = dict(latents_mean=list(latents_mean if latents_mean is not None else (0.1 * torch.randn(z)).tolist()),
                 latents_std=list(latents_std if latents_std is not None else (0.5 + torch.rand(z)).tolist()))
    if version == "2.1":
        return AutoencoderKLWan(base_dim=base_dim, z_dim=z, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
                                temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4,
                                **stats)
    return AutoencoderKLWan(base_dim=base_dim, decoder_base_dim=base_dim, z_dim=z, dim_mult=[1, 1, 1, 1],
                            num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
                            is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                            scale_factor_temporal=4, **stats)


def tiny_umt5(vocab_size: int, d_model: int = 16, layers: int = 1) -> UMT5EncoderModel:
    return UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model,
                                       num_layers=layers, num_heads=2, relative_attention_num_buckets=8,
                                       pad_token_id=0, eos_token_id=3, decoder_start_token_id=0))


def tiny_wan_transformer(in_channels: int, text_dim: int = 16, heads: int = 2, head_dim: int = 12, layers: int = 1,
                         ffn_dim: int = 32) -> WanTransformer3DModel:
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                 in_channels=in_channels, out_channels=in_channels, text_dim=text_dim, freq_dim=32,
                                 ffn_dim=ffn_dim, num_layers=layers, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=64)


def build_wan(seed: int = 0, version: str = "2.1", max_length: int = 16, vae: AutoencoderKLWan | None = None,
              transformer: WanTransformer3DModel | None = None, text_dim: int = 16,
              words=VIDEO_WORDS) -> WanPipeline:
    """A WanPipeline with random weights (or the given VAE and transformer). 2.1: 32x32 x 9 frames -> latents
    [4, 3, 8, 8] -> 48 tokens; 2.2: 64x64 x 9 frames -> [48, 3, 4, 4] -> 12 tokens."""
    torch.manual_seed(seed)
    tok = word_tokenizer(max_length, words=words)
    vae = vae or tiny_wan_vae(version)
    transformer = transformer or tiny_wan_transformer(vae.config.z_dim, text_dim=text_dim)
    return WanPipeline(tokenizer=tok, text_encoder=tiny_umt5(len(tok), d_model=text_dim), vae=vae,
                       transformer=transformer, scheduler=unipc(3.0 if version == "2.1" else 5.0),
                       expand_timesteps=version == "2.2")


class EulerOnUniPC(FlowMatchEulerDiscreteScheduler):
    """The anchors' Wan rollout schedule as a diffusers scheduler (for WanPipeline): the shipped UniPC scheduler's
    sigmas and int64 timesteps (its set_timesteps), each step an Euler step x + (sigma_next - sigma) v."""

    def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
        grid = unipc(self.config.shift)
        grid.set_timesteps(num_inference_steps)
        super().set_timesteps(sigmas=grid.sigmas[:-1].numpy(), device=device)
        self.timesteps = grid.timesteps.to(device=device, dtype=torch.float32)


def euler_scheduler(pipe) -> EulerOnUniPC:
    """EulerOnUniPC with the pipeline's own flow shift (shift 1 on top: the sigmas are taken as they are)."""
    scheduler = EulerOnUniPC(shift=1.0)
    scheduler.register_to_config(shift=pipe.scheduler.config.flow_shift)  # read back by set_timesteps
    return scheduler


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import common
    torch.set_num_threads(1)
    for version, size in (("2.1", 32), ("2.2", 64)):
        with tempfile.TemporaryDirectory() as path:
            build_wan(version=version).save_pretrained(path)
            pipe, kind = common.load_pipeline(path, torch.device("cpu"))
        for frames in (1, 5, 9):
            for guidance in (1.0, 5.0):
                shape = common.latent_shape(pipe, kind, size, frames=frames)
                sigmas = common.pipeline_sigmas(pipe, kind, num_steps=4, shape=shape)
                emb = common.encode_prompts(pipe, kind, ["a red circle moving to the right"], max_sequence_length=16,
                                            cfg=guidance)
                noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(0))
                ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(5))], sigmas, emb,
                                           guidance=guidance, micro_batch=1)
                pipe.scheduler, shipped = euler_scheduler(pipe), pipe.scheduler
                theirs = pipe(prompt="a red circle moving to the right", negative_prompt="", height=size, width=size,
                              num_frames=frames, num_inference_steps=4, guidance_scale=guidance, latents=noise,
                              output_type="latent", max_sequence_length=16).frames
                pipe.scheduler = shipped
                print(f"Wan{version} {frames} frames, guidance {guidance}: latents {tuple(ours.shape)}, "
                      f"max |pipeline - ours| {(ours - theirs).abs().max().item():.1e}")
