"""The model families of models.py on tiny random pipelines of each (toy/tiny_families.py), saved with save_pretrained and
loaded by path as a user's would be: the project's deterministic sampler reproduces each diffusers pipeline's own
latents from the same noise; every algorithm file runs an iteration with LoRA on each, with the measured rollout NFE its
planned_nfe; the exported LoRA loads into the family's pipeline and changes its output; a resume continues bit for bit;
one-line errors for what a family cannot take."""
import os

import pytest
import torch

import common
import models
from helpers import read_metrics, run_script, tiny_flags

# name: (builder of toy/tiny_families.py, its keyword arguments, the pipeline's guidance_scale / true_cfg_scale)
FAMILIES = {
    "qwenimage": ("build_qwenimage", {}, 4.0),
    "flux2": ("build_flux2", {}, 4.0),
    "flux2-klein": ("build_flux2_klein", {}, 4.0),
    "zimage": ("build_zimage", {}, 4.0),
}
PROMPTS = ["a red circle on the left", "a blue square on the top", "a green triangle"]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """Each tiny family pipeline saved to disk once per session, and a prompt file."""
    import tiny_families
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name, (builder, kwargs, _) in FAMILIES.items():
        dirs[name] = str(root / name)
        getattr(tiny_families, builder)(**kwargs).save_pretrained(dirs[name])
    dirs["prompts"] = str(root / "prompts.txt")
    with open(dirs["prompts"], "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    return dirs


def pipeline_latents(pipe, name, prompt, guidance, steps, seed, shape):
    """The pipeline's own output latents (its own noise from a seeded generator), in the project's layout."""
    call = dict(height=32, width=32, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                output_type="latent", max_sequence_length=16)
    if name == "qwenimage":
        out = pipe(prompt=prompt, negative_prompt=" ", true_cfg_scale=guidance, **call).images
        return models.unpack(out, (1, *shape))
    out = pipe(prompt=prompt, guidance_scale=guidance, **call).images
    if name == "flux2":  # the packed tokens [1, H W, C]
        return out.permute(0, 2, 1).reshape(1, *shape)
    return out  # [klein]: the VAE's latents (de-normalised, unpatchified); Z-Image: the latents


@pytest.mark.parametrize("name", FAMILIES)
def test_the_sampler_reproduces_the_pipeline(family_dirs, name):
    """The same initial noise and the pipeline's own schedule: common.ode_complete (the evaluations' and the
    rollouts' deterministic sampler) ends where the pipeline's __call__ ends, true CFG or guidance embedding
    included; decode gives images."""
    pipe, kind = common.load_pipeline(family_dirs[name], torch.device("cpu"))
    guidance, steps = FAMILIES[name][2], 3
    shape = common.latent_shape(pipe, kind, 32)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and len(sigmas) == steps + 1
    emb = common.encode_prompts(pipe, kind, [PROMPTS[0]], max_sequence_length=16, cfg=guidance)
    noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(7))
    ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, emb,
                               guidance=guidance, micro_batch=4)
    theirs = pipeline_latents(pipe, name, PROMPTS[0], guidance, steps, 7, shape)
    compared = models.flux2_vae_latents(pipe, ours) if name == "flux2-klein" else ours
    assert compared.shape == theirs.shape
    assert (compared - theirs).abs().max() < 1e-5, (compared - theirs).abs().max()
    assert (ours - noise).abs().max() > 1e-3  # the model moved the latents
    without = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas,
                                  common.encode_prompts(pipe, kind, [PROMPTS[0]], max_sequence_length=16,
                                                        cfg=0.0 if name == "zimage" else 1.0),
                                  guidance=0.0 if name == "zimage" else 1.0, micro_batch=4)
    assert (without - ours).abs().max() > 1e-4  # guidance acts
    images = common.decode(pipe, ours)
    assert images.shape == (1, 3, 32, 32) and images.min() >= 0 and images.max() <= 1


def written_out_cfg(name, cond, uncond, g):
    """Each family's guided velocity from its two predictions, as its pipeline's __call__ writes it."""
    if name == "zimage":  # pos + g (pos - neg) on the model's output, which is minus the velocity
        return cond + g * (cond - uncond)
    guided = uncond + g * (cond - uncond)
    if name == "qwenimage":  # the guided prediction rescaled per token to the conditional one's norm
        c, p = models.pack(cond), models.pack(guided)
        return models.unpack(p * (c.norm(dim=-1, keepdim=True) / p.norm(dim=-1, keepdim=True)), cond.shape)
    return guided


@pytest.mark.parametrize("name", ["sd3", "qwenimage", "flux2-klein", "zimage", "toy"])
def test_the_guidance_gradient_flows_through_both_halves_unless_detached(family_dirs, tiny, name):
    """The training forward's parameter gradient with true CFG is that of the guided expression written out
    from the two predictions (each one a conditional forward), through both, g dv_cond - (g - 1) dv_uncond
    (Flow-GRPO since a482878), or with --detach-uncond through the conditional one only (g dv_cond); the two
    differ. The toy's Flux has a guidance embedding and no CFG: its gradient is bitwise the same both ways."""
    path = {"sd3": tiny["sd3"], "toy": common.MODEL_ALIASES["toy"]}.get(name) or family_dirs[name]
    pipe, kind = common.load_pipeline(path, torch.device("cpu"))
    g = 3.5 if name == "toy" else 4.0
    emb = common.encode_prompts(pipe, kind, PROMPTS[:2], max_sequence_length=16, cfg=g)
    shape = common.latent_shape(pipe, kind, 32)
    x = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    projection = torch.randn((2, *shape), generator=torch.Generator().manual_seed(1))
    params = list(pipe.transformer.parameters())
    pipe.transformer.requires_grad_(True)

    def grads(v):
        return torch.autograd.grad((v * projection).sum(), params, allow_unused=True)

    def trained(detach_uncond):
        return grads(common.velocity(pipe.transformer, kind, x, 0.6, emb, guidance=g, detach_uncond=detach_uncond))
    both, detached = trained(False), trained(True)
    differ = max((a - b).abs().max().item() for a, b in zip(both, detached) if a is not None)
    if name == "toy":
        assert not any(k.startswith("neg_") for k in emb) and differ == 0
        return
    off = 0.0 if name == "zimage" else 1.0  # no CFG: the conditional prediction alone
    cond = {k: v for k, v in emb.items() if not k.startswith("neg_")}
    uncond = {**cond, **{k[len("neg_"):]: v for k, v in emb.items() if k.startswith("neg_")}}
    for detach_uncond, ours in ((False, both), (True, detached)):
        v_cond = common.velocity(pipe.transformer, kind, x, 0.6, cond, guidance=off, detach_uncond=False)
        v_uncond = common.velocity(pipe.transformer, kind, x, 0.6, uncond, guidance=off, detach_uncond=False)
        v_uncond = v_uncond.detach() if detach_uncond else v_uncond
        expected = grads(written_out_cfg(name, v_cond, v_uncond, g))
        error = max((a - b).abs().max().item() for a, b in zip(ours, expected) if b is not None)
        scale = max(b.abs().max().item() for b in expected if b is not None)
        assert error < 1e-5 * scale, (error, scale)  # float32 (SD3, Z-Image: [neg; pos] in one forward)
    assert differ > 0.05 * scale, (differ, scale)  # the other behaviour fails the check above
    pipe.transformer.requires_grad_(False)


CASES = {  # file: flags on top of tiny_flags (4 steps), as tests/test_resume.py runs them
    "flow_grpo.py": {}, "densegrpo.py": {"dense_ode_steps": 2}, "diffusion_nft.py": {}, "awm.py": {"train_timesteps": 2},
    "dancegrpo.py": {"updates_per_iteration": 1, "no_full_finetune": True},
    "g2rpo.py": {"sde_steps": "0 1", "lambdas": "1 2", "updates_per_iteration": 2, "no_full_finetune": True},
    "mixgrpo.py": {"window_size": 2, "updates_per_iteration": 1, "no_full_finetune": True},
    "dgpo.py": {"trunc_steps": 2, "train_timesteps": 2}, "flow_dppo.py": {"sde_steps": 1},
    "dpo.py": {"timestep_fraction": 0.5}, "crd.py": {"train_timesteps": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("script", CASES)
def test_every_file_trains_every_family_with_lora(family_dirs, tmp_path, script, name):
    """One iteration with LoRA and a checkpoint; the rollout NFE is the file's planned_nfe."""
    flags = dict(CASES[script], num_iterations=1, eval_every=0, log_images_every=0, save_every=1)
    proc = run_script(script, tiny_flags(family_dirs[name], family_dirs["prompts"], tmp_path, **flags))
    run, m = read_metrics(tmp_path)
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] > 0
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_1", "lora", "pytorch_lora_weights.safetensors"))
    assert m[1]["train/grad_norm"] > 0  # (the evaluation's sampler: test_the_sampler_reproduces_the_pipeline)
    assert f"from diffusers import {type_name(name)}" in proc.stdout  # the summary's loading snippet


def type_name(name):
    return {"qwenimage": "QwenImagePipeline", "flux2": "Flux2Pipeline", "flux2-klein": "Flux2KleinPipeline",
            "zimage": "ZImagePipeline"}[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_the_exported_lora_loads_into_the_pipeline_and_resumes_bit_for_bit(family_dirs, tmp_path, name):
    """flow_grpo.py, 2 iterations straight and 1 + --resume 1: the same adapter, bit for bit; diffusers'
    load_lora_weights takes it (its alpha with it) and the pipeline's output moves."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    flags = dict(num_iterations=2, eval_every=0, log_images_every=0, save_every=1, learning_rate=1e-2,
                 no_ema=True)  # the export holds the trained adapter, not an EMA that has not stepped yet
    run_script("flow_grpo.py", tiny_flags(family_dirs[name], family_dirs["prompts"], tmp_path / "a", **flags))
    run_script("flow_grpo.py", tiny_flags(family_dirs[name], family_dirs["prompts"], tmp_path / "b",
                                          **{**flags, "num_iterations": 1}))
    run_b, _ = read_metrics(tmp_path / "b")
    run_script("flow_grpo.py", tiny_flags(family_dirs[name], family_dirs["prompts"], tmp_path / "b", resume=run_b,
                                          **flags))
    (run_a, _), lora = read_metrics(tmp_path / "a"), "checkpoints/iter_2/lora/pytorch_lora_weights.safetensors"
    a, b = load_file(os.path.join(run_a, lora)), load_file(os.path.join(run_b, lora))
    assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)
    pipe = DiffusionPipeline.from_pretrained(family_dirs[name])
    pipe.set_progress_bar_config(disable=True)
    shape = common.latent_shape(pipe, common.family_of(pipe), 32)
    before = pipeline_latents(pipe, name, PROMPTS[0], FAMILIES[name][2], 2, 0, shape)
    pipe.load_lora_weights(os.path.dirname(os.path.join(run_a, lora)))
    (config,) = pipe.transformer.peft_config.values()
    assert (config.r, config.lora_alpha) == (4, 8)
    after = pipeline_latents(pipe, name, PROMPTS[0], FAMILIES[name][2], 2, 0, shape)
    assert (after - before).abs().max() > 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwenimage"])  # its last block has modules no gradient reaches
def test_full_fine_tuning_under_fsdp2_on_two_processes(family_dirs, tmp_path, name):
    """flow_grpo.py --full-finetune on 2 processes: FSDP2 over the family's blocks; the sharded export loads as the
    family's transformer class and differs from the base. The prompts go through a --text-cache the ranks fill."""
    from diffusers import DiffusionPipeline

    flags = dict(full_finetune=True, no_ema=True, prompts_per_iteration=4, num_iterations=1, eval_every=1, eval_num=2, log_images_every=0, save_every=1,
                 learning_rate=1e-3, text_cache=f"{tmp_path}_cache")  # the 2 ranks share the encoding
    run_script("flow_grpo.py", tiny_flags(family_dirs[name], family_dirs["prompts"], tmp_path, **flags), nproc=2)
    run, m = read_metrics(tmp_path)
    assert len([f for f in os.listdir(f"{tmp_path}_cache") if len(f) == 52]) == len(PROMPTS)  # <sha>.safetensors
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"]
    base = DiffusionPipeline.from_pretrained(family_dirs[name]).transformer
    trained = type(base).from_pretrained(os.path.join(run, "checkpoints", "iter_1", "transformer"))
    a, b = base.state_dict(), trained.state_dict()
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)


def test_what_a_family_cannot_take_is_one_line(family_dirs, tmp_path, monkeypatch):
    """A pipeline class no family handles; a --guidance that a step-distilled [klein] ignores; a resolution its VAE
    and patches cannot tile; LoRA targets the transformer lacks."""
    import diffusers

    import tiny_families
    pipe = diffusers.DiffusionPipeline.from_pretrained(family_dirs["qwenimage"])
    other = str(tmp_path / "img2img")
    diffusers.QwenImageImg2ImgPipeline(**pipe.components).save_pretrained(other)
    with pytest.raises(SystemExit) as e:
        common.load_pipeline(other, torch.device("cpu"))
    assert str(e.value).startswith(f"error: model {other!r} is a QwenImageImg2ImgPipeline; the pipelines this project "
                                   f"trains are FluxPipeline, StableDiffusion3Pipeline, QwenImagePipeline, ")
    distilled = str(tmp_path / "klein-distilled")
    tiny_families.build_flux2_klein(distilled=True).save_pretrained(distilled)
    proc = run_script("flow_grpo.py", tiny_flags(distilled, family_dirs["prompts"], tmp_path / "out", guidance=4.5),
                      check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "error: --guidance 4.5 is ignored by this Flux2KleinPipeline (guidance-distilled: no guidance input "
        "and no CFG); pass --guidance 1")
    klein, kind = common.load_pipeline(distilled, torch.device("cpu"))
    common.check_guidance(klein, kind, 1.0)  # no error
    with pytest.raises(SystemExit, match=r"^error: --resolution 30 is not allowed for this model; use a positive "
                                         r"multiple of 4$"):  # the tiny VAEs compress 2x, then 2x2 patches
        common.latent_shape(klein, kind, 30)
    qwen, kind = common.load_pipeline(family_dirs["qwenimage"], torch.device("cpu"))
    monkeypatch.setitem(models.FAMILIES["qwenimage"], "lora_targets", lambda t: ["attn.to_qkv", "ff.linear_in"])
    with pytest.raises(SystemExit) as e:
        common.make_trainable(qwen.transformer, kind, lora=(4, 8), reference=False)
    assert str(e.value) == ("error: none of the LoRA targets ['attn.to_qkv', 'ff.linear_in'] is a linear layer of this "
                            "QwenImageTransformer2DModel; its family's lora_targets (models.py) must name layers it has")


@pytest.mark.parametrize("name,guidance", [("qwenimage", 4.0), ("zimage", 4.0), ("flux2-klein", 4.0), ("flux2", 4.0)])
def test_the_text_cache_gives_the_encoders_embeddings(family_dirs, tmp_path, name, guidance):
    """rundir.fill_text_cache: each prompt's file (a masked embedding cut to its tokens, the negative prompt's
    once), then no text encoder in the pipeline and encode_prompts reads what the encoders gave, bit for bit;
    another --max-sequence-length on the same directory and a prompt that is not there stop in one line."""
    import rundir
    pipe, kind = common.load_pipeline(family_dirs[name], torch.device("cpu"))
    direct = common.encode_prompts(pipe, kind, PROMPTS, max_sequence_length=16, cfg=guidance)
    negative = name != "flux2"  # true CFG: the negative prompt's embeddings as well ([dev]: a guidance input)
    assert any(k.startswith("neg_") for k in direct) == negative
    cache = str(tmp_path / "cache")
    rundir.fill_text_cache(pipe, kind, PROMPTS + PROMPTS[:1], directory=cache, device=torch.device("cpu"),
                           max_sequence_length=16, cfg=guidance)
    assert pipe.text_encoder is None and sorted(os.listdir(cache)) == sorted(
        [os.path.basename(rundir.text_cache_file(cache, p)) for p in PROMPTS] + ["meta.json"]
        + ["negative.safetensors"] * negative)
    cached = common.encode_prompts(pipe, kind, PROMPTS[::-1], max_sequence_length=16, cfg=guidance)
    assert cached.keys() == direct.keys()
    for k, v in direct.items():
        assert cached[k].dtype == v.dtype and torch.equal(cached[k], v.flip(0)), k
    with pytest.raises(SystemExit) as e:
        common.encode_prompts(pipe, kind, ["a prompt of another set"], max_sequence_length=16, cfg=guidance)
    assert str(e.value) == (f"error: prompt 'a prompt of another set' is not in the text cache {cache!r} (a file was "
                            f"removed); run again")
    again, _ = common.load_pipeline(family_dirs[name], torch.device("cpu"))
    with pytest.raises(SystemExit) as e:
        rundir.fill_text_cache(again, kind, PROMPTS, directory=cache, device=torch.device("cpu"),
                               max_sequence_length=8, cfg=guidance)
    assert str(e.value) == (f"error: --text-cache {cache!r} holds the embeddings of another --max-sequence-length "
                            f"(16); pass an empty or a new directory")
