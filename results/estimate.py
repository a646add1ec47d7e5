"""Per-GPU peak memory and compute per iteration of the README's command lines, estimated on a CPU.

    python results/estimate.py               # every README command (~15 min) -> results/estimate.md
    python results/estimate.py --tiny        # the same code paths on tiny architectures (seconds; run by the tests)

Each command is parsed into its algorithm file's own `Args` (tyro). The real architectures (the FLUX.1-dev and SD3.5-M
transformers, T5-XXL and CLIP text encoders, the VAE, open_clip ViT-H-14 / PickScore reward models) are built under
`FakeTensorMode`: shapes and dtypes only, no data, no memory. Full fine-tuning is sharded with `common.shard` (FSDP2,
bf16 compute, float32 master shards) over a fake process group of the command's world size; LoRA runs hold bf16 frozen
weights and float32 adapters from `common.make_trainable`. One iteration's phases then run on one rank with the shapes
the file uses: prompt encoding; the rollout (`common.gathered` weights, the stored latents / log-probs / velocities of
all steps, a no-grad `common.velocity` forward of one micro-batch, `common.ode_complete`'s buffers, `common.decode` of
one VAE batch, a reward forward); one training micro-batch (`velocity` with grad, `sde_step`, `reference_kl`,
`clipped_policy_loss`, backward) and the optimizer step; evaluation. `torch.distributed._tools.MemTracker` gives each
phase's peak; `FlopCounterMode` the FLOPs of one forward, one training forward + backward, one decode and one reward
call, multiplied by the file's own closed-form NFE (`planned_nfe`). Not modelled: communication time, the allocator's
fragmentation (keep ~10% headroom), CUDA context and kernels (~0.5-1 GiB), autocast (these runs use none: LoRA and
FSDP2 compute in bf16 directly, as the files do on GPUs).
"""
import argparse
import contextlib
import importlib
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "toy")]
GIB = 2**30

# The README's command lines: (name, script, arguments, GPUs). Single-GPU entry points come last.
DANCE = ("--model flux-dev --resolution 720 --guidance 3.5 --max-sequence-length 512 --schedule shifted --num-steps 16 "
         "--group-size 12 --noise-form dance --noise-level 0.3 --timestep-selection random --timestep-fraction 0.6 "
         "--same-init-noise --rewards hps clip --reward-combine advantages --no-global-std --std-unbiased --adv-eps 1e-8 "
         "--beta 0 --no-ema --micro-batch 4")
COMMANDS = [
    ("Flow-GRPO, SD3.5-M, PickScore (LoRA)", "flow_grpo", "", 8),
    ("Flow-GRPO, FLUX.1-dev, PickScore (LoRA)", "flow_grpo", "--model flux-dev --num-steps 6 --eval-steps 28 "
     "--noise-level 0.9 --beta 0 --guidance 3.5 --lora-rank 64 --lora-alpha 128", 8),
    ("DanceGRPO, FLUX.1-dev, HPS + CLIP (full FT)", "flow_grpo", DANCE + " --prompts-per-iteration 16 --full-finetune "
     "--learning-rate 1e-5 --updates-per-iteration 3", 16),
    ("G2RPO, FLUX.1-dev, HPS + CLIP, Lambda {1,2,3} (full FT)", "g2rpo", "--lambdas 1 2 3", 16),
    ("DenseGRPO, SD3.5-M, PickScore, n = t (LoRA)", "densegrpo", "", 8),
    ("DenseGRPO, SD3.5-M, n = 1 (LoRA)", "densegrpo", "--dense-ode-steps 1", 8),
    ("1 GPU: Flow-GRPO, SD3.5-M (LoRA)", "flow_grpo", "--prompts-per-iteration 2 --eval-num 64", 1),
    ("1 GPU: DenseGRPO, SD3.5-M (LoRA)", "densegrpo", "--prompts-per-iteration 1 --eval-num 64", 1),
    ("1 GPU: DanceGRPO, FLUX.1-dev (LoRA)", "flow_grpo", DANCE + " --prompts-per-iteration 1 --no-full-finetune "
     "--lora-rank 64 --lora-alpha 128 --learning-rate 1e-4 --updates-per-iteration 3 --eval-num 64", 1),
    ("1 GPU: G2RPO, FLUX.1-dev (LoRA)", "g2rpo", "--lambdas 1 2 3 --prompts-per-iteration 1 --no-full-finetune "
     "--lora-rank 64 --lora-alpha 128 --learning-rate 1e-4 --eval-num 64", 1),
]
PEAK_TFLOPS = {"A100": 312, "H100": 989}  # dense bf16 tensor-core peaks (SXM)


# ---------------------------------------------------------------- architectures (configs of the released checkpoints)
def architectures(kind: str, tiny: bool):
    """(transformer, [text encoders], vae) constructors for FLUX.1-dev / SD3.5-M, or tiny stand-ins with the same code."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if tiny:
        from tiny import _t5, _text_config, build_flux, build_sd3, tiny_vae

        pipe = build_flux() if kind == "flux" else build_sd3()
        text = [lambda: CLIPTextModel(_text_config(30, 32, 16)), lambda: _t5(30, 32)]
        return (lambda: type(pipe.transformer)(**pipe.transformer.config)), text, tiny_vae
    t5 = lambda: T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,  # noqa: E731
                                         num_heads=64, feed_forward_proj="gated-gelu"))
    clip_l = lambda: CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=768, intermediate_size=3072,  # noqa: E731
                                                                num_hidden_layers=12, num_attention_heads=12, projection_dim=768))
    clip_g = lambda: CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120,  # noqa: E731
                                                                num_hidden_layers=32, num_attention_heads=20,
                                                                projection_dim=1280, hidden_act="gelu"))
    vae = lambda: AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,  # noqa: E731
                                block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                                use_quant_conv=False, use_post_quant_conv=False)
    if kind == "flux":
        return (lambda: FluxTransformer2DModel(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                                               num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                                               guidance_embeds=True, axes_dims_rope=(16, 56, 56))), [clip_l, t5], vae
    return (lambda: SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                                          num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                                          pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                                          dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")), [clip_l, clip_g, t5], vae


def reward_model(name: str, tiny: bool):
    """(constructor, image size) of a reward: open_clip ViT-H-14 (HPS at 224, DFN5B CLIP at 384) or PickScore's CLIP-H."""
    if tiny or name.startswith("toy") or name == "jpeg":
        return None, 0
    if name == "pickscore":
        from transformers import CLIPConfig, CLIPModel

        return lambda: CLIPModel(CLIPConfig(text_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                             num_attention_heads=16), projection_dim=1024,
                                            vision_config=dict(hidden_size=1280, intermediate_size=5120,
                                                               num_hidden_layers=32, num_attention_heads=16,
                                                               patch_size=14))), 224
    import open_clip

    size = 224 if name == "hps" else 384
    return lambda: open_clip.create_model("ViT-H-14", pretrained=None, force_image_size=size, device="meta"), size


# ---------------------------------------------------------------- one command
class Sigmas(list):
    """A schedule for fake-tensor runs: Python floats for one index (the SDE's coefficients), a tensor for a list of
    indices (ode_complete); indexing a real tensor under FakeTensorMode would give a fake one."""

    def __getitem__(self, i):
        return torch.tensor([list.__getitem__(self, j) for j in i]) if isinstance(i, list) else list.__getitem__(self, i)


def nbytes(*objs) -> int:
    """Bytes of the distinct storages behind modules' parameters and buffers, optimizers' states and tensors."""
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


UNDO = {  # each change of this project's memory work, undone alone: (what the code did before, how it is measured)
    "bf16 compute weights": "FSDP2 gathered float32 weights (autocast then cast them per op) (measured)",
    "activation checkpointing": "every block's activations kept for the backward pass (measured)",
    "text encoders off the GPU": "T5 and CLIP resident on every GPU (added)",
    "bf16 reward models": "reward models held in float32 (added)",
    "decoding 4 at a time": "a whole micro-batch decoded at once (measured)",
    "indexed embeddings": "DenseGRPO copied every prompt embedding per completion row (added)",
    "sharded reference": "full fine-tuning's reference an unsharded copy on every GPU (added)",
}


def estimate(name, script, argv, world, tiny=False, undo=(), phases=None):
    """One command's per-rank phases: {"peak": {phase: bytes}, "flops": {phase: FLOPs}, "bytes": resident parts, ...}.
    `undo`: changes of UNDO to revert (measured ones); `phases`: run only these."""
    import tyro
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    import common

    class Tracker(MemTracker):
        """MemTracker's totals only: every live tensor given to track_external plus every storage the ops create (new
        gradients included), without its per-module bookkeeping (which assumes trainable modules called once)."""

        def _pre_fw_hook(self, *a):
            pass

        _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

    mod = importlib.import_module(script)
    args = tyro.cli(mod.Args, args=argv.split())
    if tiny:
        args.resolution, args.max_sequence_length = 32, 16
    mod.check_args(args, world)
    kind, beta, nfe = ("flux" if "flux" in args.model else "sd3"), getattr(args, "beta", 0.0), mod.planned_nfe(args)
    P, G, T = args.prompts_per_iteration // world, args.group_size, args.num_steps
    mb, bf16, sharded = min(args.micro_batch, P * G), torch.bfloat16, args.full_finetune and world > 1
    checkpointing = args.gradient_checkpointing and "activation checkpointing" not in undo
    fp32_gathers = sharded and "bf16 compute weights" in undo  # the old policy: float32 weights gathered
    make_t, text_cls, vae_cls = architectures(kind, tiny)
    C, H, W = (4 if tiny else 16), args.resolution // (2 if tiny else 8), args.resolution // (2 if tiny else 8)
    txt_dim, pooled_dim = ((32, 32) if kind == "flux" else (64, 64)) if tiny else (4096, 768 if kind == "flux" else 2048)
    tokens, cfg = args.max_sequence_length + (0 if kind == "flux" else 77), kind == "sd3" and args.guidance > 1
    out = {"name": name, "world": world, "args": args, "nfe": nfe, "P": P, "mb": mb, "script": script,
           "tokens": tokens, "txt_dim": txt_dim, "cfg": cfg, "sharded": sharded, "checkpointing": args.gradient_checkpointing}

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = None
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def build(make, dtype, prepare=lambda m: m):
        """Build on the meta device (peft and .to() cannot handle fake parameters), then swap in fake CPU tensors."""
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            module = prepare(make())
        torch.set_default_dtype(torch.float32)
        memo = {}
        with fake:
            for m in module.modules():
                for is_param, store in ((True, m._parameters), (False, m._buffers)):
                    for k, t in list(store.items()):
                        if t is not None:
                            if id(t) not in memo:  # tied weights stay tied
                                f = fake.from_tensor(t).to("cpu")
                                memo[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if is_param else f
                            store[k] = memo[id(t)]
        return module

    t0 = time.time()
    if sharded:  # as common.make_trainable: bf16 reference, float32 master shards, common.shard's FSDP2 policy
        with fake:
            torch.set_default_dtype(bf16)
            ref = make_t().requires_grad_(False) if beta > 0 else None
            torch.set_default_dtype(torch.float32)
            transformer = make_t()
            for m in [transformer] + ([ref] if ref is not None else []):
                common.shard(m, None if fp32_gathers else bf16, mesh)
            if checkpointing:
                transformer.enable_gradient_checkpointing()
        params = list(transformer.parameters())
    else:  # LoRA (or one GPU): bf16 frozen weights, float32 trainable ones, from common.make_trainable itself
        box = {}

        def prepare(t):
            box["ref"] = common.make_trainable(t.requires_grad_(False), kind, args.lora_rank, args.lora_alpha,
                                               args.full_finetune, beta > 0, False, bf16, checkpointing)[1]
            return t
        transformer = build(make_t, bf16, prepare)
        params, ref = [p for p in transformer.parameters() if p.requires_grad], box["ref"]
        if ref is not None:
            raise SystemExit("error: the estimator does not model one-GPU full fine-tuning with a KL (pass --beta 0)")
    vae = build(vae_cls, bf16).requires_grad_(False)
    rewards = {r: reward_model(r, tiny) for r in dict.fromkeys(args.rewards + args.eval_rewards)}
    rewards = {r: (build(m, bf16).requires_grad_(False).eval(), s) for r, (m, s) in rewards.items() if m is not None}
    texts = [build(c, bf16).requires_grad_(False) for c in text_cls]
    sigmas = Sigmas(common.sigma_schedule(T, 3.0).tolist())
    n_params = sum(p.numel() for p in make_t().parameters()) if tiny else None
    with fake:
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        for p in params:  # Adam's states exist after the first step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema = [p.detach().float().clone() for p in params] if args.ema else []
        resident = [transformer, vae, optimizer, *[m for m, _ in rewards.values()]] + ([ref] if ref is not None else []) + ema
        trainable = nbytes(*params) if not sharded else nbytes(transformer)
        out["bytes"] = {"frozen transformer (bf16)": nbytes(transformer) - trainable if not sharded else 0,
                        "trainable (float32)": trainable, "Adam states": nbytes(optimizer),
                        "reference (bf16)": nbytes(ref) if ref is not None else 0, "EMA": nbytes(*ema), "VAE": nbytes(vae),
                        "reward models (bf16)": sum(nbytes(m) for m, _ in rewards.values()),
                        "text encoders (on the CPU between encodings)": sum(nbytes(m) for m in texts)}
        out["n_params"] = n_params or sum(p.numel() for p in (transformer.parameters() if not sharded else []))
        if sharded:
            out["n_params"] = sum(p.numel() for p in transformer.parameters())  # DTensors: the full sizes
        emb = {"embeds": torch.randn(P, tokens, txt_dim, dtype=bf16), "pooled": torch.randn(P, pooled_dim, dtype=bf16)}
        if cfg:
            emb.update(neg_embeds=emb["embeds"].clone(), neg_pooled=emb["pooled"].clone())
        rows = torch.zeros(mb, dtype=torch.long)

        def phase(label, fn, *live):
            if phases is not None and label not in phases:
                return
            tracker = Tracker()
            tracker.track_external(*resident, *live)
            with tracker:
                fn()
            out.setdefault("peak", {})[label] = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
            if not undo:  # FLOPs in a pass of their own: FlopCounterMode keeps some tensors alive longer
                with FlopCounterMode(display=False) as flops:
                    fn()
                out.setdefault("flops", {})[label] = flops.get_total_flops()

        # -------- encoding: the text encoders visit the GPU for the iteration's prompts (and CFG's negatives)
        ids = torch.zeros(min(16, P) * (2 if cfg else 1), args.max_sequence_length, dtype=torch.long)  # 16 at a time

        def encode():
            with torch.no_grad():
                for m in texts:
                    m(input_ids=ids[:, :77] if "CLIP" in type(m).__name__ else ids)
        phase("encode", encode, *texts)

        # -------- rollout: what the file keeps for the whole iteration, then one of each kind of call
        L = len(getattr(args, "lambdas", (1,)))
        full = lambda n: torch.zeros(n, 3, args.resolution, args.resolution)  # noqa: E731 (decoded images, float32)
        if script == "g2rpo":  # the anchor's x_k (float32) and v(x_k) (bf16), post-SDE latents, the last k's x0 and images
            kept = [torch.zeros(P, C, H, W) for _ in range(max(args.sde_steps) + 1)]
            kept += [torch.zeros(P, C, H, W, dtype=bf16) for _ in range(max(args.sde_steps) + 1)]
            kept += [torch.zeros(P * G, C, H, W) for _ in args.sde_steps] + [torch.zeros(L * P * G, C, H, W), full(L * P * G)]
        else:  # every latent of every trajectory (float32); DenseGRPO: the sampler's velocities (bf16) and all x0
            kept = [torch.zeros(P * G, C, H, W) for _ in range(T + 1)] + ([full(P * G)] if script == "flow_grpo" else [])
            if script == "densegrpo":
                kept += [torch.zeros(P * G, C, H, W, dtype=bf16) for _ in range(T)] + [torch.zeros((T + 1) * P * G, C, H, W)]
        kept.append(torch.zeros(T, P * G))  # log-probs
        scored = {"flow_grpo": P * G, "g2rpo": L * P * G}.get(script, mb)  # images per reward call, as the files score
        out["scored"] = scored
        x = torch.zeros(mb, C, H, W)

        def rollout():
            with torch.no_grad(), common.gathered(transformer, sharded):
                common.velocity(transformer, kind, x, sigmas[1], common.select(emb, rows), args.guidance)
                if script != "flow_grpo":  # the completions' buffers (one step: v_first given) and one more forward
                    n = T * P * G if script == "densegrpo" else P * G
                    reps = 1 if script == "densegrpo" else len(args.lambdas)
                    start = torch.zeros(n, C, H, W)
                    common.ode_complete(transformer, kind, start, [[0, 1]] * (n * reps), sigmas, emb, args.guidance, mb,
                                        v_first=torch.zeros(n, C, H, W), emb_index=torch.zeros(n, dtype=torch.long))
                    common.velocity(transformer, kind, x, sigmas[1], common.select(emb, rows), args.guidance)
        phase("rollout", rollout, *kept)

        def decode():  # inside the rollout's gathered weights, as in the files
            with torch.no_grad(), common.gathered(transformer, sharded):
                n = mb if "decoding 4 at a time" in undo else min(4, mb)
                common.decode(type("Pipe", (), {"vae": vae})(), torch.zeros(n, C, H, W))
        phase("decode", decode, *kept)

        def reward_forward(n):
            for m, size in rewards.values():
                (m.encode_image if hasattr(m, "encode_image") else m.get_image_features)(
                    torch.zeros(n, 3, size, size, dtype=bf16))

        def score():
            with torch.no_grad(), common.gathered(transformer, sharded):
                reward_forward(scored)
        phase("rewards", score, full(scored), *kept)

        # -------- training: one micro-batch forward + backward with the stored rollout, then the optimizer step
        train_rows = mb if script != "g2rpo" else min(args.micro_batch, P)

        def train():
            xt, nxt = torch.zeros(train_rows, C, H, W), torch.zeros(train_rows, C, H, W)
            v = common.velocity(transformer, kind, xt, sigmas[1], common.select(emb, rows[:train_rows]), args.guidance)
            _, log_prob, mean, std = common.sde_step(v, xt, sigmas, 1, args.noise_level, prev_sample=nxt)
            kl = None
            if beta > 0:
                kl = common.reference_kl(ref or transformer, kind, xt, sigmas, 1, common.select(emb, rows[:train_rows]),
                                         args.guidance, args.noise_level, nxt, "flow_grpo", mean, std, ref is None)
            loss, _, _ = common.clipped_policy_loss(log_prob, log_prob.detach(), torch.ones(train_rows), 1e-4, kl, beta)
            loss.backward()
        phase("training step", train, *kept)

        def step():
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phase("optimizer step", step, *kept)

        # -------- evaluation: this rank's eval pairs, encoded together, ODE in micro-batches, scored together
        n_eval = args.eval_num // world

        e_ids = torch.zeros(min(16, n_eval) * (2 if cfg else 1), args.max_sequence_length, dtype=torch.long)

        def eval_encode():  # this rank's evaluation prompts, 16 at a time (common.encode_prompts), before any gathering
            with torch.no_grad():
                for m in texts:
                    m(input_ids=e_ids[:, :77] if "CLIP" in type(m).__name__ else e_ids)
        phase("evaluation encode", eval_encode, *texts)
        e_emb = {k: torch.zeros(n_eval, *v.shape[1:], dtype=v.dtype) for k, v in emb.items()}

        def evaluate():  # the ODE in micro-batches with gathered weights, then decoding and scoring every image at once
            latents, eval_mb = torch.zeros(n_eval, C, H, W), min(args.micro_batch, n_eval)
            with torch.no_grad(), common.gathered(transformer, sharded):
                common.velocity(transformer, kind, latents[:eval_mb], sigmas[1], common.select(e_emb, rows[:1].expand(eval_mb)),
                                args.guidance)
            with torch.no_grad():
                images = torch.zeros(n_eval, 3, args.resolution, args.resolution)
                common.decode(type("Pipe", (), {"vae": vae})(), torch.zeros(min(4, eval_mb), C, H, W))
                reward_forward(n_eval)
                del images
        phase("evaluation", evaluate, *e_emb.values())
    dist.destroy_process_group()
    out["seconds_to_estimate"] = time.time() - t0
    return out


def peak(e, undo=()):
    """The largest phase (GiB), with the added (not re-measured) parts of `undo` put back."""
    b, a = e["bytes"], e["args"]
    add = {k: 0.0 for k in e["peak"]}
    for k in add:
        if "text encoders off the GPU" in undo and k not in ("encode", "evaluation encode"):
            add[k] += b["text encoders (on the CPU between encodings)"]
        if "bf16 reward models" in undo:
            add[k] += b["reward models (bf16)"]
        if "indexed embeddings" in undo and e["script"] == "densegrpo" and k == "rollout":
            add[k] += (a.num_steps * e["P"] * a.group_size * e["tokens"] * e["txt_dim"] * 2) * (2 if e["cfg"] else 1)
        if "sharded reference" in undo and b["reference (bf16)"]:
            add[k] += b["reference (bf16)"] * (e["world"] - 1)
    return max(v + add[k] for k, v in e["peak"].items()) / GIB


def per_iteration(e):
    """FLOPs per rank and iteration (evaluation not included) from the measured calls and the file's closed-form NFE."""
    a, P, fl, mb = e["args"], e["P"], e["flops"], e["mb"]
    fwd = fl["rollout"] / (mb * (1 if e["script"] == "flow_grpo" else 2))  # per sample (a CFG pair counts once)
    reward = fl["rewards"] / e["scored"]
    train = fl["training step"] / (mb if e["script"] != "g2rpo" else min(a.micro_batch, P))  # incl. the reference's
    images = P * a.group_size * {"flow_grpo": 1, "densegrpo": a.num_steps + 1}.get(
        e["script"], len(getattr(a, "lambdas", ())) * len(getattr(a, "sde_steps", ())))
    decoded = mb if "decoding 4 at a time" in e.get("undo", ()) else min(4, mb)
    return (fl["encode"] + P * (e["nfe"]["rollout"] * fwd + e["nfe"]["train"] * train)
            + images * (fl["decode"] / decoded + reward))


def startup(e, before=False):
    """GiB on a GPU while the model loads: the bf16 transformer (and a bf16 reference copy) before sharding; the old
    code converted to float32 first, so a whole float32 model sat on every GPU."""
    if not e["sharded"]:
        return None
    n, ref = e["n_params"], e["bytes"]["reference (bf16)"] > 0  # the VAE and reward models are already loaded
    return (n * ((4 if before else 2) + 2 * ref) + e["bytes"]["VAE"] + e["bytes"]["reward models (bf16)"]) / GIB


def report(estimates, path, seconds):
    lines = ["# Estimated per-GPU memory and compute of the README's command lines", "",
             f"Made by `python results/estimate.py` ({seconds / 60:.0f} minutes on a 2-core CPU; fake tensors, see its "
             "docstring for what is and is not modelled). GiB per GPU: the resident state (trainable weights, Adam "
             "states, frozen weights, reference, VAE, reward models; this rank's shards under FSDP2) plus each phase's "
             "transient memory (activations, gathered weights, stored rollout tensors). The 80 GB cards need the peak at "
             "or below 70 GiB, which leaves room for the allocator's fragmentation and the CUDA context.", "",
             "| command | GPUs | resident | encode | rollout | decode | rewards | training step | optimizer step | "
             "evaluation encode | evaluation | **peak** | start-up | TFLOP / rank / iteration | seconds / iteration, A100 / "
             "H100 at 40% MFU | A100-hours / iteration |", "|---|" + "---|" * 15]
    for e in estimates:
        res = sum(v for k, v in e["bytes"].items() if not k.startswith("text"))
        pk, tf = e["peak"], per_iteration(e) / 1e12
        up = startup(e)
        lines.append(f"| {e['name']} | {e['world']} | {res / GIB:.1f} | " + " | ".join(f"{pk[k] / GIB:.1f}" for k in (
            "encode", "rollout", "decode", "rewards", "training step", "optimizer step", "evaluation encode", "evaluation"))
            + f" | **{peak(e):.1f}** | {'-' if up is None else f'{up:.1f}'} | {tf:,.0f} | "
            + " / ".join(f"{tf / (PEAK_TFLOPS[g] * 0.4):,.0f}" for g in ("A100", "H100"))
            + f" | {tf * e['world'] / (PEAK_TFLOPS['A100'] * 0.4) / 3600:.2f} |")
    lines += ["", "## Resident state per GPU (GiB)", "", "| command | " + " | ".join(estimates[0]["bytes"]) + " |",
              "|---|" + "---|" * len(estimates[0]["bytes"])]
    for e in estimates:
        lines.append(f"| {e['name']} | " + " | ".join(f"{v / GIB:.2f}" for v in e["bytes"].values()) + " |")
    lines += ["", "## Each change undone alone: the peak per GPU (GiB) with the code as it was before", "",
              "Measured: the phases re-run with the old behaviour; added: the part put back on top. Start-up: the "
              "float32 conversion before sharding. Rollout all-gathers: what one rank receives per iteration for the "
              "rollout's forwards (weights gathered once, in bf16, against float32 weights re-gathered at every "
              "forward).", "", "| command | now | " + " | ".join(UNDO) + " | start-up before -> now | rollout all-gathers "
              "per iteration, before -> now |", "|---|---|" + "---|" * (len(UNDO) + 2)]
    for e in estimates:
        cells = []
        for change in UNDO:
            b = e.get("undone", {}).get(change)
            cells.append("n/a" if b is None else f"{b:.1f}")
        up = startup(e)
        calls = math.ceil(e["nfe"]["rollout"] * e["P"] / e["mb"])
        gathers = (f"{calls * 4 * e['n_params'] / GIB:,.0f} GiB -> {2 * e['n_params'] / GIB:.0f} GiB" if e["sharded"]
                   else "none (LoRA: weights replicated)")
        lines.append(f"| {e['name']} | {peak(e):.1f} | " + " | ".join(cells) + " | "
                     + ("-" if up is None else f"{startup(e, True):.1f} -> {up:.1f}") + f" | {gathers} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def undone(name, script, argv, world, tiny, e):
    """The peak with each applicable change of UNDO reverted alone (re-measuring only the phases it touches)."""
    a, out = e["args"], {}
    for change in UNDO:
        measured = {"bf16 compute weights": ["rollout", "decode", "rewards", "training step", "evaluation"]
                    if e["sharded"] else None,
                    "activation checkpointing": ["training step"] if a.gradient_checkpointing else None,
                    "decoding 4 at a time": ["decode"] if e["mb"] > 4 else None}
        if change in measured:
            if measured[change] is None:
                continue
            again = estimate(name, script, argv, world, tiny, undo=(change,), phases=measured[change])
            out[change] = peak({**e, "peak": {**e["peak"], **again["peak"]}})
        elif (change != "indexed embeddings" or script == "densegrpo") and (
                change != "sharded reference" or e["bytes"]["reference (bf16)"]):
            out[change] = peak(e, (change,))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny architectures, the same code paths (seconds)")
    p.add_argument("--only", nargs="*", type=int, default=None, help="indices of COMMANDS to run")
    p.add_argument("--no-undo", action="store_true", help="skip the before/after table's re-measurements")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "estimate.md"))
    a = p.parse_args()
    t0, estimates = time.time(), []
    for i, (name, script, argv, world) in enumerate(COMMANDS):
        if a.only is not None and i not in a.only:
            continue
        e = estimate(name, script, argv, world, a.tiny)
        if not a.no_undo:
            e["undone"] = undone(name, script, argv, world, a.tiny, e)
        estimates.append(e)
        print(f"{name}: peak {peak(e):.1f} GiB ({time.time() - t0:.0f} s)", flush=True)
    report(estimates, a.out, time.time() - t0)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
