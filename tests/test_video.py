"""Video: the Wan family of models.py on tiny random WanPipelines (toy/tiny_video.py: Wan2.1's VAE layout and
Wan2.2-TI2V-5B's, 48 latent channels and 16x space compression) saved and loaded by path; the frame checks; image
rewards scored per frame (--frame-reduce); VideoAlign through the reward-server protocol against a local stand-in
that checks what it receives; the moving-shapes world's rewards; every algorithm file on a video model; the
animated evaluation grid."""
import io
import os
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

import common
import models
from helpers import read_metrics, run_script, tiny_flags

PROMPTS = ["a red circle moving slowly to the right", "a blue square falling quickly",
           "a green triangle rising slowly"]


@pytest.fixture(scope="session")
def wan_dirs(tmp_path_factory):
    """The two tiny WanPipelines saved once per session, and a prompt file of moving-shapes prompts."""
    import tiny_video
    root = tmp_path_factory.mktemp("wan")
    dirs = {v: str(root / f"wan{v}") for v in ("2.1", "2.2")}
    for version, path in dirs.items():
        tiny_video.build_wan(version=version).save_pretrained(path)
    dirs["prompts"] = str(root / "prompts.txt")
    with open(dirs["prompts"], "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    return dirs


SIZES = {"2.1": 32, "2.2": 64}  # 8x8 and 4x4 latents: 2x2 patches tile both


@pytest.mark.parametrize("version", ["2.1", "2.2"])
@pytest.mark.parametrize("frames", [1, 5, 9])
def test_the_sampler_reproduces_the_wan_pipeline(wan_dirs, version, frames):
    """The same seed and the anchors' rollout schedule (the shipped UniPC scheduler's sigmas and int64
    timesteps, Euler steps: tiny_video.EulerOnUniPC in the pipeline): common.ode_complete ends where
    WanPipeline's __call__ ends, with true CFG against "" and without, to 1e-5; the latents have the frame axis
    (1 + 4k frames -> 1 + k latent frames) and decode gives frames in [0, 1]."""
    import tiny_video
    pipe, kind = common.load_pipeline(wan_dirs[version], torch.device("cpu"))
    assert kind == "wan" and type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    size, steps = SIZES[version], 4
    shape = common.latent_shape(pipe, kind, size, frames=frames)
    assert shape == (pipe.vae.config.z_dim, 1 + (frames - 1) // 4, size // pipe.vae_scale_factor_spatial,
                     size // pipe.vae_scale_factor_spatial)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape)
    shipped = type(pipe.scheduler).from_config(pipe.scheduler.config)
    shipped.set_timesteps(steps)
    assert torch.equal(sigmas, shipped.sigmas) and sigmas[-1] == 0
    assert torch.equal(torch.floor(sigmas[:-1].double() * 1000).long(), shipped.timesteps)  # the model's time
    pipe.scheduler = tiny_video.euler_scheduler(pipe)
    for guidance in (1.0, 5.0):
        emb = common.encode_prompts(pipe, kind, PROMPTS[:1], max_sequence_length=16, cfg=guidance)
        assert ("neg_embeds" in emb) == (guidance > 1)
        noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(3))
        ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, emb,
                                   guidance=guidance, micro_batch=1)
        theirs = pipe(prompt=PROMPTS[0], negative_prompt="", height=size, width=size, num_frames=frames,
                      num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                      generator=torch.Generator().manual_seed(3), max_sequence_length=16).frames
        assert ours.shape == theirs.shape == (1, *shape)
        assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
        assert (ours - noise).abs().max() > 1e-3
    video = common.decode(pipe, ours)
    assert video.shape == (1, 3, frames, size, size) and 0 <= video.min() and video.max() <= 1


def test_the_sampler_reproduces_the_wan_pipeline_off_the_square(wan_dirs):
    """--width: a 32 x 48 clip (as 480 x 832) of 5 frames with CFG, the pipeline's own latents to 1e-5."""
    import tiny_video
    pipe, kind = common.load_pipeline(wan_dirs["2.1"], torch.device("cpu"))
    shape = common.latent_shape(pipe, kind, 32, width=48, frames=5)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=3, shape=shape)
    emb = common.encode_prompts(pipe, kind, PROMPTS[1:2], max_sequence_length=16, cfg=5.0)
    noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(4))
    ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(4))], sigmas, emb, guidance=5.0,
                               micro_batch=1)
    pipe.scheduler = tiny_video.euler_scheduler(pipe)
    theirs = pipe(prompt=PROMPTS[1], negative_prompt="", height=32, width=48, num_frames=5, num_inference_steps=3,
                  guidance_scale=5.0, output_type="latent", generator=torch.Generator().manual_seed(4),
                  max_sequence_length=16).frames
    assert (ours - theirs).abs().max() < 1e-5
    assert common.decode(pipe, ours).shape == (1, 3, 5, 32, 48)


def test_frames_resolution_and_the_two_expert_model_are_checked(wan_dirs, tiny):
    """--num-frames must be 1 + 4k for Wan (its VAE's temporal factor) and 1 for an image family; the
    resolution a multiple of the VAE's factor times the 2x2 patches; a Wan2.2-T2V-A14B (two experts) stops."""
    pipe, kind = common.load_pipeline(wan_dirs["2.1"], torch.device("cpu"))
    with pytest.raises(SystemExit) as e:
        common.latent_shape(pipe, kind, 32, frames=6)
    assert str(e.value) == ("error: --num-frames 6 is not allowed for this WanPipeline; use 1 + 4 k frames (1, 5, "
                            "9, ..., 33, ..., 81): its VAE keeps the first frame and compresses each next 4 into one")
    assert common.latent_shape(pipe, kind, 32) == (4, 9, 8, 8)  # none: 33 frames, Flow-GRPO's Wan recipe
    with pytest.raises(SystemExit, match=r"^error: --resolution 36 is not allowed for this model; use a positive "
                                         r"multiple of 8$"):
        common.latent_shape(pipe, kind, 36)
    assert common.latent_shape(pipe, kind, 32, width=48, frames=5) == (4, 2, 8, 12)  # 480 x 832 at full size
    with pytest.raises(SystemExit, match=r"^error: --width 36 is not allowed for this model; use a positive "
                                         r"multiple of 8$"):
        common.latent_shape(pipe, kind, 32, width=36)
    wan22, kind22 = common.load_pipeline(wan_dirs["2.2"], torch.device("cpu"))
    with pytest.raises(SystemExit, match="multiple of 32"):
        common.latent_shape(wan22, kind22, 48)
    flux, flux_kind = common.load_pipeline(tiny["flux"], torch.device("cpu"))
    assert common.latent_shape(flux, flux_kind, 32, frames=1) == common.latent_shape(flux, flux_kind, 32)
    with pytest.raises(SystemExit) as e:
        common.latent_shape(flux, flux_kind, 32, frames=5)
    assert str(e.value) == ("error: --num-frames 5 is not allowed for this FluxPipeline (it samples images); pass "
                            "--num-frames 1, or a video model")
    pipe.register_modules(transformer_2=pipe.transformer)
    with pytest.raises(SystemExit, match=r"^error: this WanPipeline has two transformers \(Wan2.2-T2V-A14B"):
        common.latent_shape(pipe, kind, 32, frames=5)


def test_the_wan_entry_names_layers_and_blocks_it_has(wan_dirs):
    """LoRA targets (Flow-Factory's Wan defaults) are linear layers of every block; the FSDP2 units are the blocks."""
    pipe, kind = common.load_pipeline(wan_dirs["2.1"], torch.device("cpu"))
    t = pipe.transformer
    names = {n for n, m in t.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = models.FAMILIES["wan"]["lora_targets"](t)
    for target in targets:
        assert sum(n.endswith("." + target) for n in names) == len(t.blocks), target
    assert models.blocks(t) == list(t.blocks)


def test_image_rewards_score_the_frames_frame_reduce_says():
    """per_frame: first, mean and stride:K are the means of the reward of those frames, each frame with its
    video's prompt; images pass through; the attributes (GenEval's evaluation) stay; bad values are one line."""
    calls = []

    def brightness(images, prompts):
        calls.append(list(prompts))
        return images.mean(dim=(1, 2, 3))
    brightness.evaluation = True
    videos = torch.rand(2, 3, 7, 4, 4)
    per = videos.mean(dim=(1, 3, 4))  # [B, F]
    assert torch.allclose(common.per_frame(brightness, "first")(videos, ["a", "b"]), per[:, 0])
    assert calls[-1] == ["a", "b"]
    assert torch.allclose(common.per_frame(brightness, "mean")(videos, ["a", "b"]), per.mean(1))
    assert calls[-1] == ["a"] * 7 + ["b"] * 7
    assert torch.allclose(common.per_frame(brightness, "stride:3")(videos, ["a", "b"]), per[:, [0, 3, 6]].mean(1))
    images = torch.rand(2, 3, 4, 4)
    assert torch.equal(common.per_frame(brightness, "first")(images, ["a", "b"]), brightness(images, ["a", "b"]))
    assert common.per_frame(brightness, "mean").evaluation
    assert common.frame_indices("stride:4", 33) == [0, 4, 8, 12, 16, 20, 24, 28, 32]  # verl-omni's HPSv3
    for bad in ("last", "stride:0", "stride:", "stride:x", "mean:2"):
        with pytest.raises(SystemExit) as e:
            common.check_frame_reduce(bad)
        assert str(e.value) == f"error: --frame-reduce {bad!r} is not allowed; use first, mean or stride:K (K >= 1)"


def test_the_moving_shapes_rewards_need_the_frames():
    """Drawn clips score ~1 on every reward; the same clips under the opposite direction keep their first-frame
    and per-frame rewards but lose the motion reward; a clip frozen on its first frame keeps the frame rewards and
    loses the motion; a clip whose object flickers loses consistency; a video reward on images is one line."""
    import video_world as vw
    prompts = vw.video_prompts(24, seed=5)
    clips = vw.render_clips(prompts, 9, generator=torch.Generator().manual_seed(0))
    opposite = {"right": "left", "left": "right", "falling": "rising", "rising": "falling"}
    flipped = []
    for p in prompts:
        c, s, d, v = vw.parse_video_prompt(p)
        motion = f"moving {v} to the {opposite[d]}" if d in ("left", "right") else f"{opposite[d]} {v}"
        flipped.append(f"a {c} {s} {motion}")
    frozen = clips[:, :, :1].expand_as(clips)
    flicker = clips.clone()
    flicker[:, :, 1::2] *= 0.3
    r = {name: getattr(vw, name) for name in ("toy_frame_first_reward", "toy_frame_mean_reward", "toy_motion_reward",
                                              "toy_consistency_reward", "toy_video_strict_accuracy")}
    good = {k: f(clips, prompts) for k, f in r.items()}
    assert all(v.mean() > 0.9 for v in good.values()), {k: v.mean() for k, v in good.items()}
    assert torch.equal(r["toy_frame_first_reward"](clips, flipped), good["toy_frame_first_reward"])
    assert torch.equal(r["toy_frame_mean_reward"](clips, flipped), good["toy_frame_mean_reward"])
    assert r["toy_motion_reward"](clips, flipped).max() < 1e-3 and r["toy_video_strict_accuracy"](clips, flipped).sum() == 0
    assert torch.equal(r["toy_frame_first_reward"](frozen, prompts), good["toy_frame_first_reward"])
    assert r["toy_motion_reward"](frozen, prompts).max() < 0.05
    assert r["toy_consistency_reward"](flicker, prompts).mean() < 0.5 * good["toy_consistency_reward"].mean()
    per = common.per_frame(vw.toy_frame_reward, "first")
    assert torch.equal(per(clips, prompts), good["toy_frame_first_reward"])
    assert torch.allclose(common.per_frame(vw.toy_frame_reward, "mean")(clips, prompts),
                          good["toy_frame_mean_reward"], atol=1e-6)
    fns = common.load_rewards(["toy_motion"], "cpu", models=common.RewardModels())
    with pytest.raises(SystemExit) as e:
        common.score(fns, clips[:, :, 0], prompts)
    assert str(e.value) == ("error: reward 'toy_motion' scores videos; this model samples images (pass a video "
                            "model, e.g. Wan)")


class VideoAlignStandIn(ThreadingHTTPServer):
    """A VideoAlign reward server stand-in: it checks each request (every video's frames as JPEG of the clip's
    size, the fps, a prompt per video) and answers VQ = mean brightness, MQ = brightness change first -> last,
    TA = the prompt's length / 100."""
    daemon_threads = True

    def __init__(self, frames: int, size: int, fps: int):
        super().__init__(("127.0.0.1", 0), VideoAlignHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.expect, self.requests, self.raw = (frames, size, fps), [], None


class VideoAlignHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        s = self.server
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s.requests.append(data)
        frames, size, fps = s.expect
        assert set(data) == {"videos", "fps", "prompts"} and data["fps"] == fps
        assert len(data["videos"]) == len(data["prompts"]) and all(len(v) == frames for v in data["videos"])
        bright = []
        for video in data["videos"]:
            images = [Image.open(io.BytesIO(jpeg), formats=["jpeg"]).convert("L") for jpeg in video]
            assert all(img.size == (size, size) for img in images)
            bright.append([float(np.asarray(img).mean()) / 255 for img in images])
        answer = {"VQ": [sum(b) / len(b) for b in bright], "MQ": [b[-1] - b[0] for b in bright],
                  "TA": [len(p) / 100 for p in data["prompts"]], "Overall": [0.0] * len(bright)}
        body = s.raw if s.raw is not None else pickle.dumps(answer)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_videoalign_through_the_reward_server_protocol():
    """The three dimensions of a batch of videos cost one request carrying every frame and the fps; the answer's
    values come back per video; a second batch asks again; an answer out of range is a one-line error."""
    videos = torch.linspace(0, 1, 9).view(1, 1, 9, 1, 1).expand(3, 3, 9, 16, 16).clone()
    videos[1] = 1 - videos[1]  # darkening
    server = VideoAlignStandIn(frames=9, size=16, fps=12)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        models_ = common.RewardModels(videoalign_url=server.url, reward_retries=0, reward_timeout=30)
        fns = common.load_rewards(["videoalign_vq", "videoalign_mq", "videoalign_ta"], "cpu", models=models_, fps=12)
        scores = common.score(fns, videos, PROMPTS)
        assert len(server.requests) == 1
        assert torch.allclose(scores["videoalign_vq"], torch.full((3,), 0.5), atol=0.02)
        assert scores["videoalign_mq"][0] > 0.9 and scores["videoalign_mq"][1] < -0.9
        assert torch.allclose(scores["videoalign_ta"], torch.tensor([len(p) / 100 for p in PROMPTS]))
        common.score(fns, videos * 0.9, PROMPTS)  # other videos: a new request
        assert len(server.requests) == 2
        server.raw = pickle.dumps({"VQ": [0.0, 1e9, 0.0], "MQ": [0.0] * 3, "TA": [0.0] * 3})
        with pytest.raises(SystemExit) as e:
            common.score(fns, videos * 0.5, PROMPTS)
        assert str(e.value) == (f"error: the reward server {server.url} answered VQ[1] = 1000000000.0, not a number "
                                f"in [-100.0, 100.0]")
    finally:
        server.shutdown()


CASES = {  # file: flags on top of tiny_flags (4 steps), as test_families.py runs them
    "flow_grpo.py": {}, "densegrpo.py": {"dense_ode_steps": 2}, "diffusion_nft.py": {}, "awm.py": {"train_timesteps": 2},
    "dancegrpo.py": {"updates_per_iteration": 1, "no_full_finetune": True},
    "g2rpo.py": {"sde_steps": "0 1", "lambdas": "1 2", "updates_per_iteration": 2, "no_full_finetune": True},
    "mixgrpo.py": {"window_size": 2, "updates_per_iteration": 1, "no_full_finetune": True}, "dgpo.py": {"trunc_steps": 2, "train_timesteps": 2},
    "flow_dppo.py": {"sde_steps": 1, "updates_per_iteration": 1}, "dpo.py": {"timestep_fraction": 0.5},
    "crd.py": {"train_timesteps": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("script", CASES)
def test_every_file_trains_a_video_model(wan_dirs, tmp_path, script):
    """One iteration of each algorithm file with LoRA on the tiny Wan2.1 at 5 frames with CFG, a per-frame image
    reward and a video reward: the measured rollout NFE is the file's planned_nfe, a gradient flowed, the
    evaluation wrote its grid and its animated WebP (5 frames), the summary loads the LoRA into WanPipeline."""
    flags = dict(CASES[script], num_iterations=1, eval_every=1, eval_num=2, log_images_every=1, save_every=1,
                 num_frames=5, fps=8, guidance=4.0, rewards="toy_frame toy_motion", frame_reduce="stride:2")
    proc = run_script(script, tiny_flags(wan_dirs["2.1"], wan_dirs["prompts"], tmp_path, **flags))
    run, m = read_metrics(tmp_path)
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] > 0
    assert m[1]["train/grad_norm"] > 0
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_1", "lora", "pytorch_lora_weights.safetensors"))
    webp = Image.open(os.path.join(run, "samples", "eval_1.webp"))
    assert webp.n_frames == 5 and os.path.isfile(os.path.join(run, "samples", "eval_1.png"))
    assert "from diffusers import WanPipeline" in proc.stdout and "num_frames=5" in proc.stdout


def test_the_moving_shapes_world_is_each_files_toy_preset_in_its_world(monkeypatch, tmp_path):
    """--model toy-video (or a directory whose toy_world.json says "video"): the file's TOY preset (its algorithm's
    toy settings) with rundir.TOY_VIDEO_WORLD's world (9 frames, its prompts and rewards); --model toy keeps the
    image world; flags given still win."""
    import json as json_

    import flow_grpo
    import rundir
    copied = tmp_path / "wan-shapes"
    copied.mkdir()
    (copied / "toy_world.json").write_text(json_.dumps({"world": "video"}))
    for model in ("toy-video", str(copied)):
        monkeypatch.setattr("sys.argv", ["flow_grpo.py", "--model", model, "--fps", "4"])
        args = rundir.parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="")
        assert (args.model, args.num_frames, args.fps, args.prompts) == (model, 9, 4, "toy-video")
        assert args.rewards == ("toy_frame", "toy_motion") and "toy_video_strict" in args.eval_rewards
        assert args.learning_rate == flow_grpo.TOY["learning_rate"] and args.beta == flow_grpo.TOY["beta"]
    monkeypatch.setattr("sys.argv", ["flow_grpo.py", "--model", "toy"])
    args = rundir.parse_args(flow_grpo.Args, toy=flow_grpo.TOY, description="")
    assert args.num_frames is None and args.rewards == flow_grpo.TOY["rewards"]


def test_the_sde_starts_from_the_shipped_schedules_first_level(wan_dirs):
    """The shipped UniPC schedule starts at 1 - 1e-6, not 1: Flow-GRPO's g = a sqrt(sigma / (1 - sigma)) would be
    a 1000 there (a step's std about 100: the rollout's latents blow up); every file's SDE takes sigmas[1] in the
    denominator there, as the official code does at sigma = 1."""
    import dancegrpo
    import densegrpo
    import flow_dppo
    import flow_grpo
    import g2rpo
    import mixgrpo
    pipe, kind = common.load_pipeline(wan_dirs["2.1"], torch.device("cpu"))
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=16, shape=(4, 3, 8, 8))
    assert 0 < 1 - float(sigmas[0]) < 1e-5
    x = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    a, dt = 0.7, float(sigmas[0] - sigmas[1])
    expected = a * (float(sigmas[0]) / (1 - float(sigmas[1]))) ** 0.5 * dt ** 0.5
    for module in (flow_grpo, densegrpo, flow_dppo, g2rpo, mixgrpo):
        _, log_prob, _, std = module.sde_step(torch.zeros_like(x), x, sigmas, 0, a, generator=torch.Generator())
        assert std == pytest.approx(expected, rel=1e-6) and std < 1 and torch.isfinite(log_prob).all(), module
    assert dancegrpo.sde_step(torch.zeros_like(x), x, sigmas, 0, a, generator=torch.Generator())[3] < 1
