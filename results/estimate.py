"""Per-GPU peak memory and compute per iteration of the README's command lines, estimated on a CPU.

    python results/estimate.py            # every command of COMMANDS (hours) -> results/estimate.md
    python results/estimate.py --only 3 5 --no-undo   # these rows (without the before/after table's re-runs)
    python results/estimate.py --tiny --out /tmp/e.md # the same code paths on tiny architectures (the tests)

Each row (a command, the reward models, an evaluation) is a JSON file under results/estimate/rows/ (the --out path
without .md, then /rows), holding what made it and the commit it was measured at; a rerun reuses every file that
still matches its row and computes the rest (a killed run loses the row in progress only), --fresh recomputes
all, and the report is rebuilt from the files.

Each command is parsed into its algorithm file's own `Args` (tyro). The real architectures (the FLUX.1-dev and
SD3.5-M transformers, T5-XXL and CLIP text encoders, the VAE, the reward models: open_clip ViT-H-14 for HPS
and the CLIP score, PickScore's CLIP-H, ImageReward's BLIP, the aesthetic predictor's CLIP ViT-L/14) are built
under `FakeTensorMode`: shapes and dtypes only, no data, no memory. Full fine-tuning is sharded by
`common.make_trainable` itself (FSDP2, bf16 compute, float32 master shards) over a fake process group of the
command's world size; LoRA runs hold bf16 frozen weights and float32 adapters, also from `make_trainable`.
The newer families of models.py are built too (`architectures`: Qwen-Image with Qwen2.5-VL-7B, FLUX.2 [dev]
with Mistral-Small-3.1-24B, FLUX.2 [klein] 4B / 9B with Qwen3-4B / 8B, Z-Image with Qwen3-4B, Wan2.1-T2V-1.3B /
14B and Wan2.2-TI2V-5B with UMT5-XXL and their video VAEs; the --model aliases in ARCHITECTURE), each run
through its family's own velocity, decoding and embeddings (every prompt counted at --max-sequence-length tokens
where the family cuts them to the longest: an upper bound). A video row keeps every sample's decoded frames
(float32) for the rewards, as the files do, and an image reward scores the frames --frame-reduce picks.
The editing rows (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2 with --condition-size) give each prompt one source
at the target's size, resized by the family's own code (edit_condition); its packed latents ("cond") ride in
the prompt's embeddings, so every forward runs on the target's and the source's tokens (the families'
velocity); the encode phases add the sources' VAE encoding and, for Qwen-Image-Edit, the Qwen2.5-VL encoder on
each prompt alone with the source's image tokens in its sequence (the vision tower's FLOPs in closed form:
vision_flops); image_similarity is the CLIP ViT-L/14 image tower, GenEval a server (no GPU memory).
One iteration's phases then run on one rank with the shapes the file uses:
- encode: the text encoders on the GPU for 16 prompts (`common.encode_prompts`' chunk), called as the pipelines
  call them; with --text-cache only the embeddings, read from disk (the start-up's fill measured apart: the
  text encoders alone on the GPU with the reward models, encoding 16 prompts);
- rollout: what the file keeps for the whole iteration (every latent, the log-probs, the sampler's velocities
  where it keeps them, the images, G2RPO's anchors, DenseGRPO's completions), `common.gathered` weights, one
  no-grad `common.velocity` forward of a micro-batch and `common.ode_complete`'s buffers;
- decode: one VAE call of 4 latents (`common.decode`); rewards: each training reward on the images the file
  scores at once, preprocessing included, towers in bf16 and heads in float32 as rewards.py runs them
  (Flow-GRPO + CoCA: then the credit of `common.coca_credit` on the x0 predictions);
- training step: one micro-batch with the files' own lines (`velocity` with grad, the file's `sde_step`
  with prev_sample, for beta > 0 the reference velocity under `common.as_reference` and its step mean, the
  PPO-clipped loss, backward); optimizer step: gradient clipping and AdamW;
- evaluation encode / evaluation: `rundir.Run.evaluate`'s phases for this rank's held-out pairs.
`torch.distributed._tools.MemTracker` gives each phase's peak; `FlopCounterMode` the FLOPs of one forward, one
training forward + backward, one decode and one reward call, multiplied by the file's own closed-form NFE
(`planned_nfe`; MixGRPO's at iteration 0). Also: the reward models alone (resident and one 12-image forward,
bf16 towers against float32 as the papers' evaluation code runs them) and evaluate.py's evaluation of
FLUX.1-dev (modelled with `rundir.Run.evaluate`'s phases). Not modelled: communication time, the
allocator's fragmentation (keep ~10% headroom), CUDA context and kernels (~0.5-1 GiB), autocast (these runs
use none: LoRA and FSDP2 compute in bf16 directly, as the files do on GPUs).
"""
import argparse
import contextlib
import copy
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]
GIB = 2**30

# The README's and docs/scale.md's command lines: (name, script, arguments, GPUs); `--only` takes their indices.
LORA_1GPU = ("--prompts-per-iteration 1 --no-full-finetune --lora-rank 64 --lora-alpha 128 "
             "--learning-rate 1e-4 --eval-num 64")
QWEN = "--model qwen-image --guidance 4 --lora-rank 64 --lora-alpha 128 --max-sequence-length 256"
KLEIN9 = "--model flux2-klein-base-9b --guidance 4 --lora-rank 64 --lora-alpha 128"
WAN = ("--guidance 4.5 --num-steps 20 --eval-steps 50 --max-sequence-length 512 --rewards pickscore "
       "--frame-reduce mean --text-cache runs/text-cache/wan --eval-num 64 ")  # Flow-GRPO's Wan steps, guidance
# the README's shell variables of its newer families' commands (L, K, D, Z), less the data paths
README_L = "--lora-rank 64 --lora-alpha 128 --group-size 16"
README_K = ("--guidance 4 --resolution 384 --num-steps 8 --eval-steps 28 --prompts-per-iteration 48 "
            "--max-sequence-length 512 --beta 0 --lora-rank 64 --lora-alpha 128 --group-size 16")
README_D = ("--model flux2-dev --guidance 4 --num-steps 8 --eval-steps 28 --prompts-per-iteration 48 "
            "--max-sequence-length 512 --beta 0 --lora-rank 32 --lora-alpha 64 --micro-batch 1 --group-size 16 "
            "--text-cache /cache/flux2-dev")
README_Z = ("--model z-image --guidance 4 --prompts-per-iteration 48 --max-sequence-length 512 --beta 0 "
            "--lora-rank 64 --lora-alpha 128 --group-size 16")
# Qwen-Image-Edit-2511 at 512 px with one 512 px source: the Qwen2.5-VL embeddings hold the source's 196 image
# tokens, hence 512 tokens (the edit pipelines' default) for them and the prompt; the doubled image sequence
# (2 x 1024 tokens) makes the default micro-batch of 12 twice Qwen-Image's transient memory: 4 per forward
QWEN_EDIT = ("--model qwen-image-edit-2511 --guidance 4 --lora-rank 64 --lora-alpha 128 --max-sequence-length 512 "
             "--condition-size 512 --micro-batch 4")
COMMANDS = [
    ("Flow-GRPO, SD3.5-M, PickScore (LoRA)", "flow_grpo", "", 8),
    ("Flow-GRPO, FLUX.1-dev, PickScore (LoRA)", "flow_grpo", "--model flux-dev --num-steps 6 --eval-steps 28 "
     "--noise-level 0.9 --beta 0 --guidance 3.5 --lora-rank 64 --lora-alpha 128", 8),
    ("Flow-GRPO + CoCA, SD3.5-M, PickScore (LoRA)", "flow_grpo", "--credit coca", 8),
    ("DanceGRPO, FLUX.1-dev, HPS + CLIP (full FT)", "dancegrpo", "", 16),
    # the official 4 nodes x 8
    ("MixGRPO, FLUX.1-dev, HPS + ImageReward + PickScore (full FT)", "mixgrpo", "", 32),
    ("MixGRPO-Flash, FLUX.1-dev, HPS + ImageReward + PickScore (full FT)", "mixgrpo", "--flash", 32),
    ("G2RPO, FLUX.1-dev, HPS + CLIP, Lambda {1,2,3} (full FT)", "g2rpo", "--lambdas 1 2 3", 16),
    ("DenseGRPO, SD3.5-M, PickScore, n = t (LoRA)", "densegrpo", "", 8),
    ("DenseGRPO, SD3.5-M, n = 1 (LoRA)", "densegrpo", "--dense-ode-steps 1", 8),
    ("DiffusionNFT, SD3.5-M, PickScore (LoRA)", "diffusion_nft", "", 8),
    ("DiffusionNFT, FLUX.1-dev, PickScore (full FT)", "diffusion_nft", "--model flux-dev --guidance 3.5 "
     "--full-finetune --no-ema", 8),
    ("AWM, SD3.5-M, PickScore (LoRA)", "awm", "", 8),
    ("AWM, FLUX.1-dev, PickScore (LoRA)", "awm", "--model flux-dev --eval-steps 28 --guidance 3.5", 8),
    # the newer families (models.py), LoRA r64 as verl's Qwen-Image recipe; the first and third: the README's lines
    ("Flow-GRPO, Qwen-Image, OCR (LoRA, verl's recipe, 4 GPUs)", "flow_grpo", "--model qwen-image --guidance 4 "
     + README_L + " --rewards ocr --prompts-per-iteration 32 --max-sequence-length 256 --noise-level 1.2 --beta 0 "
     "--eval-steps 50", 4),
    ("DiffusionNFT, Qwen-Image, PickScore (LoRA)", "diffusion_nft", QWEN, 8),
    ("AWM, Qwen-Image, PickScore (LoRA)", "awm", QWEN, 8),
    ("Flow-GRPO, FLUX.2 [klein] base 9B, PickScore (LoRA)", "flow_grpo", KLEIN9, 8),
    ("DiffusionNFT, FLUX.2 [klein] base 9B, PickScore (LoRA)", "diffusion_nft", KLEIN9, 8),
    ("AWM, FLUX.2 [klein] base 9B, PickScore (LoRA)", "awm", KLEIN9, 8),
    # 16 GPUs: Qwen-Image's two CFG forwards (one per half, as its pipeline) keep each FSDP2 block gathered from
    # one half's backward to the other's when the gradient goes through both (docs/scale.md): 8 GPUs need 76.9-88.0
    ("Flow-GRPO, Qwen-Image, PickScore (full FT, 16 GPUs, micro-batch 6)", "flow_grpo", "--model qwen-image "
     "--guidance 4 --max-sequence-length 256 --full-finetune --no-ema --micro-batch 6", 16),
    # FLUX.2 [dev]'s 60 GiB of bf16 weights leave room for rank 32 and micro-batches of 2 (r64 and 12: 86 GiB)
    ("Flow-GRPO, FLUX.2 [dev], PickScore (LoRA r32, micro-batch 2, text cache)", "flow_grpo", "--model flux2-dev "
     "--guidance 4 --lora-rank 32 --lora-alpha 64 --micro-batch 2 --text-cache /cache/flux2-dev", 8),
    ("1 GPU: Flow-GRPO, SD3.5-M (LoRA)", "flow_grpo", "--prompts-per-iteration 2 --eval-num 64", 1),
    ("1 GPU: Flow-GRPO + CoCA, SD3.5-M (LoRA)", "flow_grpo", "--credit coca --prompts-per-iteration 2 "
     "--eval-num 64", 1),
    ("1 GPU: DenseGRPO, SD3.5-M (LoRA)", "densegrpo", "--prompts-per-iteration 1 --eval-num 64", 1),
    ("1 GPU: DanceGRPO, FLUX.1-dev (LoRA)", "dancegrpo", LORA_1GPU, 1),
    ("1 GPU: MixGRPO, FLUX.1-dev (LoRA)", "mixgrpo", LORA_1GPU, 1),
    ("1 GPU: G2RPO, FLUX.1-dev (LoRA)", "g2rpo", "--lambdas 1 2 3 " + LORA_1GPU, 1),
    ("1 GPU: DiffusionNFT, SD3.5-M (LoRA)", "diffusion_nft", "--prompts-per-iteration 2 --eval-num 64", 1),
    ("1 GPU: DiffusionNFT, FLUX.1-dev (LoRA)", "diffusion_nft", "--model flux-dev --guidance 3.5 --lora-rank 64 "
     "--lora-alpha 128 --prompts-per-iteration 1 --eval-num 64 --micro-batch 4", 1),
    ("1 GPU: AWM, SD3.5-M (LoRA)", "awm", "--prompts-per-iteration 1 --eval-num 64", 1),
    ("1 GPU (24 GB): Flow-GRPO, FLUX.2 [klein] base 4B (LoRA, text cache)", "flow_grpo", "--model "
     "flux2-klein-base-4b --guidance 4 --lora-rank 32 --lora-alpha 64 --prompts-per-iteration 1 --group-size 8 "
     "--micro-batch 4 --eval-num 64 --text-cache /cache/klein4b", 1),
    # the methods of 2026
    ("DGPO, SD3.5-M, PickScore (LoRA)", "dgpo", "", 4),  # the official 4 GPUs
    ("DGPO, FLUX.1-dev, PickScore (LoRA)", "dgpo", "--model flux-dev --guidance 3.5 --eval-steps 28", 4),
    ("Flow-DPPO, SD3.5-M, PickScore (LoRA)", "flow_dppo", "", 8),
    ("Flow-DPPO, FLUX.1-dev, PickScore (LoRA)", "flow_dppo", "--model flux-dev --guidance 3.5 --eval-steps 28", 8),
    ("Flow-GRPO + GRPO-Guard, SD3.5-M, PickScore (LoRA)", "flow_grpo", "--guard --clip-range 4e-6 "
     "--learning-rate 1e-4 --beta 0 --no-global-std --micro-batch 9", 8),
    ("1 GPU: DGPO, SD3.5-M (LoRA)", "dgpo", "--prompts-per-iteration 1 --eval-num 64", 1),
    ("1 GPU: Flow-DPPO, SD3.5-M (LoRA)", "flow_dppo", "--prompts-per-iteration 2 --eval-num 64", 1),
    # the README's other commands for the newer families, from the public recipes (docs/models.md#recipes)
    ("DiffusionNFT, Qwen-Image, OCR (LoRA, verl-omni's recipe, no CFG, 4 GPUs)", "diffusion_nft", "--model "
     "qwen-image --guidance 1 " + README_L + " --rewards ocr --prompts-per-iteration 24 --max-sequence-length 256 "
     "--nft-beta 0.1 --decay-type 2 --updates-per-iteration 2", 4),
    ("Flow-GRPO, FLUX.2 [klein] base 9B, PickScore (LoRA, Flow-Factory's recipe, 384 px)", "flow_grpo",
     "--model flux2-klein-base-9b " + README_K + " --noise-level 0.7", 8),
    ("DiffusionNFT, FLUX.2 [klein] base 4B, PickScore (LoRA, Flow-Factory's recipe, 384 px)", "diffusion_nft",
     "--model flux2-klein-base-4b " + README_K + " --nft-beta 0.1 --learning-rate 1e-4", 8),
    ("AWM, FLUX.2 [klein] base 4B, PickScore (LoRA, Flow-Factory's recipe, 384 px)", "awm", "--model "
     "flux2-klein-base-4b " + README_K + " --train-timesteps 4 --time-type discrete_wo_init --timestep-fraction 0.7 "
     "--ema-beta 0.1 --kl-ema-decay 0.9 --adv-clip 1 --no-global-std --updates-per-iteration 2", 8),
    ("Flow-GRPO, FLUX.2 [dev], CLIP + PickScore (LoRA r32, micro-batch 1, text cache, Flow-Factory's recipe)",
     "flow_grpo", README_D + " --noise-level 1.0 --rewards clip pickscore --reward-weights 1 0.5", 8),
    ("DiffusionNFT, FLUX.2 [dev], PickScore (LoRA r32, micro-batch 1, text cache, [klein]'s recipe)",
     "diffusion_nft", README_D + " --nft-beta 0.1 --learning-rate 1e-4", 8),
    ("AWM, FLUX.2 [dev], PickScore (LoRA r32, micro-batch 1, text cache, [klein]'s recipe)", "awm",
     README_D + " --ema-beta 0.1 --kl-ema-decay 0.9 --adv-clip 1 --no-global-std", 8),
    ("Flow-GRPO, Z-Image, PickScore (LoRA, Flow-Factory's recipe)", "flow_grpo", README_Z + " --noise-level 0.7",
     8),
    ("DiffusionNFT, Z-Image, PickScore (LoRA, Flow-Factory's recipe)", "diffusion_nft", README_Z
     + " --nft-beta 0.1", 8),
    ("AWM, Z-Image, PickScore (LoRA, [klein]'s recipe)", "awm", README_Z + " --ema-beta 0.1 --kl-ema-decay 0.9 "
     "--adv-clip 1 --no-global-std", 8),
    # online Diffusion-DPO and CRD (appended): SD3.5-M at the official settings, a 2026 family at a public recipe
    ("Online Diffusion-DPO, SD3.5-M, PickScore (LoRA)", "dpo", "", 8),  # Flow-GRPO's config/dpo.py pickscore_sd3
    # verl-omni's online DPO recipe (run_qwen_image_online_dpo_lora.sh): the policy samples, 35 steps at CFG 1
    ("Online Diffusion-DPO, Qwen-Image, OCR (LoRA, verl-omni's recipe)", "dpo", "--model qwen-image --guidance 1 "
     "--lora-rank 64 --lora-alpha 128 --group-size 16 --num-steps 35 --eval-steps 50 --prompts-per-iteration 32 "
     "--max-sequence-length 256 --rollout-model policy --rewards ocr", 4),
    ("CRD, SD3.5-M, OCR (LoRA)", "crd", "", 8),  # Flow-Factory's examples/crd/lora/sd3_5/default.yaml
    # Flow-Factory's FLUX.2 [klein] base recipes (8 steps, 384 px, G 16) with CRD's example
    ("CRD, FLUX.2 [klein] base 9B, OCR (LoRA)", "crd", "--model flux2-klein-base-9b --guidance 1 --kl-cfg 4 "
     "--lora-rank 64 --lora-alpha 128 --resolution 384 --num-steps 8 --eval-steps 28 --group-size 16 "
     "--micro-batch 16 --max-sequence-length 512", 8),
    # text-to-video (docs/video.md, appended): Wan at the recipes' sizes, the UMT5-XXL embeddings from --text-cache
    ("1 GPU: Flow-GRPO, Wan2.1-T2V-1.3B, 240x416 x 33 frames (LoRA, text cache)", "flow_grpo",
     WAN + "--model wan2.1-t2v-1.3b --resolution 240 --width 416 --num-frames 33 --group-size 8 "
     "--prompts-per-iteration 1 --micro-batch 4", 1),
    ("Flow-GRPO, Wan2.1-T2V-1.3B, 480x832 x 33 frames, PickScore per frame (LoRA)", "flow_grpo",
     WAN + "--model wan2.1-t2v-1.3b --resolution 480 --width 832 --num-frames 33 --group-size 4 "
     "--prompts-per-iteration 32 --micro-batch 4", 8),
    ("DanceGRPO, Wan2.2-TI2V-5B, 704x1280 x 9 frames, HPS of every 4th frame (LoRA)", "dancegrpo",
     WAN + "--model wan2.2-ti2v-5b --resolution 704 --width 1280 --num-frames 9 --fps 24 --num-steps 10 "
     "--group-size 8 --prompts-per-iteration 64 --micro-batch 4 --no-full-finetune --lora-rank 64 --lora-alpha 128 "
     "--rewards hps --frame-reduce stride:4", 8),
    # the CFG gradient through the conditional prediction only (--detach-uncond): 71.5 GiB with both
    ("Flow-GRPO, Wan2.1-T2V-14B, 480x832 x 33 frames, PickScore per frame (full FT, FSDP2, --detach-uncond)",
     "flow_grpo", WAN + "--model wan2.1-t2v-14b --resolution 480 --width 832 --num-frames 33 --group-size 4 "
     "--prompts-per-iteration 16 --micro-batch 1 --full-finetune --no-ema --detach-uncond", 8),
    # the README's Wan recipe lines (the paths aside)
    ("Flow-GRPO, Wan2.1-T2V-1.3B, 240x416 x 33 frames, OCR of every 4th frame (LoRA, Flow-GRPO's recipe)",
     "flow_grpo", "--model wan2.1-t2v-1.3b --text-cache runs/text-cache/wan --max-sequence-length 512 --rewards ocr "
     "--frame-reduce stride:4 --num-frames 33 --resolution 240 --width 416 --num-steps 20 --eval-steps 50 "
     "--guidance 4.5 --group-size 4 --prompts-per-iteration 32 --beta 0.004 --learning-rate 1e-4 "
     "--clip-range 1e-3 --no-global-std", 8),
    ("Flow-GRPO, Wan2.1-T2V-14B, 256 px x 5 frames, CLIP + PickScore per frame (LoRA, Flow-Factory's recipe)",
     "flow_grpo", "--model wan2.1-t2v-14b --text-cache runs/text-cache/wan --max-sequence-length 512 "
     "--num-frames 5 --resolution 256 --num-steps 10 --eval-steps 28 --guidance 5 --group-size 16 "
     "--prompts-per-iteration 48 --noise-level 0.9 --beta 0 --learning-rate 1e-4 --lora-rank 64 --lora-alpha 128 "
     "--rewards clip pickscore --reward-weights 1 0.5 --frame-reduce mean", 8),
    ("DiffusionNFT, Wan2.1-T2V-1.3B, 480x832 x 1 frame, PickScore (LoRA, Flow-Factory's recipe)", "diffusion_nft",
     "--model wan2.1-t2v-1.3b --text-cache runs/text-cache/wan --max-sequence-length 512 --num-frames 1 "
     "--resolution 480 --width 832 --num-steps 12 --eval-steps 20 --guidance 5 --group-size 16 "
     "--prompts-per-iteration 48 --nft-beta 0.1 --learning-rate 1e-4 --lora-rank 128 --lora-alpha 128 "
     "--rewards pickscore", 8),
    ("DanceGRPO, Wan2.1-T2V-1.3B, 512 px x 1 frame, HPS (DanceGRPO's recipe)", "dancegrpo",
     "--model wan2.1-t2v-1.3b --text-cache runs/text-cache/wan --max-sequence-length 512 --num-frames 1 "
     "--resolution 512 --num-steps 20 --noise-level 0.3 --shift 3 --group-size 12 --timestep-fraction 0.6 "
     "--guidance 5 --learning-rate 1e-5 --rewards hps --frame-reduce first", 8),
    ("DanceGRPO, Wan2.2-TI2V-5B, 704x1280 x 9 frames, HPS of every 4th frame (verl-omni's recipe)", "dancegrpo",
     "--model wan2.2-ti2v-5b --text-cache runs/text-cache/wan --max-sequence-length 512 --num-frames 9 --fps 24 "
     "--resolution 704 --width 1280 --num-steps 10 --eval-steps 50 --guidance 5 --group-size 8 "
     "--prompts-per-iteration 64 --learning-rate 1e-5 --rewards hps --frame-reduce stride:4", 8),
    ("AWM, Wan2.1-T2V-1.3B, 480x832 x 33 frames, VideoAlign VQ + MQ (ours)", "awm",
     "--model wan2.1-t2v-1.3b --num-frames 33 --resolution 480 --width 832 --guidance 5 "
     "--rewards videoalign_vq videoalign_mq --reward-combine advantages --videoalign-url http://127.0.0.1:18087 "
     "--text-cache runs/text-cache/wan --max-sequence-length 512 --micro-batch 4", 8),  # at 12: 77.7 GiB
    # editing (appended): one source at the target's 512 px, its tokens after the target's in every forward
    ("Flow-GRPO, FLUX.1 Kontext [dev], image similarity + GenEval, 512 px source (the README's line)", "flow_grpo",
     "--model flux-kontext-dev --resolution 512 --condition-size 512 --num-steps 6 --eval-steps 28 --guidance 2.5 "
     "--group-size 21 --prompts-per-iteration 48 --noise-level 0.9 --beta 0 --rewards image_similarity geneval "
     "--reward-weights 0.5 0.5", 8),
    ("1 GPU (24 GB): Flow-GRPO, FLUX.2 [klein] base 4B, editing, 512 px reference (LoRA, text cache)", "flow_grpo",
     "--model flux2-klein-base-4b --guidance 4 --lora-rank 32 --lora-alpha 64 --prompts-per-iteration 1 "
     "--group-size 8 --micro-batch 4 --eval-num 64 --text-cache /cache/klein4b-edit --condition-size 512", 1),
    ("Flow-GRPO, Qwen-Image-Edit-2511, PickScore, 512 px source (LoRA, micro-batch 4)", "flow_grpo", QWEN_EDIT, 8),
    ("DiffusionNFT, Qwen-Image-Edit-2511, PickScore, 512 px source (LoRA, micro-batch 4)", "diffusion_nft", QWEN_EDIT, 8),
    ("AWM, Qwen-Image-Edit-2511, PickScore, 512 px source (LoRA, micro-batch 4)", "awm", QWEN_EDIT, 8),
]
# evaluate.py's evaluation of FLUX.1-dev, modelled with rundir.Run.evaluate's phases
EVALUATE = dict(name="evaluate.py, FLUX.1-dev, 720 px, 50 steps, 400 prompts, 8 GPUs", kind="flux",
                resolution=720, steps=50, prompts=400, world=8, chunk=16, micro_batch=4, decode_batch=4,
                max_sequence_length=512, guidance=3.5, rewards=("hps", "clip", "pickscore", "imagereward"))
# ... and at its defaults, G2RPO's and MixGRPO's evaluation protocol (1024 px)
EVALUATIONS = [EVALUATE, {**EVALUATE, "name": "evaluate.py, FLUX.1-dev, 1024 px, 50 steps, 400 prompts, 8 GPUs",
                          "resolution": 1024}]
REWARD_TABLE = ("hps", "clip", "pickscore", "imagereward", "aesthetic")  # the reward models' own table
REWARD_BATCH = 12
PEAK_TFLOPS = {"A100": 312, "H100": 989}  # dense bf16 tensor-core peaks (SXM)
CARD_BYTES = 85.5e9  # what torch.cuda reports as an 80 GB card's total memory (H100 SXM)


def fits_gathered(transformer) -> bool:
    """common.fits_gathered on an 80 GB card: a rollout keeps a sharded model gathered only if its bf16 weights
    take at most common.GATHER_SHARE of the card (FLUX.1-dev's do, Qwen-Image's do not)."""
    import common

    return 2 * sum(p.numel() for p in transformer.parameters()) <= common.GATHER_SHARE * CARD_BYTES
MFU = 0.4
# the phases of the main table, in order
PHASES = ("encode", "rollout", "decode", "rewards", "training step", "optimizer step", "evaluation encode",
          "evaluation")


# -------------------------------------------------------- architectures (the released checkpoints' configs)
# --model alias -> the architecture that architectures() builds (the family is models.FAMILIES' by its aliases)
ARCHITECTURE = {"sd3.5-medium": "sd3", "flux-dev": "flux", "qwen-image": "qwen-image", "flux2-dev": "flux2-dev",
                "flux2-klein-base-4b": "klein-4b", "flux2-klein-4b": "klein-4b",
                "flux2-klein-base-9b": "klein-9b", "flux2-klein-9b": "klein-9b",
                "z-image": "z-image", "z-image-turbo": "z-image", "wan2.1-t2v-1.3b": "wan-1.3b",
                "wan2.1-t2v-14b": "wan-14b", "wan2.2-ti2v-5b": "wan-5b",
                # the editing models: FLUX.1 Kontext [dev] is a FLUX.1 [dev] transformer (12B) with its T5 / CLIP and
                # VAE; Qwen-Image-Edit (2508, 2509, 2511) the Qwen-Image 20B transformer (2511: zero_cond_t, the
                # sources' tokens modulated at t = 0) with Qwen2.5-VL-7B and its vision tower, Qwen-Image's VAE
                "flux-kontext-dev": "kontext", "qwen-image-edit": "qwen-image-edit",
                "qwen-image-edit-2509": "qwen-image-edit", "qwen-image-edit-2511": "qwen-image-edit-2511"}
TOY_ALIASES = ("toy", "toy-video", "toy-edit")  # common.MODEL_ALIASES' toy worlds: no released architecture
# the pipeline an editing alias loads where its family has several (models.FAMILIES "pipelines": the first)
EDIT_PIPELINE = {"qwen-image-edit": "QwenImageEditPipeline"}
DISTILLED = ("flux2-klein-4b", "flux2-klein-9b")  # Flux2KleinPipeline(is_distilled=True): no CFG, no guidance
# published parameters (../shared/reference/models_2026.md; Qwen3-8B's model card: 8.2B, the reference's 7.6B
# leaves out its untied head): transformer, text encoders, VAE
PUBLISHED = {"qwen-image": (20.4e9, 8.3e9, 0.13e9), "flux2-dev": (32.2e9, 23.3e9, 0.08e9),
             "klein-4b": (3.9e9, 4.0e9, 0.08e9), "klein-9b": (9e9, 8.2e9, 0.08e9), "z-image": (6.15e9, 4.0e9, 0.08e9),
             # FLUX.1 Kontext [dev]'s model card: a 12B transformer; T5-XXL's encoder (4.76B) and CLIP-L's text
             # tower (0.12B); FLUX.1's 84M autoencoder. Qwen-Image-Edit's model card: "built upon our 20B
             # Qwen-Image model", the same Qwen2.5-VL-7B (8.3B with its vision tower) and VAE
             "kontext": (12e9, 4.88e9, 0.084e9), "qwen-image-edit": (20.4e9, 8.3e9, 0.13e9),
             "qwen-image-edit-2511": (20.4e9, 8.3e9, 0.13e9)}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def model_architecture(model: str) -> tuple:
    """(models.FAMILIES key, architecture) of a --model alias; the estimate builds released configs only."""
    from models import FAMILIES

    family = next((k for k, f in FAMILIES.items() if model in f["aliases"]), None)
    if family is None or model not in ARCHITECTURE:
        raise SystemExit(f"error: the estimator builds the released architectures of {sorted(ARCHITECTURE)}; "
                         f"--model {model!r} is none of them")
    return family, ARCHITECTURE[model]


def _bos_eos(**kw):  # token ids of toy/tiny.py's word tokenizers (pad 0, bos 1, eos 3) for random models
    return dict(pad_token_id=0, bos_token_id=1, eos_token_id=3, **kw)


def _tiny(arch: str):
    """(transformer, [text encoders], vae) constructors of toy/tiny.py's / toy/tiny_families.py's pipelines."""
    import tiny as toy_tiny
    import tiny_families
    import tiny_video

    if arch.startswith("wan"):  # toy/tiny_video.py's two layouts
        pipe = tiny_video.build_wan(version="2.2" if arch == "wan-5b" else "2.1")
        return (functools.partial(type(pipe.transformer).from_config, pipe.transformer.config),
                [functools.partial(type(pipe.text_encoder), copy.deepcopy(pipe.text_encoder.config))],
                functools.partial(type(pipe.vae).from_config, pipe.vae.config))
    pipe = {"flux": toy_tiny.build_flux, "sd3": toy_tiny.build_sd3, "qwen-image": tiny_families.build_qwenimage,
            "kontext": toy_tiny.build_flux_kontext, "qwen-image-edit": tiny_families.build_qwenimage_edit_plus,
            "qwen-image-edit-2511": functools.partial(tiny_families.build_qwenimage_edit_plus, zero_cond_t=True),
            "flux2-dev": tiny_families.build_flux2, "klein-4b": tiny_families.build_flux2_klein,
            "klein-9b": tiny_families.build_flux2_klein, "z-image": tiny_families.build_zimage}[arch]()
    texts = [getattr(pipe, n) for n in TEXT_ENCODERS if getattr(pipe, n, None) is not None]
    configs = [copy.deepcopy(m.config) for m in texts]
    # 2 text layers: the tiny FLUX.2 pipelines' 28-31 (read by index) add fake-tensor time and no code path
    for c in configs if arch not in ("flux", "sd3", "kontext") else []:
        c = getattr(c, "text_config", c)
        c.num_hidden_layers = 2
        if getattr(c, "layer_types", None):
            c.layer_types = c.layer_types[:2]
    return (functools.partial(type(pipe.transformer).from_config, pipe.transformer.config),
            [functools.partial(type(m), c) for m, c in zip(texts, configs)],
            functools.partial(type(pipe.vae).from_config, pipe.vae.config))


def _qwen3(**kw):
    """Qwen3-4B's / Qwen3-8B's config.json (Qwen/Qwen3-4B, Qwen/Qwen3-8B; FLUX.2 [klein] and Z-Image ship them
    as text_encoder/config.json): 36 layers, 32 query and 8 key-value heads of 128, vocabulary 151,936."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, **kw)


def architectures(arch: str, *, tiny: bool):
    """(transformer, [text encoders], vae) constructors of a released model, or of toy/tiny.py's /
    toy/tiny_families.py's tiny pipelines. FLUX.1-dev / SD3.5-M: FluxPipeline's CLIP-L and T5-XXL; SD3's CLIP-L
    and CLIP-G with projections and T5-XXL. The newer families' text encoders are the classes their pipelines
    hold (a vision-language model whole, as it visits the GPU; only its language model runs on text)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config
    from transformers import T5EncoderModel

    if tiny:
        return _tiny(arch)
    vae = functools.partial(
        AutoencoderKL, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, use_quant_conv=False,
        use_post_quant_conv=False, scaling_factor=1.5305 if arch == "sd3" else 0.3611,
        shift_factor=0.0609 if arch == "sd3" else 0.1159)  # Z-Image ships FLUX.1's autoencoder
    if arch.startswith("qwen-image") or arch in ("flux2-dev", "klein-4b", "klein-9b", "z-image"):
        return _newer_families(arch, vae)
    if arch.startswith("wan"):
        return _wan(arch)
    t5 = functools.partial(T5EncoderModel, T5Config(
        vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0, **_bos_eos()))
    clip_l = CLIPTextConfig(**_bos_eos(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, projection_dim=768))
    clip_g = CLIPTextConfig(**_bos_eos(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                       num_attention_heads=20, projection_dim=1280, hidden_act="gelu"))
    if arch in ("flux", "kontext"):  # FLUX.1 Kontext [dev]: FLUX.1 [dev]'s transformer config
        transformer = functools.partial(
            FluxTransformer2DModel, in_channels=64, num_layers=19, num_single_layers=38,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
        return transformer, [functools.partial(CLIPTextModel, clip_l), t5], vae
    transformer = functools.partial(
        SD3Transformer2DModel, sample_size=128, patch_size=2, in_channels=16, num_layers=24,
        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
    texts = [functools.partial(CLIPTextModelWithProjection, c) for c in (clip_l, clip_g)]
    return transformer, texts + [t5], vae


def _newer_families(arch: str, flux_vae):
    """Qwen-Image, FLUX.2 [dev] / [klein] 4B / 9B (base and distilled share theirs), Z-Image(-Turbo)."""
    from diffusers import AutoencoderKLFlux2, AutoencoderKLQwenImage, Flux2Transformer2DModel
    from diffusers import QwenImageTransformer2DModel, ZImageTransformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen2_5_VLConfig
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM, Qwen3Model

    if arch.startswith("qwen-image"):
        # Qwen/Qwen-Image's transformer/config.json and vae/config.json (as public loaders and tests quote them;
        # diffusers' QwenImageTransformer2DModel and AutoencoderKLQwenImage defaults are the same values)
        transformer = functools.partial(
            QwenImageTransformer2DModel, patch_size=2, in_channels=64, out_channels=16, num_layers=60,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
            axes_dims_rope=(16, 56, 56), zero_cond_t=arch == "qwen-image-edit-2511")  # 2511's config.json
        vae = functools.partial(AutoencoderKLQwenImage, base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4],
                                num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
        # Qwen/Qwen2.5-VL-7B-Instruct's config.json: the 28-layer language model (3584 wide, 28 query / 4 key-value
        # heads, untied head) and the 32-block ViT (1280 wide) merged into 3584
        text = Qwen2_5_VLConfig(
            text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                             rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                               out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                               window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
            tie_word_embeddings=False)
        return transformer, [functools.partial(Qwen2_5_VLForConditionalGeneration, text)], vae
    if arch.startswith(("flux2", "klein")):
        # diffusers' scripts/convert_flux2_to_diffusers.py, get_flux2_transformer_config ("flux2-dev", "klein-4b",
        # "klein-9b"); the VAE: AutoencoderKLFlux2's defaults are black-forest-labs/FLUX.2-dev's vae/config.json
        layers, singles, heads, text_dim = {"flux2-dev": (8, 48, 48, 15360), "klein-4b": (5, 20, 24, 7680),
                                            "klein-9b": (8, 24, 32, 12288)}[arch]
        transformer = functools.partial(
            Flux2Transformer2DModel, patch_size=1, in_channels=128, num_layers=layers, num_single_layers=singles,
            attention_head_dim=128, num_attention_heads=heads, joint_attention_dim=text_dim,
            timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
            guidance_embeds=arch == "flux2-dev")
        vae = functools.partial(AutoencoderKLFlux2, block_out_channels=(128, 256, 512, 512), latent_channels=32,
                                layers_per_block=2, patch_size=(2, 2), batch_norm_eps=1e-4)
        if arch == "flux2-dev":
            # mistralai/Mistral-Small-3.1-24B-Instruct-2503 (transformers' Mistral3Config defaults are its values:
            # 40 layers of 5120, 32 query / 8 key-value heads, the 24-layer Pixtral tower; the head tied to the
            # embeddings as transformers 5 builds it: 23.3B, the reference's count)
            text = Mistral3Config(
                text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                                 num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=131072),
                vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                                   num_hidden_layers=24, num_attention_heads=16, head_dim=64, patch_size=14,
                                   image_size=1540),
                spatial_merge_size=2, multimodal_projector_bias=False)
            return transformer, [functools.partial(Mistral3ForConditionalGeneration, text)], vae
        # Qwen3-4B (tied head) / Qwen3-8B (untied head, 0.62B of the 8.2B) as Qwen3ForCausalLM
        size = dict(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True) if arch == "klein-4b" \
            else dict(hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
        return transformer, [functools.partial(Qwen3ForCausalLM, _qwen3(**size))], vae
    # Tongyi-MAI/Z-Image(-Turbo)'s transformer/config.json (as public loaders quote it; diffusers' defaults but
    # axes_lens); the text encoder Qwen3-4B as a Qwen3Model (no head), the VAE FLUX.1's
    transformer = functools.partial(
        ZImageTransformer2DModel, all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840,
        n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
    text = _qwen3(hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
    return transformer, [functools.partial(Qwen3Model, text)], flux_vae


def _wan(arch: str):
    """Wan2.1-T2V-1.3B / -14B and Wan2.2-TI2V-5B (Wan-AI's configs, as the official repository's
    wan/configs/wan_t2v_1_3B.py, wan_t2v_14B.py, wan_ti2v_5B.py state them: dim, ffn_dim, heads of 128, layers;
    the Diffusers checkpoints' transformer/config.json carry the same values): WanTransformer3DModel, the
    UMT5-XXL encoder (google/umt5-xxl: 24 layers of 4096, 64 heads, gated GELU, vocabulary 256,384) and
    AutoencoderKLWan (Wan2.1: base 96, z 16, 8x in space; Wan2.2: base 160, decoder 256, z 48, residual, 2x2
    patches, 16x in space; both 4x in time)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    heads, ffn, layers, channels = {"wan-1.3b": (12, 8960, 30, 16), "wan-14b": (40, 13824, 40, 16),
                                    "wan-5b": (24, 14336, 30, 48)}[arch]
    transformer = functools.partial(
        WanTransformer3DModel, patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128,
        in_channels=channels, out_channels=channels, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    text = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                      feed_forward_proj="gated-gelu", decoder_start_token_id=0, **_bos_eos())
    if arch == "wan-5b":
        vae = functools.partial(AutoencoderKLWan, base_dim=160, decoder_base_dim=256, z_dim=48,
                                dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True],
                                is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                                scale_factor_spatial=16, scale_factor_temporal=4,
                                latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    else:
        vae = functools.partial(AutoencoderKLWan, base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                temperal_downsample=[False, True, True])
    return transformer, [functools.partial(UMT5EncoderModel, text)], vae


def parameter_counts(arch: str, *, tiny: bool = False) -> tuple:
    """(transformer, text encoders, VAE) parameters of architectures(arch), built on the meta device."""
    make_t, texts, make_vae = architectures(arch, tiny=tiny)
    with torch.device("meta"):
        return tuple(sum(sum(p.numel() for p in m.parameters()) for m in ms)
                     for ms in ([make_t()], [c() for c in texts], [make_vae()]))


def scheduler_config(kind: str) -> dict:
    """The released schedulers' configs (FlowMatchEulerDiscreteScheduler): FLUX.1-dev shifts dynamically."""
    if kind == "flux":
        return dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                    base_image_seq_len=256, max_image_seq_len=4096)
    return dict(shift=3.0)


OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
IMAGEREWARD_HEAD = (1024, 128, 64, 16, 1)  # the MLP after BERT's [CLS] feature (768 -> ... -> 1)


def reward_spec(name: str, *, tiny: bool):
    """The architecture of a learned reward model (None for jpeg and the toy world's): family, configs, input
    size. hps: open_clip ViT-H-14 at 224 (HPS-v2.1); clip: ViT-H-14 at 384 (DFN5B, quick GELU); pickscore:
    transformers CLIP-H/14; imagereward: BLIP ViT-L/16 at 224 (24 x 1024, 16 heads) and BERT-base with
    cross-attention (768, 12 layers, encoder width 1024), MLP head; aesthetic: openai CLIP ViT-L/14
    (24 x 1024, patch 14, 224 px, projection 768), MLP head; image_similarity: the same CLIP ViT-L/14 image
    tower and projection (rewards.image_similarity_reward: openai/clip-vit-large-patch14), no head."""
    if name not in (*REWARD_TABLE, "image_similarity"):
        return None
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)  # tiny
    if name in ("hps", "clip"):
        if tiny:
            config = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32,
                                                      "patch_size": 8, "head_width": 16},
                      "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2,
                                   "layers": 1}}
        else:
            import open_clip

            config = copy.deepcopy(open_clip.get_model_config("ViT-H-14"))
            if name == "clip":
                config["vision_cfg"]["image_size"], config["quick_gelu"] = 384, True
        return {"family": "open_clip", "config": config, "size": config["vision_cfg"]["image_size"],
                "pad_square": name == "hps", "text_length": 77}
    if name == "pickscore":
        text = small if tiny else dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                       num_attention_heads=16, hidden_act="gelu")
        vision = dict(small, patch_size=8, image_size=32) if tiny else dict(
            hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
            patch_size=14, image_size=224, hidden_act="gelu")
        return {"family": "clip", "text": _bos_eos(**text), "vision": vision, "size": vision["image_size"],
                "projection_dim": 16 if tiny else 1024, "text_length": 77}
    if name in ("aesthetic", "image_similarity"):
        text = small if tiny else dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12)
        vision = dict(small, patch_size=8, image_size=32) if tiny else dict(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
            patch_size=14, image_size=224)
        return {"family": "clip_vision", "text": _bos_eos(**text), "vision": vision,
                "size": vision["image_size"], "projection_dim": 16 if tiny else 768,
                "head": IMAGEREWARD_HEAD if name == "aesthetic" else None, "text_length": 77}
    if tiny:
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, patch_size=16,
                      image_size=32)
        med = dict(small, vocab_size=64, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=62,
                   sep_token_id=3)
    else:
        vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, patch_size=16,
                      image_size=224)
        med = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=512)
    vision.update(num_attention_heads=vision["hidden_size"] // 64, hidden_act="gelu", layer_norm_eps=1e-6)
    med.update(hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0, encoder_width=vision["hidden_size"])
    return {"family": "blip", "vision": vision, "med": med, "head": IMAGEREWARD_HEAD,
            "size": vision["image_size"], "text_length": 35}


class RewardTowers(torch.nn.Module):
    """A reward model as rewards.py holds it on the GPU: the towers in `dtype`, every projection, scale and
    head in float32; forward(images in [0, 1], token ids) follows its score() (preprocessing included)."""

    def __init__(self, spec: dict, dtype):
        super().__init__()
        self.spec, self.dtype, self.family = spec, dtype, spec["family"]
        if self.family == "open_clip":
            import open_clip

            model = open_clip.CLIP(**spec["config"])
            self.heads = torch.nn.ParameterList()  # rewards.float32_head: the projections out, in float32
            for owner, attr in ((model.visual, "proj"), (model, "text_projection")):
                weight = getattr(owner, attr).detach().float()
                self.heads.append(torch.nn.Parameter(weight, requires_grad=False))
                setattr(owner, attr, None)
            self.towers = model.to(dtype)
        elif self.family in ("clip", "clip_vision"):
            from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel

            if self.family == "clip":
                model = CLIPModel(CLIPConfig(text_config=spec["text"], vision_config=spec["vision"],
                                             projection_dim=spec["projection_dim"]))
                self.towers = torch.nn.ModuleList([model.vision_model.to(dtype), model.text_model.to(dtype)])
                self.heads = torch.nn.ModuleList([model.visual_projection, model.text_projection])
                self.scale = torch.nn.Parameter(model.logit_scale.detach().float(), requires_grad=False)
            else:  # rewards.aesthetic_reward moves only the vision tower and its projection to the GPU
                vision = CLIPVisionModel(CLIPVisionConfig(**spec["vision"]))
                vision = getattr(vision, "vision_model", vision)  # transformers < 5 wraps the transformer
                self.towers = torch.nn.ModuleList([vision.to(dtype)])
                self.heads = torch.nn.ModuleList([
                    torch.nn.Linear(spec["vision"]["hidden_size"], spec["projection_dim"], bias=False),
                    *([self.mlp(spec["projection_dim"], spec["head"])] if spec["head"] else [])])
        else:
            from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

            med = {k: v for k, v in spec["med"].items() if k != "encoder_width"}
            vision = BlipVisionModel(BlipVisionConfig(**spec["vision"]))
            text = BlipTextModel(BlipTextConfig(**med, encoder_hidden_size=spec["med"]["encoder_width"],
                                                is_decoder=True), add_pooling_layer=False)
            self.towers = torch.nn.ModuleList([vision.to(dtype), text.to(dtype)])
            self.heads = torch.nn.ModuleList([self.mlp(med["hidden_size"], spec["head"])])
        self.requires_grad_(False).eval()

    @staticmethod
    def mlp(width: int, sizes) -> torch.nn.Sequential:
        dims = (width, *sizes)
        return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])])

    def forward(self, images, ids):
        import rewards

        normalize = torch.nn.functional.normalize
        s = self.spec
        x = rewards._clip_preprocess(images, s["size"], OPENAI_MEAN, OPENAI_STD,
                                     pad_square=s.get("pad_square", False))
        x = x.to(self.dtype)
        if self.family == "open_clip":
            img = normalize(self.towers.encode_image(x).float() @ self.heads[0], dim=-1)
            txt = normalize(self.towers.encode_text(ids).float() @ self.heads[1], dim=-1)
            return (img * txt).sum(-1)
        if self.family == "clip":
            vision, text = self.towers
            img = normalize(self.heads[0](vision(pixel_values=x).pooler_output.float()), dim=-1)
            txt = text(input_ids=ids, attention_mask=ids > 0).pooler_output.float()
            txt = normalize(self.heads[1](txt), dim=-1)
            return self.scale.exp() * (img * txt).sum(-1) / 26
        if self.family == "clip_vision":
            embedding = normalize(self.heads[0](self.towers[0](pixel_values=x).pooler_output.float()), dim=-1)
            if len(self.heads) == 1:  # image_similarity: the cosine with the source's features (one per prompt,
                return (embedding * embedding[:1]).sum(-1)  # its group's; here the first image's)
            return self.heads[1](embedding).squeeze(-1)
        vision, text = self.towers
        image_tokens = vision(pixel_values=x).last_hidden_state
        cls = text(input_ids=ids, attention_mask=torch.ones_like(ids), encoder_hidden_states=image_tokens,
                   is_decoder=False).last_hidden_state[:, 0]
        return self.heads[0](cls.float()).squeeze(-1)


def reward_model(name: str, *, tiny: bool, dtype=torch.bfloat16):
    """A constructor of the reward's RewardTowers (towers in `dtype`, heads in float32), or None."""
    spec = reward_spec(name, tiny=tiny)
    return None if spec is None else functools.partial(RewardTowers, spec, dtype)


# ---------------------------------------------------------------- fake-tensor plumbing
class Sigmas(list):
    """A schedule for fake-tensor runs: Python floats for one index (the SDE's coefficients), a tensor for a
    list of indices (ode_complete); indexing a real tensor under FakeTensorMode would give a fake one."""

    def __getitem__(self, i):
        if isinstance(i, list):
            return torch.tensor([list.__getitem__(self, j) for j in i])
        return list.__getitem__(self, i)


def nbytes(*objs) -> int:
    """Bytes of the distinct storages behind modules' parameters and buffers, optimizers' states, tensors."""
    seen, total = set(), 0
    for o in objs:
        if isinstance(o, torch.nn.Module):
            ts = [*o.parameters(), *o.buffers()]
        elif isinstance(o, torch.optim.Optimizer):
            ts = [v for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
        else:
            ts = [o]
        for t in ts:
            t = t._local_tensor if hasattr(t, "_local_tensor") else t
            key = t.untyped_storage()._cdata  # the storage itself: views and tied weights count once
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def _tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        """MemTracker's totals only: every live tensor given to track_external plus every storage the ops
        create (new gradients included), without its per-module bookkeeping (which assumes modules called
        once)."""

        def _pre_fw_hook(self, *a):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

    return Tracker()


def measure(fn, live, *, flops=True):
    """(peak bytes with `live` tensors / modules resident, FLOPs or None) of fn()."""
    from torch.utils.flop_counter import FlopCounterMode

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # open_clip's nn.MultiheadAttention: fused, not counted
    try:
        tracker = _tracker()
        tracker.track_external(*live)
        with tracker:
            fn()
        peak = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        if not flops:
            return peak, None
        with FlopCounterMode(display=False) as counter:  # a pass of its own: it keeps tensors alive longer
            fn()
        return peak, counter.get_total_flops()
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


class Builder:
    """Modules built on the meta device (peft and .to() cannot handle fake parameters), then given fake CPU
    tensors of the same shapes and dtypes."""

    def __init__(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    def __call__(self, make, dtype=torch.float32, prepare=None):
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                module = make()
                if prepare is not None:
                    module = prepare(module)
        finally:
            torch.set_default_dtype(torch.float32)
        memo = {}
        with self.fake:
            for m in module.modules():
                for is_param, store in ((True, m._parameters), (False, m._buffers)):
                    for k, t in list(store.items()):
                        if t is not None:
                            if id(t) not in memo:  # tied weights stay tied
                                f = self.fake.from_tensor(t).to("cpu")
                                if is_param:
                                    f = torch.nn.Parameter(f, requires_grad=t.requires_grad)
                                memo[id(t)] = f
                            store[k] = memo[id(t)]
        return module


@contextlib.contextmanager
def patched(owner, name: str, value):
    """owner.<name> = value for the duration; a class attribute it only inherited is deleted afterwards."""
    own = vars(owner) if isinstance(owner, type) else None
    had = own is None or name in own
    old = (own[name] if own is not None else getattr(owner, name)) if had else None
    setattr(owner, name, value)
    try:
        yield value
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def patched_entry(table: dict, key, value):
    """table[key] = value for the duration (a family's function in models.FAMILIES)."""
    old = table[key]
    table[key] = value
    try:
        yield value
    finally:
        table[key] = old


# Text masks under fake tensors: counting a row's tokens (int(mask.sum())) needs data, so every prompt counts
# as max_sequence_length tokens long, an upper bound (real prompts are cut to the longest of their batch).
def full_trim(emb: dict, prefix: str = ""):
    """models.trim without data: the padded embeddings whole and no mask (Qwen-Image)."""
    return emb[prefix + "embeds"], None


class FullRow(int):
    """A text mask's row whose sum() is the padded length (Z-Image's captions cut to int(mask.sum()))."""

    def sum(self, *args, **kwargs):
        return self


def full_rows(velocity):
    """A family's velocity with each text mask's rows counted full."""
    @functools.wraps(velocity)
    def run(transformer, x, t, emb, *, guidance, detach_uncond):
        rows = {k: [FullRow(v.shape[-1])] * len(v) for k, v in emb.items() if k.endswith("mask")}
        return velocity(transformer, x, t, {**emb, **rows}, guidance=guidance, detach_uncond=detach_uncond)
    return run


def fake_process_group(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    hook = sys.excepthook  # each init wraps it once more ("[rank0]: [rank0]: ..." on every traceback line)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    sys.excepthook = hook


def reward_forward(models: dict, images, n_text: int = 0):
    """Every reward of `models` ({name: RewardTowers}) on `images` and as many prompts (token ids)."""
    for m in models.values():
        m(images, torch.ones(n_text or len(images), m.spec["text_length"], dtype=torch.long))


def text_forward(texts, ids):
    """The text encoders on token ids as the pipelines call them: CLIP on its first max_position_embeddings
    tokens, T5 on all; the newer families' language models with every hidden state kept
    (output_hidden_states=True), their causal LMs' logits too, FLUX.2's without a KV cache."""
    with torch.no_grad():
        for m in texts:
            name = type(m).__name__
            if "CLIP" in name:
                m(input_ids=ids[:, :m.config.max_position_embeddings])
            elif "T5" in name:
                m(input_ids=ids)
            else:
                flux2 = name in ("Mistral3ForConditionalGeneration", "Qwen3ForCausalLM")
                m(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                  **({"use_cache": False} if flux2 else {}))


# ---------------------------------------------------------------- editing: the sources' condition
EDIT_SOURCES = 1  # source images per editing prompt (one reference, at the target's size)
VL_FACTOR = {"patch": 14, "merge": 2}  # Qwen2.5-VL: 14-pixel patches, merged 2 x 2 into one token


def editing(kind: str, args) -> bool:
    """Whether a row edits: FLUX.1 Kontext and Qwen-Image-Edit always (their encodes want sources); FLUX.2,
    which generates from text too, where the command passes --condition-size (its reference's size)."""
    import models

    return bool(models.FAMILIES[kind].get("editing")) and (kind != "flux2" or args.condition_size is not None)


def edit_condition(kind: str, pipe, args, *, tiny: bool) -> dict:
    """The condition an editing prompt's embeddings carry, sized as the family's encode sizes it (real tensors,
    no weights: the families' own resizes run on a black uint8 source of the target's size): the VAE's input
    per source ("pixels", shapes), the packed tokens ("tokens", "channels"), the position ids or latent sizes
    every row shares ("ids" under "ids_key": what models.shared_ids returns), and for Qwen-Image-Edit the
    image tokens its Qwen2.5-VL encoder reads per prompt ("vl_tokens", "vl_patches")."""
    import models
    from diffusers.image_processor import VaeImageProcessor

    h, w = args.resolution, args.width or args.resolution
    source = torch.zeros(3, h, w, dtype=torch.uint8)
    f = pipe.vae_scale_factor
    out = {"vl_tokens": 0, "vl_patches": 0}
    if kind == "kontext":  # models.kontext_encode: the preferred resolution or --condition-size, then the VAE
        from diffusers import FluxKontextPipeline
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
        ch, cw = models.condition_hw(h // (2 * f) * 2 * f, w // (2 * f) * 2 * f, size=args.condition_size,
                                     multiple=2 * f, preferred=PREFERRED_KONTEXT_RESOLUTIONS)
        ids = FluxKontextPipeline._prepare_latent_image_ids(1, ch // f // 2, cw // f // 2, "cpu", torch.bfloat16)
        ids[..., 0] = 1
        channels = pipe.transformer.config.in_channels
        out.update(pixels=[(1, 3, ch, cw)], ids=ids, ids_key="cond_ids")
    elif kind == "qwenimage_edit":  # models.qwen_edit_sources: the VL encoder's resize and the VAE's
        pipe.image_processor, pipe.condition_size = VaeImageProcessor(vae_scale_factor=2 * f), args.condition_size
        seen, pixels = models.qwen_edit_sources(pipe, [source] * EDIT_SOURCES)
        seen = seen if isinstance(seen, list) else [seen]
        factor = 4 if tiny else VL_FACTOR["patch"] * VL_FACTOR["merge"]  # toy/tiny_families' processor: 2 x 2
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        vl = [smart_resize(i.height, i.width, factor=factor, min_pixels=factor * factor,
                           max_pixels=16 * 16 if tiny else 12845056) for i in seen]
        out["vl_tokens"] = sum(a * b for a, b in vl) // factor**2
        out["vl_patches"] = 4 * out["vl_tokens"]
        ids = torch.tensor([[x.shape[-2] // f // 2, x.shape[-1] // f // 2] for x in pixels])
        channels = pipe.transformer.config.in_channels
        out.update(pixels=[tuple(x.shape) for x in pixels], ids=ids, ids_key="cond_shapes")
    else:  # FLUX.2: models.flux2_reference, then Flux2Pipeline._prepare_image_ids of the patchified latents
        from diffusers import Flux2Pipeline
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
        pipe.image_processor, pipe.condition_size = Flux2ImageProcessor(vae_scale_factor=2 * f), args.condition_size
        pipe._patchify_latents = Flux2Pipeline._patchify_latents  # (static) what its _encode_vae_image calls
        pixels = [models.flux2_reference(pipe, models.source_image(source)) for _ in range(EDIT_SOURCES)]
        channels = pipe.transformer.config.in_channels
        latents = [torch.zeros(1, channels, x.shape[-2] // f // 2, x.shape[-1] // f // 2) for x in pixels]
        out.update(pixels=[tuple(x.shape) for x in pixels], ids=Flux2Pipeline._prepare_image_ids(latents)[0],
                   ids_key="cond_ids")
    out.update(tokens=sum(math.prod(p[-2:]) // (2 * f) ** 2 for p in out["pixels"]), channels=channels)
    return out


def shared_condition(cond):
    """models.shared_ids without data: what every row of the batch shares is known (its check of equal sizes
    reads the ids); Qwen-Image-Edit's latent sizes as Python ints (qwen_velocity reads them with int())."""
    if cond is None:
        return None
    shared = cond["ids"].tolist() if cond["ids_key"] == "cond_shapes" else cond["ids"]
    return lambda ids: shared


def encode_sources(kind: str, pipe, cond: dict, n: int):
    """n editing prompts' sources through the VAE as the families' encodes call it, one prompt at a time
    (models.kontext_encode / qwen_edit_encode / flux2_encode: the pipelines' own _encode_vae_image, the
    posterior's mode), packed and stacked: the "cond" of n rows (bf16, the VAE's dtype)."""
    import models
    from diffusers import Flux2Pipeline, FluxKontextPipeline, QwenImageEditPlusPipeline

    encode = {"kontext": FluxKontextPipeline, "qwenimage_edit": QwenImageEditPlusPipeline,
              "flux2": Flux2Pipeline}[kind]._encode_vae_image
    rows = []
    for _ in range(n):
        latents = [encode(pipe, torch.zeros(shape, dtype=pipe.vae.dtype), generator=None)
                   for shape in cond["pixels"]]
        if kind == "qwenimage_edit":
            rows.append(torch.cat([models.pack(z[:, :, 0])[0] for z in latents]))
        elif kind == "kontext":
            rows.append(torch.cat([models.pack(z)[0] for z in latents]))
        else:
            rows.append(torch.cat([Flux2Pipeline._pack_latents(z)[0] for z in latents]))
    return torch.stack(rows)


def vision_flops(text_encoder, patches: int) -> int:
    """Closed-form FLOPs of Qwen2.5-VL's vision tower on `patches` 14-pixel patches (its window indices are
    data, which fake tensors do not have): 2 per parameter and patch, plus full attention in every block
    (4 x patches^2 x width; 28 of its 32 blocks attend within windows: an upper bound)."""
    visual = getattr(getattr(text_encoder, "model", text_encoder), "visual", None) or text_encoder.visual
    c = visual.config
    return 2 * sum(p.numel() for p in visual.parameters()) * patches + 4 * patches**2 * c.hidden_size * c.depth


# ---------------------------------------------------------------- one command
UNDO = {  # each change of this project's memory work, undone alone: what the code did before, how measured
    "bf16 compute weights": "FSDP2 gathered float32 weights (autocast then cast them per op) (measured)",
    "activation checkpointing": "every block's activations kept for the backward pass (measured)",
    "text encoders off the GPU": "T5 and CLIP resident on every GPU (added)",
    "bf16 reward models": "reward towers held in float32 (added)",
    "decoding 4 at a time": "a whole micro-batch decoded at once (measured)",
    "indexed embeddings": "DenseGRPO copied every prompt embedding per completion row (added)",
    "sharded reference": "full fine-tuning's reference an unsharded copy on every GPU (added)",
}


def appends_unguarded(path: str, name: str, flag: str) -> bool:
    """Whether the file at `path` calls <name>.append(...) outside every `if` whose test mentions `flag` (read
    from its source with ast, so the estimate follows the file)."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    found = []

    def visit(node, *, guarded):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and ast.unparse(child.func) == f"{name}.append":
                found.append(guarded)
            test = isinstance(node, ast.If) and child in node.body and flag in ast.unparse(node.test)
            inside = guarded or test
            visit(child, guarded=inside)
    visit(tree, guarded=False)
    return any(not g for g in found)


def keeps_sampler_velocities(script: str, args) -> bool:
    """flow_grpo.py keeps every step's velocity for CoCA's x0 predictions (and, if it appends them unguarded,
    whatever --credit); DenseGRPO for its completions' first step."""
    if script == "densegrpo":
        return True
    if script != "flow_grpo":
        return False
    path = os.path.join(ROOT, "flow_grpo.py")
    return args.credit == "coca" or appends_unguarded(path, "sampler_velocities", "credit")


def rollout_steps(mod, script: str, args) -> dict:
    """What the file's rollout stores: latents (incl. the noise), log-prob steps, sampler velocity steps."""
    T = args.num_steps
    if script == "awm":  # SA-Solver's state: x, the predictor's x_p, two data predictions (float32)
        return {"latents": 4, "log_probs": 0, "velocities": 0}
    if script == "dgpo":  # DPM-Solver++'s state: x, its data prediction and the previous one (float32)
        return {"latents": 3, "log_probs": 0, "velocities": 0}
    if script == "mixgrpo":  # the ODE outside the window; Flash: fewer DPM-Solver++ steps after it
        last = mod.window_steps(args, 0)[-1]
        steps = last + mod.flash_points(args, last) if args.flash else T
        return {"latents": steps + 1, "log_probs": last + 1 if args.flash else T, "velocities": 0}
    if script in ("diffusion_nft", "dpo", "crd"):  # the rollout's latents only
        return {"latents": T + 1, "log_probs": 0, "velocities": 0}
    velocities = T if keeps_sampler_velocities(script, args) else 0
    means = T if script == "flow_dppo" or getattr(args, "guard", False) else 0  # each step's rollout mean
    return {"latents": T + 1 + means, "log_probs": T, "velocities": velocities}


def alone_after(fn):
    """`fn`, after which no process group is left initialized: an estimate's fake group of `world` ranks would
    make every later run in this process (the tests') gather its tensors `world` times."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch.distributed as dist
        try:
            return fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return wrapper


@alone_after
def estimate(name, script, argv, world, *, tiny=False, undo=(), phases=None, count_flops=True):
    """One command's per-rank phases: {"peak": {phase: bytes}, "flops": {phase: FLOPs}, "bytes": resident
    parts, ...}. `undo`: changes of UNDO to revert (measured ones); `phases`: run only these; `count_flops`:
    False leaves the FLOPs (and the seconds) out, a quarter of a tiny estimate's time."""
    import tyro

    import common
    import models

    mod = importlib.import_module(script)
    args = tyro.cli(mod.Args, args=argv.split())
    if tiny:
        args.resolution, args.width, args.max_sequence_length = 32, None, 16
    # the paths, reward files and OCR engine are the training machine's: the estimate reads and writes none
    with patched(common, "check_output_path", lambda *a, **k: None), \
            patched(common.import_sibling("rewards"), "check", lambda *a, **k: None):
        mod.check_args(args, world)
    kind, arch = model_architecture(args.model)
    beta, nfe, cache = getattr(args, "beta", 0.0), mod.planned_nfe(args), bool(args.text_cache)
    # a reference model for the KL, and for DGPO's DPO margin at any beta (unless --ema-reference); dpo.py's
    # reference is a copy of the trainable weights
    reference = beta > 0 or (script == "dgpo" and not args.ema_reference)
    P, G, T = args.prompts_per_iteration // world, args.group_size, args.num_steps
    mb, bf16, sharded = min(args.micro_batch, P * G), torch.bfloat16, args.full_finetune and world > 1
    checkpointing = args.gradient_checkpointing and "activation checkpointing" not in undo
    fp32_gathers = sharded and "bf16 compute weights" in undo  # the old policy: float32 weights gathered
    make_t, text_cls, vae_cls = architectures(arch, tiny=tiny)
    steps = rollout_steps(mod, script, args)
    out = {"name": name, "world": world, "args": args, "nfe": nfe, "P": P, "mb": mb, "script": script,
           "sharded": sharded, "kind": kind, "arch": arch, "text_cache": cache,
           "checkpointing": args.gradient_checkpointing, "steps": steps, "undo": tuple(undo)}

    fake_process_group(world)
    build = Builder()
    fake = build.fake
    t0 = time.time()
    if sharded:  # common.make_trainable itself: float32 master shards after sharding, common.shard's policy
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))  # made outside fake mode: its rank map is data
        with fake, patched(common, "shard", functools.partial(common.shard, mesh=mesh)):
            torch.set_default_dtype(bf16)
            transformer = make_t().requires_grad_(False)
            torch.set_default_dtype(torch.float32)
            params, ref = common.make_trainable(
                transformer, kind, lora=None, reference=reference, sharded=True,
                compute_dtype=None if fp32_gathers else bf16, checkpointing=checkpointing)
        params = list(params.values())
    else:  # LoRA (or one GPU): bf16 frozen weights, float32 trainable ones, from common.make_trainable itself
        box = {}

        def prepare(t):
            box["ref"] = common.make_trainable(
                t.requires_grad_(False), kind,
                lora=None if args.full_finetune else (args.lora_rank, args.lora_alpha), reference=reference,
                sharded=False, compute_dtype=bf16, checkpointing=checkpointing)[1]
            return t
        transformer = build(make_t, bf16, prepare)
        params, ref = [p for p in transformer.parameters() if p.requires_grad], box["ref"]
        if ref is not None:
            raise SystemExit("error: the estimator does not model one-GPU full fine-tuning with a KL "
                             "(pass --beta 0)")
    vae = build(vae_cls, bf16).requires_grad_(False)
    loaded = {r: reward_model(r, tiny=tiny) for r in dict.fromkeys(args.rewards + args.eval_rewards)}
    loaded = {r: build(m) for r, m in loaded.items() if m is not None}
    trained_rewards = {r: m for r, m in loaded.items() if r in args.rewards}
    texts = [build(c, bf16).requires_grad_(False) for c in text_cls]
    sigmas = Sigmas(common.shifted_sigmas(max(T, 2), shift=3.0).tolist())
    # what the family's functions read of a pipeline: its class name (common.decode), the VAE, the latents'
    # scale (the pipelines' vae_scale_factor), the transformer's config, [klein]'s is_distilled
    pipe = type(EDIT_PIPELINE.get(args.model, common.FAMILIES[kind]["pipelines"][0]), (), {})()
    pipe.vae, pipe.transformer = vae, transformer
    pipe.vae_scale_factor = 2 ** len(vae.temperal_downsample) if hasattr(vae, "temperal_downsample") else \
        2 ** (len(vae.config.block_out_channels) - 1)
    if kind == "wan":  # WanPipeline's factors: from the VAE's config
        pipe.vae_scale_factor_spatial = vae.config.scale_factor_spatial
        pipe.vae_scale_factor_temporal = vae.config.scale_factor_temporal
    pipe.config = types.SimpleNamespace(is_distilled=args.model in DISTILLED)
    common.check_guidance(pipe, kind, args.guidance)
    mode = common.FAMILIES[kind]["guidance"](pipe)
    guidance = max(args.guidance, getattr(args, "kl_cfg", 0.0))  # crd.py encodes its KL reference's negatives
    cfg = (mode == "cfg" and guidance > 1) or (mode == "cfg0" and guidance > 0)  # negatives too
    shape = common.latent_shape(pipe, kind, args.resolution, width=args.width, frames=args.num_frames)
    # the decoded samples: images [3, H, W] or frames [3, F, H, W] (a video's first latent frame is one frame)
    pixels = (3, *([(shape[1] - 1) * pipe.vae_scale_factor_temporal + 1] if len(shape) == 4 else []),
              args.resolution, args.width or args.resolution)
    frames_scored = len(common.frame_indices(args.reward_models.frame_reduce, pixels[1])) if len(shape) == 4 else 1
    pooled_dim, masked = None, kind in ("qwenimage", "qwenimage_edit", "zimage")
    cond = None
    if editing(kind, args):  # the sources' condition, sized by the family's own resizes (one source each)
        if tiny and args.condition_size != 0:  # the tiny target's size (the released sizes would dwarf it)
            args.condition_size = args.resolution
        pipe.latent_channels = getattr(vae.config, "z_dim", None)  # QwenImageEdit(Plus)Pipeline's
        cond = edit_condition(kind, pipe, args, tiny=tiny)
        if tiny:  # room for the tiny encoder's image tokens too
            args.max_sequence_length += cond["vl_tokens"]
        if cond["vl_tokens"] >= args.max_sequence_length:  # models.qwen_edit_encode's error
            raise SystemExit(f"error: {cond['vl_tokens']} image tokens of the sources leave no room for the "
                             f"prompt in --max-sequence-length {args.max_sequence_length}")
    tokens = text_tokens = args.max_sequence_length  # the newer families pad to it (and keep a mask)
    if kind in ("flux", "kontext"):
        txt_dim, pooled_dim = (32, 32) if tiny else (4096, 768)
    elif kind == "sd3":
        txt_dim, pooled_dim = (64, 64) if tiny else (4096, 2048)
        tokens += 16 if tiny else 77  # CLIP's tokens before T5's
    else:  # the text dimension the transformer takes: the stacked hidden layers of FLUX.2's
        txt_dim = transformer.config.get("joint_attention_dim") or transformer.config.get("text_dim") or \
            transformer.config.cap_feat_dim
        # Qwen-Image's template (34 tokens) and Qwen-Image-Edit's (64), dropped after encoding: the encoder reads
        # them, the image tokens (inside max_sequence_length) and the prompt
        text_tokens += {"qwenimage": 34, "qwenimage_edit": 64}.get(kind, 0)
    out.update(tokens=tokens, txt_dim=txt_dim, cfg=cfg, latent_bytes=math.prod(shape) * 4, shape=shape,
               pixels=pixels, frames_scored=frames_scored, edit=None if cond is None else {
                   "cond_tokens": cond["tokens"], "sources": [list(p) for p in cond["pixels"]],
                   "vl_tokens": cond["vl_tokens"], "condition_size": args.condition_size})
    with fake, patched(models, "trim", full_trim), patched(common, "fits_gathered", fits_gathered), \
            patched_entry(common.FAMILIES["zimage"], "velocity", full_rows(common.FAMILIES["zimage"]["velocity"])), \
            patched(models, "shared_ids", shared_condition(cond)):
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        for p in params:  # Adam's states exist after the first step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema = [p.detach().float().clone() for p in params] if args.ema else []
        # DiffusionNFT's old policy, dpo.py's reference, crd.py's old and sampling snapshots
        old = [p.detach().clone() for _ in range({"diffusion_nft": 1, "dpo": 1, "crd": 2}.get(script, 0))
               for p in params]
        kl_ema = [p.detach().clone() for p in params] if script in ("awm", "dgpo") else []  # KL-EMA, EMA ref
        ema += kl_ema
        resident = [transformer, vae, optimizer, *loaded.values()] + ([ref] if ref is not None else []) + ema + old
        trainable = nbytes(*params) if not sharded else nbytes(transformer)
        reward_bytes = sum(nbytes(m) for m in loaded.values())
        out["text_bytes"] = sum(nbytes(m) for m in texts)
        out["bytes"] = {"frozen transformer (bf16)": nbytes(transformer) - trainable if not sharded else 0,
                        "trainable (float32)": trainable, "Adam states": nbytes(optimizer),
                        "reference (bf16)": nbytes(ref) if ref is not None else 0, "EMA": nbytes(*ema),
                        "old policy (float32)": nbytes(*old),
                        "VAE": nbytes(vae), "reward models (bf16 towers)": reward_bytes,
                        # --text-cache: dropped after the start-up's fill
                        "text encoders (on the CPU between encodings)": 0 if cache else out["text_bytes"]}
        out["reward_fp32_bytes"] = sum(4 * sum(p.numel() for p in m.parameters()) for m in loaded.values())
        out["n_params"] = sum(p.numel() for n, p in transformer.named_parameters() if "lora_" not in n)
        out["block_params"] = max(sum(p.numel() for p in b.parameters())
                                  for b in common.transformer_blocks(transformer))
        out["params"] = (out["n_params"], sum(p.numel() for m in texts for p in m.parameters()),
                         sum(p.numel() for p in vae.parameters()))

        def embeddings(n):
            """n prompts' embeddings as the family's encode returns them (and the negative prompt's per row)."""
            e = {"embeds": torch.zeros(n, tokens, txt_dim, dtype=bf16)}
            if pooled_dim:
                e["pooled"] = torch.zeros(n, pooled_dim, dtype=bf16)
            if masked:
                e["mask"] = torch.ones(n, tokens, dtype=torch.long)
            e = {**e, **{"neg_" + k: v.clone() for k, v in e.items()}} if cfg else e
            if cond is not None:  # the sources' packed latents and what every row shares of their positions
                e["cond"] = torch.zeros(n, cond["tokens"], cond["channels"], dtype=bf16)
                e[cond["ids_key"]] = torch.zeros(n, *cond["ids"].shape, dtype=cond["ids"].dtype)
            return e

        def encode(n):
            """n prompts as encode_prompts encodes a chunk: the text encoders (Qwen-Image-Edit: each prompt
            alone, its sources' image tokens inside the sequence, and its negative with the same images), then
            the sources through the VAE."""
            if kind == "qwenimage_edit":
                for _ in range(n * (2 if cfg else 1)):
                    text_forward(texts, torch.zeros(1, text_tokens, dtype=torch.long))
            else:
                text_forward(texts, torch.zeros(n * (2 if cfg else 1), text_tokens, dtype=torch.long))
            if cond is not None:
                with torch.no_grad():
                    encode_sources(kind, pipe, cond, n)

        def vision(n):  # Qwen2.5-VL's vision tower on n prompts' sources (and their negatives')
            return n * (2 if cfg else 1) * vision_flops(texts[0], cond["vl_patches"]) if cond and \
                cond["vl_patches"] else 0
        emb = embeddings(P)
        rows = torch.zeros(max(mb, P * G), dtype=torch.long)

        def phase(label, fn, *live):
            if phases is not None and label not in phases:
                return
            peak, flops = measure(fn, [*resident, *live], flops=count_flops and not undo)
            out.setdefault("peak", {})[label] = peak
            if flops is not None or not count_flops:  # (without counting: 0)
                out.setdefault("flops", {})[label] = flops or 0

        # -------- start-up with --text-cache: every prompt encoded once, 16 at a time, the text encoders alone
        # on the GPU with the reward models (loaded first; the transformer and the VAE still on the CPU)
        # (editing: the sources' VAE encoding too, the VAE counted on the GPU)
        if cache and phases is None:
            out["fill"], out["fill_flops"] = measure(functools.partial(encode, 16), [
                *loaded.values(), *texts, *([vae] if cond else [])], flops=count_flops and not undo)
            out["fill_flops"] = out["fill_flops"] and out["fill_flops"] + vision(16)
        # -------- encoding: the text encoders visit the GPU for the iteration's prompts (and CFG's negatives);
        # with --text-cache the embeddings come from disk (rundir.read_text_cache): no text encoder at all
        if cache:
            phase("encode", functools.partial(embeddings, P))
        else:
            phase("encode", functools.partial(encode, min(16, P)), *texts)  # a chunk
            if out.get("flops", {}).get("encode"):
                out["flops"]["encode"] += vision(min(16, P))

        # -------- rollout: what the file keeps for the whole iteration, then one of each kind of call
        L = len(getattr(args, "lambdas", (1,)))
        N = P * G

        def lat(n, dtype=torch.float32):
            return torch.zeros(n, *shape, dtype=dtype)

        def full(n):  # decoded images (or videos), float32
            return torch.zeros(n, *pixels)

        def frames(n):  # what an image reward scores of n samples (common.per_frame: --frame-reduce's frames)
            return torch.zeros(n * frames_scored, 3, *pixels[-2:])

        kept = list(emb.values())
        if script == "g2rpo":  # the anchors' x_k (float32), v(x_k) (bf16), post-SDE latents, last x0, images
            kept += [lat(P) for _ in range(max(args.sde_steps) + 1)]
            kept += [lat(P, bf16) for _ in range(max(args.sde_steps) + 1)]
            kept += [lat(N) for _ in args.sde_steps] + [torch.zeros(N) for _ in args.sde_steps]
            kept += [lat(L * N), full(L * N)]
        else:  # every latent of every trajectory (float32), the log-probs, the sampler's velocities (bf16)
            kept += [lat(N) for _ in range(steps["latents"])]
            kept += [torch.zeros(N) for _ in range(steps["log_probs"])]
            kept += [lat(N, bf16) for _ in range(steps["velocities"])]
            kept += [full(G if script == "densegrpo" else N)]  # DenseGRPO: one group's images, for logging
            if script == "densegrpo":  # every completion's x0
                kept += [lat((T + 1) * N)]
        out["kept"] = nbytes(*kept)
        scored = {"g2rpo": L * N, "densegrpo": mb}.get(script, N)  # images per reward call, as the files do
        out["scored"] = scored
        x = lat(mb)

        def rollout():
            with torch.no_grad(), common.gathered(transformer, sharded=sharded):
                e = common.select(emb, rows[:mb])
                if script in ("densegrpo", "g2rpo"):  # the completions' buffers (one step: v_first given)
                    n = T * N if script == "densegrpo" else N
                    reps = 1 if script == "densegrpo" else L
                    common.ode_complete(transformer, kind, lat(n), [[0, 1]] * (n * reps), sigmas, emb,
                                        guidance=args.guidance, micro_batch=mb, v_first=lat(n),
                                        emb_index=torch.zeros(n, dtype=torch.long))
                    common.velocity(transformer, kind, x, sigmas[1], e, guidance=args.guidance)
                    return
                step_buffers = []
                if script == "dancegrpo":  # v = torch.empty_like(latents[i]) and the forwards' rows
                    step_buffers += [lat(N), lat(N, bf16)]
                elif script == "mixgrpo":  # v, x0 = x - sigma v, the solver's x0_prev (Flash: its update too)
                    step_buffers += [lat(N, bf16), lat(N), lat(N)] + ([lat(N), lat(N)] if args.flash else [])
                elif script == "diffusion_nft":  # v, x0 and x0_prev of dpm2, under the swapped-in old weights
                    step_buffers += [lat(N, bf16), lat(N), lat(N)]
                elif script == "dgpo":  # v (x, x0 and x0_prev are kept)
                    step_buffers += [lat(N, bf16)]
                elif script in ("dpo", "crd"):  # v, and the SDE's noise and mean (dpo) or v.float() (crd)
                    step_buffers += [lat(N, bf16), lat(N)] + ([lat(N)] if script == "dpo" else [])
                with common.swapped_in(params, old):
                    common.velocity(transformer, kind, x, sigmas[1], e, guidance=args.guidance)
                del step_buffers
        phase("rollout", rollout, *kept)

        def decode():  # inside the rollout's gathered weights, as in the files
            with torch.no_grad(), common.gathered(transformer, sharded=sharded):
                n = mb if "decoding 4 at a time" in undo else min(4, mb)
                common.decode(pipe, lat(n))
        phase("decode", decode, *kept)

        def score():
            with torch.no_grad(), common.gathered(transformer, sharded=sharded):
                reward_forward(trained_rewards, frames(scored))  # DenseGRPO: decoded per micro-batch
            if script == "flow_grpo" and args.credit == "coca":  # x0_hat_k = x_k - sigma_k v(x_k), the credit
                x0_hats = torch.stack([lat(N) - 0.5 * lat(N, bf16) for _ in range(T)])
                trained = int(T * args.timestep_fraction)
                common.coca_credit(torch.ones(N), x0_hats, lat(N), window=args.coca_window,
                                   alpha=args.coca_alpha, group_size=G, trained=trained)
        phase("rewards", score, *kept)

        # -------- training: one micro-batch forward + backward with the stored rollout (the files' own lines)
        train_rows = mb if script != "g2rpo" else min(args.micro_batch, P)

        def train_nft():  # diffusion_nft.py's lines: old (swapped in), policy, reference, the x0-space loss
            e, x0, t = common.select(emb, rows[:mb]), lat(mb), 0.5
            x_t = (1 - t) * x0 + t * lat(mb)
            with torch.no_grad(), common.swapped_in(params, old):
                v_old = common.velocity(transformer, kind, x_t, sigmas[1], e, guidance=args.guidance).float()
            v = common.velocity(transformer, kind, x_t, sigmas[1], e, guidance=args.guidance, detach_uncond=args.detach_uncond).float()
            losses = []
            for v_implicit in (args.nft_beta * v + (1 - args.nft_beta) * v_old,
                               (1 + args.nft_beta) * v_old - args.nft_beta * v):
                x0_hat = x_t - t * v_implicit
                dims = tuple(range(1, x0.ndim))
                w = (x0_hat.detach().double() - x0).abs().mean(dims, keepdim=True).clip(min=1e-5)
                losses.append(((x0_hat - x0) ** 2 / w).mean(dims))
            loss = (0.5 * losses[0] + 0.5 * losses[1]).mean()
            if beta > 0:
                with torch.no_grad(), common.as_reference(transformer, ref) as reference:
                    v_ref = common.velocity(reference, kind, x_t, sigmas[1], e, guidance=args.guidance)
                loss = loss + beta * ((v - v_ref.float()) ** 2).mean()
            loss.backward()

        def train_dpo():  # dpo.py's lines: the reference (swapped in), the policy, float64 errors, the DPO loss
            e = {k: v for k, v in common.select(emb, rows[:mb]).items() if not k.startswith("neg_")}
            x0, eps, t = lat(mb), lat(mb), torch.full((mb,), 0.5)
            x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
            with torch.no_grad(), common.swapped_in(params, old):
                v_ref = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance)
            v = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance)
            mse, mse_ref = (((w.double() - (eps - x0).double()) ** 2).mean(dim=(1, 2, 3)) for w in (v, v_ref))
            w_diff, l_diff = (mse - mse_ref).chunk(2)
            (-torch.nn.functional.logsigmoid(-0.5 * args.beta_dpo * (w_diff - l_diff)).mean()).backward()

        def train_crd():  # crd.py's lines: the old model (swapped in), the policy, the guided reference, the loss
            e, x0, eps, t = common.select(emb, rows[:mb]), lat(mb), lat(mb), torch.full((mb,), 0.5)
            x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
            with torch.no_grad(), common.swapped_in(params, old):
                v_old = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance).float()
            v = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance).float()
            weight = lambda w: (w.detach().double() - (eps - x0)).abs().mean((1, 2, 3), keepdim=True)  # noqa
            r_theta = -((v - eps + x0) ** 2 / weight(v) - (v_old - eps + x0) ** 2 / weight(v_old)).mean((1, 2, 3))
            group = torch.arange(mb) // args.group_size
            loss = mod.centred_reward_loss(r_theta, torch.rand(mb), group, beta=args.crd_beta, loss=args.crd_loss,
                                           temperature=args.weight_temp).mean()
            if beta > 0:
                with torch.no_grad(), common.as_reference(transformer, ref) as reference:
                    v_ref = common.velocity(reference, kind, x_t, t, e, guidance=args.kl_cfg)
                loss = loss + beta * ((v - v_ref.float()) ** 2).mean()
            loss.backward()

        def train():
            if script == "diffusion_nft":
                return train_nft()
            if script in ("dpo", "crd"):
                return train_dpo() if script == "dpo" else train_crd()
            j = 1  # a trained step: noise > 0
            adv, old_log_probs = torch.ones(mb if script != "g2rpo" else train_rows * G), torch.zeros(mb)
            e = common.select(emb, rows[:train_rows])
            xt = lat(train_rows)
            if script == "dgpo":  # dgpo.py's lines: the EMA reference's forward (swapped in), the policy's, the base's
                t, eps = 0.5, lat(train_rows)
                x_t = (1 - t) * xt + t * eps
                with torch.no_grad(), common.swapped_in(params, kl_ema):
                    v_ema = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance)
                v = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance, detach_uncond=args.detach_uncond)
                with torch.no_grad(), common.as_reference(transformer, ref) as reference:
                    v_ref = common.velocity(reference, kind, x_t, t, e, guidance=args.guidance)
                mse, mse_ema, mse_ref = (((eps - xt - w.double()) ** 2).flatten(1).mean(1)
                                         for w in (v, v_ema, v_ref))
                weight = torch.sigmoid(adv * (mse - mse_ref).detach())
                loss = (weight * adv * torch.where(mse_ema > mse, mse.detach(), mse)).mean()
                (loss + beta * ((v.double() - v_ref.double()) ** 2).mean()).backward()
                return
            if script == "awm":  # awm.py's lines: the KL-EMA's forward (swapped in), the policy's, the reference's
                t, eps = 0.5, lat(train_rows)
                x_t = (1 - t) * xt + t * eps
                with torch.no_grad(), common.swapped_in(params, kl_ema):
                    v_ema = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance)
                v = common.velocity(transformer, kind, x_t, t, e, guidance=args.guidance, detach_uncond=args.detach_uncond)
                log_prob = mod.awm_log_prob(v, eps - xt, t, weighting=args.weighting, power=args.ghuber_power)
                ratio = torch.exp(log_prob - log_prob.detach())
                policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_range, 1 + args.clip_range))
                with torch.no_grad(), common.as_reference(transformer, ref) as reference:
                    v_ref = common.velocity(reference, kind, x_t, t, e, guidance=args.guidance)
                loss = (policy_loss.mean() + beta * ((v.double() - v_ref.double()) ** 2).mean()
                        + args.ema_beta * ((v.double() - v_ema.double()) ** 2).mean())
                (loss / 4).backward()
                return
            v = common.velocity(transformer, kind, xt, sigmas[j], e, guidance=args.guidance, detach_uncond=args.detach_uncond)
            if script == "g2rpo":  # each member reuses its prompt's v(x_k)
                members = torch.zeros(train_rows * G, dtype=torch.long)
                v, xt, old_log_probs = v[members], xt[members], torch.zeros(len(members))
            _, log_prob, mean, std = mod.sde_step(v, xt, sigmas, j, args.noise_level, prev_sample=lat(len(xt)))
            ratio = torch.exp(log_prob - old_log_probs)
            if script == "flow_dppo":  # the trust region's mask instead of the clip
                kl_old = ((mean - lat(len(xt))) ** 2).flatten(1).mean(1) / (2 * std**2)
                drop = (kl_old >= args.kl_threshold) & (ratio > 1)
                policy_loss = torch.where(drop, torch.zeros_like(ratio), -adv * ratio).mean()
            else:
                clipped_ratio = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
                policy_loss = torch.max(-adv * ratio, -adv * clipped_ratio).mean()
            kl = torch.zeros_like(policy_loss)
            if beta > 0:  # the KL of the step means (Flow-GRPO's code)
                with torch.no_grad(), common.as_reference(transformer, ref) as reference:
                    v_ref = common.velocity(reference, kind, lat(train_rows), sigmas[j], e, guidance=args.guidance)
                if script == "g2rpo":
                    v_ref = v_ref[members]
                _, _, mean_ref, _ = mod.sde_step(v_ref, xt, sigmas, j, args.noise_level, prev_sample=lat(len(xt)))
                step = float(sigmas[j] - sigmas[j + 1])  # |dt|
                kl_var = std**2 if args.kl_form == "exact" else std**2 / step
                kl = ((mean - mean_ref) ** 2).flatten(1).mean(1).mean() / (2 * kl_var)
            loss = policy_loss + beta * kl
            (loss * len(xt) / (len(xt) * 4)).backward()
        phase("training step", train, *kept)

        def step():
            for p in params:
                p.grad = torch.zeros_like(p)
            # common.optimizer_step's clip_grad_norm_, on the local shards: DTensor's foreach path under
            # FakeTensorMode makes whole tensors that a real run never makes (measured on real tensors: none)
            grads = [p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad for p in params]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            torch._foreach_mul_(grads, (args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phase("optimizer step", step, *kept)

        # -------- evaluation: rundir.Run.evaluate on this rank's pairs: encoded 16 at a time, the ODE in
        # micro-batches with gathered weights, decoded per micro-batch (4 at a time), every image scored at
        # once
        n_eval = -(-args.eval_num // world)  # equal shares, the last ranks repeating the last pair
        if cache:
            phase("evaluation encode", functools.partial(embeddings, n_eval))
        else:
            phase("evaluation encode", functools.partial(encode, min(16, n_eval)), *texts)
        e_emb = embeddings(n_eval)
        eval_mb = min(args.micro_batch, n_eval)

        def evaluate():
            noise = lat(n_eval)
            with torch.no_grad(), common.gathered(transformer, sharded=sharded):  # v_first given: one forward
                paths = [[0, 1, 2]] * eval_mb + [[0, 1]] * (n_eval - eval_mb)
                x0 = common.ode_complete(transformer, kind, noise, paths, sigmas, e_emb,
                                         guidance=args.guidance, micro_batch=eval_mb, v_first=lat(n_eval),
                                         emb_index=torch.zeros(n_eval, dtype=torch.long))
            with torch.no_grad():  # decoded and scored a micro-batch at a time
                images = full(eval_mb)
                common.decode(pipe, lat(min(4, eval_mb)))
                reward_forward(loaded, frames(eval_mb))
                del images, x0
        phase("evaluation", evaluate, *e_emb.values())
    out["seconds_to_estimate"] = time.time() - t0
    return out


def peak(e, undo=()):
    """The largest phase (GiB), with the added (not re-measured) parts of `undo` put back."""
    b, a = e["bytes"], e["args"]
    add = {k: 0.0 for k in e["peak"]}
    for k in add:
        if "text encoders off the GPU" in undo and k not in ("encode", "evaluation encode"):
            add[k] += e["text_bytes"]  # resident (with --text-cache too: never dropped)
        if "bf16 reward models" in undo:
            add[k] += e["reward_fp32_bytes"] - b["reward models (bf16 towers)"]
        if "indexed embeddings" in undo and e["script"] == "densegrpo" and k == "rollout":
            copies = a.num_steps * e["P"] * a.group_size * (2 if e["cfg"] else 1)
            add[k] += copies * e["tokens"] * e["txt_dim"] * 2
        if "sharded reference" in undo and b["reference (bf16)"]:
            add[k] += b["reference (bf16)"] * (e["world"] - 1)
    return max(v + add[k] for k, v in e["peak"].items()) / GIB


def peak_phase(e) -> str:
    return max(e["peak"], key=e["peak"].get)


def per_iteration(e):
    """FLOPs per rank and iteration (evaluation not included) from the measured calls and the file's
    closed-form NFE."""
    a, P, fl, mb, script = e["args"], e["P"], e["flops"], e["mb"], e["script"]
    fwd = fl["rollout"] / mb  # per sample (a CFG pair counts once)
    reward = fl["rewards"] / e["scored"]
    train = fl["training step"] / (mb if script != "g2rpo" else min(a.micro_batch, P))  # with the reference
    images = P * a.group_size * {"densegrpo": a.num_steps + 1}.get(
        script, len(getattr(a, "lambdas", ())) * len(getattr(a, "sde_steps", ())) if script == "g2rpo" else 1)
    decoded = mb if "decoding 4 at a time" in e.get("undo", ()) else min(4, mb)
    return (fl["encode"] + P * (e["nfe"]["rollout"] * fwd + e["nfe"]["train"] * train)
            + images * (fl["decode"] / decoded + reward))


def seconds(flops, gpu: str) -> float:
    return flops / (PEAK_TFLOPS[gpu] * 1e12 * MFU)


def startup(e, *, before=False):
    """GiB on a GPU while the model loads. Now: rundir.start_run loads a sharded run on the CPU and FSDP2
    moves each block's shards to the GPU as it shards it, so the peak is the resident state plus one block
    (and the reference's) in bf16. Before: the whole bf16 transformer and reference copy on every GPU, and
    in the first code a float32 conversion of it (`before`)."""
    if not e["sharded"]:
        return None
    n, ref = e["n_params"], e["bytes"]["reference (bf16)"] > 0  # the VAE and reward models are already loaded
    loaded = e["bytes"]["VAE"] + e["bytes"]["reward models (bf16 towers)"]
    if before:
        return (n * (4 + 2 * ref) + loaded) / GIB
    resident = sum(v for k, v in e["bytes"].items() if not k.startswith("text"))
    return (resident + 2 * e["block_params"] * (1 + ref)) / GIB


# ---------------------------------------------------------------- the reward models alone, evaluate.py
def reward_models(*, tiny=False, names=REWARD_TABLE, batch=REWARD_BATCH):
    """{name: {"bf16"/"float32": {"resident": bytes, "peak": bytes, "flops": FLOPs}, "size": px}}: each model
    resident and one forward of `batch` images (at its input size) and prompts."""
    build, out = Builder(), {}
    for name in names:
        out[name] = {"size": reward_spec(name, tiny=tiny)["size"]}
        for label, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32)):
            m = build(reward_model(name, tiny=tiny, dtype=dtype))
            with build.fake:
                size = m.spec["size"]

                def forward():
                    with torch.no_grad():
                        reward_forward({name: m}, torch.zeros(batch, 3, size, size))
                pk, flops = measure(forward, [m])
            out[name][label] = {"resident": nbytes(m), "peak": pk, "flops": flops,
                                "params": sum(p.numel() for p in m.parameters())}
    return out


def estimate_evaluate(spec=EVALUATE, *, tiny=False):
    """evaluate.py's evaluation on one of spec["world"] GPUs, as rundir.Run.evaluate runs it: this rank's
    prompts encoded `chunk` at a time, the ODE in micro-batches with the bf16 transformer (no adapters),
    decoded 4 at a time per micro-batch, each micro-batch's images scored by each reward in float32 (as
    evaluate.py, micro-batch 4 by default)."""
    import common

    kind, world, n = spec["kind"], spec["world"], spec["prompts"] // spec["world"]
    res = 32 if tiny else spec["resolution"]
    seq = 16 if tiny else spec["max_sequence_length"]
    f = 2 if tiny else 8
    C, H, mb, bf16 = (4 if tiny else 16), res // f, min(spec["micro_batch"], n), torch.bfloat16
    txt_dim, pooled_dim = (32, 32) if tiny else (4096, 768)
    make_t, text_cls, vae_cls = architectures(kind, tiny=tiny)
    build = Builder()
    transformer = build(make_t, bf16).requires_grad_(False)
    vae = build(vae_cls, bf16).requires_grad_(False)
    pipe = type(common.FAMILIES[kind]["pipelines"][0], (), {"vae": vae})()  # decode finds its family by it
    scorers = {r: build(reward_model(r, tiny=tiny, dtype=torch.float32)) for r in spec["rewards"]}
    texts = [build(c, bf16).requires_grad_(False) for c in text_cls]
    sigmas = Sigmas(common.shifted_sigmas(spec["steps"], shift=3.0).tolist())
    out = {"name": spec["name"], "world": world, "n": n, "peak": {}, "flops": {},
           "bytes": {"transformer (bf16)": nbytes(transformer), "VAE": nbytes(vae),
                     "reward models (float32)": sum(nbytes(m) for m in scorers.values()),
                     "text encoders (on the CPU between encodings)": sum(nbytes(m) for m in texts)}}
    resident = [transformer, vae, *scorers.values()]
    with build.fake:
        emb = {"embeds": torch.zeros(n, seq, txt_dim, dtype=bf16),
               "pooled": torch.zeros(n, pooled_dim, dtype=bf16)}
        noise = torch.zeros(n, C, H, H)
        ids = torch.zeros(min(spec["chunk"], n), seq, dtype=torch.long)
        out["peak"]["encode"], out["flops"]["encode"] = measure(functools.partial(text_forward, texts, ids),
                                                               [*resident, *texts, noise, *emb.values()])

        def ode():
            with torch.no_grad():
                paths = [[0, 1, 2]] * mb + [[0, 1]] * (n - mb)  # v_first given: one forward of a micro-batch
                common.ode_complete(transformer, kind, noise, paths, sigmas, emb, guidance=spec["guidance"],
                                    micro_batch=mb, v_first=torch.zeros(n, C, H, H),
                                    emb_index=torch.zeros(n, dtype=torch.long))
        out["peak"]["ODE"], out["flops"]["ODE"] = measure(ode, [*resident, noise, *emb.values()])
        x0, images = torch.zeros(n, C, H, H), torch.zeros(n, 3, res, res)

        def decode():
            common.decode(pipe, torch.zeros(min(spec["decode_batch"], mb), C, H, H))
        live = [*resident, x0, images, *emb.values()]
        out["peak"]["decode"], out["flops"]["decode"] = measure(decode, live)

        def score():
            with torch.no_grad():
                reward_forward(scorers, images[:mb])
        out["peak"]["rewards"], out["flops"]["rewards"] = measure(score, [*resident, images[:mb]])
    fl = out["flops"]
    out["total_flops"] = (fl["encode"] * n / len(ids) + n * spec["steps"] * fl["ODE"] / mb
                          + n * fl["decode"] / min(spec["decode_batch"], mb) + n * fl["rewards"] / mb)
    out["nfe"] = n * spec["steps"]
    return out


# ---------------------------------------------------------------- the report
def report(estimates, path, *, made: str, rewards_table=None, evaluation=None):
    """Write the tables of `estimates` (estimate()'s dicts, or row files' read back) to `path`; `made`: the
    paragraph that says how they were made."""
    gpus = ("A100", "H100")
    lines = [
        "# Estimated per-GPU memory and compute of the README's command lines", "", made, "",
        "Fake tensors: see the estimator's docstring for what is and is not modelled. GiB per GPU: the resident state "
        "(trainable weights, Adam states, frozen weights, reference, VAE, reward models; this rank's shards "
        "under FSDP2) plus each phase's transient memory (activations, gathered weights, stored rollout "
        "tensors). The 80 GB cards need the peak at or below 70 GiB, which leaves room for the allocator's "
        "fragmentation and the CUDA "
        f"context. Seconds at {MFU:.0%} of the bf16 peak (evaluation not included).", "",
        "| command | GPUs | resident | " + " | ".join(PHASES) + " | **peak** | peak phase | rollout kept | "
        "start-up | text cache fill | planned NFE per prompt (rollout / train / reference) | TFLOP / rank / "
        f"iteration | seconds / iteration, A100 / H100 at {MFU:.0%} MFU | A100-hours / iteration |",
        "|---|" + "---|" * (len(PHASES) + 12)]
    for e in estimates:
        res = sum(v for k, v in e["bytes"].items() if not k.startswith("text"))
        flops, up, n = per_iteration(e), startup(e), e["nfe"]
        cells = [e["name"], e["world"], f"{res / GIB:.1f}", *(f"{e['peak'][k] / GIB:.1f}" for k in PHASES),
                 f"**{peak(e):.1f}**", peak_phase(e), f"{e['kept'] / GIB:.2f}",
                 "-" if up is None else f"{up:.1f}", f"{e['fill'] / GIB:.1f}" if "fill" in e else "-",
                 f"{n['rollout']} / {n['train']} / {n['reference']}", f"{flops / 1e12:,.0f}",
                 " / ".join(f"{seconds(flops, g):,.0f}" for g in gpus),
                 f"{seconds(flops, 'A100') * e['world'] / 3600:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if any("fill" in e for e in estimates):
        lines += [
            "", "Text cache fill (`--text-cache`): the start-up encodes every prompt once, 16 at a time (with the "
            "negative prompt's where the family runs true CFG), the text encoders alone on the GPU beside the "
            "reward models (the transformer and the VAE still on the CPU); the encoders are then dropped, and "
            "the encode phases read this rank's embeddings from disk."]
    lines += ["", "## The architectures built: parameters (billions; published in brackets)", "",
              "| architecture | transformer | text encoders | VAE |", "|---|---|---|---|"]
    for arch, counts in {e["arch"]: e["params"] for e in estimates}.items():
        published = PUBLISHED.get(arch, (None,) * 3)
        lines.append(f"| {arch} | " + " | ".join(f"{c / 1e9:.2f}" + (f" ({p / 1e9:g})" if p else "")
                                               for c, p in zip(counts, published)) + " |")
    parts = list(estimates[0]["bytes"]) if estimates else []
    lines += ["", "## Resident state per GPU (GiB)", "", "| command | " + " | ".join(parts) + " |",
              "|---|" + "---|" * len(parts)]
    for e in estimates:
        lines.append(f"| {e['name']} | " + " | ".join(f"{v / GIB:.2f}" for v in e["bytes"].values()) + " |")
    lines += [
        "", "## Each change undone alone: the peak per GPU (GiB) with the code as it was before", "",
        "Measured: the phases re-run with the old behaviour; added: the part put back on top. Start-up: the "
        "float32 conversion before sharding. Rollout all-gathers: what one rank receives per iteration for "
        "the rollout's forwards (weights gathered once, in bf16, against float32 weights re-gathered at "
        "every forward). n/a: the change does not apply to the command; -: not re-measured (a row made with "
        "`--no-undo`).", "",
        "| command | now | " + " | ".join(UNDO) + " | start-up before -> now | rollout all-gathers per "
        "iteration, before -> now |", "|---|---|" + "---|" * (len(UNDO) + 2)]
    for e in estimates:
        cells = []
        for change in UNDO:
            b = e.get("undone", {}).get(change)
            cells.append("-" if "undone" not in e else "n/a" if b is None else f"{b:.1f}")
        up = startup(e)
        calls = math.ceil(e["nfe"]["rollout"] * e["P"] / e["mb"])
        before, now = calls * 4 * e["n_params"] / GIB, 2 * e["n_params"] / GIB
        gathers = f"{before:,.0f} GiB -> {now:.0f} GiB" if e["sharded"] else "none (LoRA: weights replicated)"
        times = "-" if up is None else f"{startup(e, before=True):.1f} -> {up:.1f}"
        lines.append(f"| {e['name']} | {peak(e):.1f} | " + " | ".join(cells) + f" | {times} | {gathers} |")
    if rewards_table:
        lines += [
            "", f"## Reward models: resident GiB and one forward of a {REWARD_BATCH}-image batch, bf16 "
            "towers vs float32", "",
            "bf16: the towers in bf16 with float32 projections, scales and heads, as rewards.py loads them "
            "for training on GPUs; float32: everything in float32, as the papers' evaluation code runs them. "
            f"Forward peak: the model plus one forward of {REWARD_BATCH} images at its input size and {REWARD_BATCH} "
            "prompts (preprocessing included).", "",
            "| reward | input px | parameters (M) | resident, bf16 | forward peak, bf16 | resident, float32 "
            "| forward peak, float32 | GFLOP per image |", "|---|---|---|---|---|---|---|---|"]
        for name, r in rewards_table.items():
            b, f32 = r["bf16"], r["float32"]
            lines.append(f"| {name} | {r['size']} | {b['params'] / 1e6:,.0f} | {b['resident'] / GIB:.2f} | "
                         f"{b['peak'] / GIB:.2f} | {f32['resident'] / GIB:.2f} | {f32['peak'] / GIB:.2f} | "
                         f"{b['flops'] / REWARD_BATCH / 1e9:,.0f} |")
    if evaluation:
        ev, spec = evaluation[0], EVALUATE
        lines += [
            "", "## Evaluation alone (evaluate.py), per GPU", "",
            f"rundir.Run.evaluate's phases for one rank's {ev['n']} prompts: encoded {spec['chunk']} at a "
            f"time (the text encoders on the GPU), the ODE ({spec['steps']} steps, {ev['nfe']:,} NFE) in "
            f"micro-batches of {spec['micro_batch']} with the bf16 transformer, decoded {spec['decode_batch']} at "
            "a time, "
            f"each micro-batch's images scored by {', '.join(spec['rewards'])} in float32.", "",
            "| command | GPUs | resident | encode | ODE | decode | rewards | **peak** | TFLOP / rank | "
            f"seconds, A100 / H100 at {MFU:.0%} MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
        for ev in evaluation:
            res = sum(v for k, v in ev["bytes"].items() if not k.startswith("text"))
            phases = " | ".join(f"{ev['peak'][k] / GIB:.1f}" for k in ("encode", "ODE", "decode", "rewards"))
            lines.append(f"| {ev['name']} | {ev['world']} | {res / GIB:.1f} | {phases} | "
                         f"**{max(ev['peak'].values()) / GIB:.1f}** | {ev['total_flops'] / 1e12:,.0f} | "
                         + " / ".join(f"{seconds(ev['total_flops'], g):,.0f}" for g in gpus) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def read_table(path: str) -> dict:
    """{command: {column: cell}} of a results/estimate.md's main table (gpu_check.py compares with it)."""
    rows, header = {}, None
    with open(path) as f:
        for line in f:
            cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
            if line.startswith("| command | GPUs | resident |") and header is None:
                header = cells
            elif header is not None and line.startswith("| ") and len(cells) == len(header):
                rows[cells[0]] = dict(zip(header, cells))
            elif header is not None and rows and not line.strip():
                break
    return rows


def undone(name, script, argv, world, *, tiny, e):
    """The peak with each applicable change of UNDO reverted alone (re-measuring the phases it touches)."""
    a, out = e["args"], {}
    for change in UNDO:
        measured = {"bf16 compute weights": ["rollout", "decode", "rewards", "training step", "evaluation"]
                    if e["sharded"] else None,
                    "activation checkpointing": ["training step"] if a.gradient_checkpointing else None,
                    "decoding 4 at a time": ["decode"] if e["mb"] > 4 else None}
        if change in measured:
            if measured[change] is None:
                continue
            again = estimate(name, script, argv, world, tiny=tiny, undo=(change,), phases=measured[change])
            out[change] = peak({**e, "peak": {**e["peak"], **again["peak"]}})
        elif (change != "indexed embeddings" or script == "densegrpo") and (
                change != "sharded reference" or e["bytes"]["reference (bf16)"]):
            out[change] = peak(e, (change,))
    return out


# ---------------------------------------------------------------- row files: a rerun computes only what is missing
FORMAT = 1  # of a row file
MAX_ROW_BYTES = 2**22  # a row file holds a few KiB; a larger file is not one
REWARDS_ROW = "reward-models"


def slug(name: str) -> str:
    """A row file's name: the command's name in lower case, every run of other characters one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def row_paths(rows: str) -> dict:
    """{command name, REWARDS_ROW, evaluation name: its row file under `rows`}; two names of one file stop."""
    names = [c[0] for c in COMMANDS] + [REWARDS_ROW] + [spec["name"] for spec in EVALUATIONS]
    paths = {n: os.path.join(rows, slug(n) + ".json") for n in names}
    clash = [n for n in names if list(paths.values()).count(paths[n]) > 1]
    if clash:
        raise SystemExit(f"error: the names {clash} give one row file name; rename one of them")
    return paths


def plain(obj):
    """obj as JSON reads it back: tuples as lists, a dict's keys as strings."""
    return json.loads(json.dumps(obj))


def fingerprints(*, tiny: bool, undo: bool) -> dict:
    """{row name: what makes it}: a command's name, script, arguments, GPUs, tiny and whether the before/after
    table was re-measured; the reward models' names and batch; an evaluation's spec."""
    out = {name: {"table": "command", "name": name, "script": script, "argv": argv, "world": world, "tiny": tiny,
                  "undo": undo} for name, script, argv, world in COMMANDS}
    out[REWARDS_ROW] = plain({"table": "reward models", "rewards": REWARD_TABLE, "batch": REWARD_BATCH,
                              "tiny": tiny})
    for spec in EVALUATIONS:
        out[spec["name"]] = plain({"table": "evaluation", "spec": spec, "tiny": tiny})
    return out


def serves(made: dict, wanted: dict) -> bool:
    """Whether a row made with fingerprint `made` answers for `wanted`: equal, except that a row with the
    before/after table's re-measurements serves a run without them."""
    strip = {k: v for k, v in made.items() if k != "undo"}
    return strip == {k: v for k, v in wanted.items() if k != "undo"} and made.get("undo", False) >= wanted.get(
        "undo", False)


def code_state() -> dict:
    """{"commit": the checkout's HEAD, "dirty": whether a tracked .py file differs from it}; None, None outside
    a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "*.py"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def read_row(path: str, wanted: dict, *, quiet: bool = False):
    """The row file at `path` if it serves `wanted` (see serves), else None: absent, unreadable, cut short,
    not a row file, or made by another command or setting (said on stderr unless `quiet`)."""
    def why(reason):
        if not quiet:
            print(f"{path}: {reason}; recomputed", file=sys.stderr)

    try:
        if os.path.getsize(path) > MAX_ROW_BYTES:
            return why(f"larger than {MAX_ROW_BYTES} bytes, not a row file")
        with open(path, encoding="utf-8") as f:
            row = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:  # a truncated file: a JSONDecodeError
        return why(f"unreadable ({type(err).__name__}: {str(err)[:100]})")
    keys = {"fingerprint": dict, "estimate": dict, "seconds": (int, float)}
    if not isinstance(row, dict) or row.get("format") != FORMAT or not all(
            isinstance(row.get(k), t) for k, t in keys.items()):
        return why(f"not a row file of format {FORMAT}")
    if not serves(row["fingerprint"], wanted):
        made = row["fingerprint"]
        return why("made with another " + ", ".join(sorted(k for k in made.keys() | wanted.keys()
                                                           if made.get(k) != wanted.get(k))))
    return row


def write_row(path: str, fingerprint: dict, estimate: dict, *, seconds: float, code: dict):
    """The row file, written whole or not at all (a temporary file renamed over it)."""
    row = {"format": FORMAT, "fingerprint": fingerprint, "commit": code["commit"], "dirty": code["dirty"],
           "seconds": round(seconds, 1), "estimate": plain(estimate)}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(row, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise SystemExit(f"error: cannot write the row file {path}: {err}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def to_row(e: dict) -> dict:
    """A command's estimate as JSON: its Args a plain dict (from_row reads them back as a namespace)."""
    return {**e, "args": dataclasses.asdict(e["args"])}


def from_row(e: dict) -> dict:
    return {**e, "args": types.SimpleNamespace(**e["args"])}


def made_paragraph(rows: dict, missing: list, rows_dir: str) -> str:
    """How the report was made: the row files, the minutes they took, the commits they were measured at."""
    rows_dir = os.path.abspath(rows_dir)
    where = os.path.relpath(rows_dir, ROOT) if rows_dir.startswith(ROOT + os.sep) else rows_dir
    minutes = sum(r["seconds"] for r in rows.values()) / 60
    text = (f"Made by `python results/estimate.py` from its row files in `{where}/`: one JSON file per command (and "
            "per table below), holding what made it (the command's name, script, arguments and GPUs, whether the "
            "before/after table was re-measured) and the commit it was measured at. A rerun computes only the rows "
            "that are missing, cut short or made otherwise (`--only` picks commands by their index in "
            "`COMMANDS`, `--fresh` recomputes every row) and rebuilds this report from the files. Measuring the "
            f"rows took {minutes:.0f} minutes of a 2-core CPU shared with other jobs.")
    commits = {}
    for name, r in rows.items():
        label = (r["commit"] or "outside git")[:12] + (" with uncommitted changes" if r["dirty"] else "")
        commits.setdefault(label, []).append(name)
    if not commits:
        text += " No row has been estimated yet."
    elif len(commits) == 1:
        text += f" Every row was measured at commit {next(iter(commits))}."
    else:
        most = max(commits, key=lambda c: len(commits[c]))
        others = "; ".join(f"at {c}: " + ", ".join(names) for c, names in commits.items() if c != most)
        text += f" Rows were measured at {len(commits)} commits: at {most} every row but these; {others}."
    if missing:
        text += " Not estimated yet: " + ", ".join(missing) + "."
    return text


def write_report(rows_dir: str, out: str, *, tiny: bool):
    """The report of every row file under `rows_dir` that serves COMMANDS' rows, the reward models and the
    evaluations as they are now (with or without the before/after table's re-measurements)."""
    paths, wanted = row_paths(rows_dir), fingerprints(tiny=tiny, undo=False)
    rows = {n: r for n in paths if (r := read_row(paths[n], wanted[n], quiet=True)) is not None}
    missing = [n for n in paths if n not in rows]
    estimates = [from_row(rows[c[0]]["estimate"]) for c in COMMANDS if c[0] in rows]
    evaluation = [rows[s["name"]]["estimate"] for s in EVALUATIONS if s["name"] in rows]
    table = rows[REWARDS_ROW]["estimate"] if REWARDS_ROW in rows else None
    report(estimates, out, made=made_paragraph(rows, missing, rows_dir), rewards_table=table,
           evaluation=evaluation)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny architectures, the same code paths (seconds)")
    p.add_argument("--only", nargs="*", type=int, default=None, help="indices of COMMANDS to run")
    p.add_argument("--no-undo", action="store_true", help="skip the before/after table's re-measurements")
    p.add_argument("--fresh", action="store_true", help="recompute every row, reusing no row file")
    p.add_argument("--out", default=None, help="the report (default: results/estimate.md; --tiny: required)")
    p.add_argument("--rows", default=None, help="the row files' directory (default: the --out path without .md, "
                   "then /rows: results/estimate/rows)")
    a = p.parse_args()
    bad = [i for i in a.only or () if not 0 <= i < len(COMMANDS)]
    if bad:
        raise SystemExit(f"error: --only {bad[0]}: COMMANDS has indices 0 to {len(COMMANDS) - 1}")
    if a.tiny and a.out is None:
        raise SystemExit("error: --tiny needs --out (results/estimate.md and its rows are the real sizes')")
    a.out = a.out or os.path.join(ROOT, "results", "estimate.md")
    rows = a.rows or os.path.join(os.path.splitext(a.out)[0], "rows")
    paths, wanted = row_paths(rows), fingerprints(tiny=a.tiny, undo=not a.no_undo)
    code, t0 = code_state(), time.time()

    def compute(name, make):
        """The row's estimate from its file if that serves, else made now and written at once."""
        if not a.fresh and read_row(paths[name], wanted[name]) is not None:
            print(f"{name}: reused {paths[name]}", flush=True)
            return
        t = time.time()
        e, summary = make()
        write_row(paths[name], wanted[name], e, seconds=time.time() - t, code=code)
        print(f"{name}: {summary} ({time.time() - t:.0f} s, {time.time() - t0:.0f} s in all)", flush=True)

    def command(name, script, argv, world):
        e = estimate(name, script, argv, world, tiny=a.tiny, count_flops=not a.tiny)  # tiny: its code paths
        if not a.no_undo:
            e["undone"] = undone(name, script, argv, world, tiny=a.tiny, e=e)
        return to_row(e), f"peak {peak(e):.1f} GiB ({peak_phase(e)})"

    for i, c in enumerate(COMMANDS):
        if a.only is None or i in a.only:
            compute(c[0], functools.partial(command, *c))
    compute(REWARDS_ROW, lambda: (reward_models(tiny=a.tiny), "done"))
    for spec in EVALUATIONS:
        def evaluation(spec=spec):
            ev = estimate_evaluate(spec, tiny=a.tiny)
            return ev, f"peak {max(ev['peak'].values()) / GIB:.1f} GiB"
        compute(spec["name"], evaluation)
    write_report(rows, a.out, tiny=a.tiny)
    print(f"{a.out}: written from {rows}", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
