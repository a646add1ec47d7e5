"""Image editing: FLUX.1 Kontext on a tiny random pipeline saved with save_pretrained and loaded by path (the
project's deterministic sampler reproduces FluxKontextPipeline's own latents from the same source image, instruction
and noise, at two source sizes and at the pipeline's own resizing); the editing prompt sets (.jsonl rows with
images, their one-line errors); the text cache of image-aware embeddings; the editing toy world's exact rewards."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import common
import models
from helpers import read_metrics, run_script, tiny_flags
PROMPT = "make the red circle blue"


def one_line_error(fn) -> str:
    with pytest.raises(SystemExit) as e:
        fn()
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory):
    """A tiny random FluxKontextPipeline on disk, its VAE 8x (a source at the pipeline's ~1 MP: 4,070 tokens)."""
    import tiny
    path = str(tmp_path_factory.mktemp("kontext") / "kontext")
    tiny.build_flux_kontext(seed=0, vae=tiny.tiny_vae(channels=(8, 8, 8, 8))).save_pretrained(path)
    return path


def source(height: int, width: int, seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(height, width, 3, generator=g) * 255).round().byte().numpy()
    return Image.fromarray(pixels)


@pytest.mark.parametrize("size,condition_size", [((32, 32), 0), ((48, 32), 0), ((40, 56), None)])
def test_the_sampler_reproduces_kontext(kontext_dir, tmp_path, size, condition_size):
    """The source's tokens after the target's, their position ids (first axis 1), the prediction cut back:
    common.ode_complete ends where FluxKontextPipeline's __call__ ends (max abs difference < 1e-5), for sources
    kept at their size (--condition-size 0, the pipeline's _auto_resize=False) and resized as the pipeline
    resizes them by default (its preferred resolution nearest in aspect ratio)."""
    pipe, kind = common.load_pipeline(kontext_dir, torch.device("cpu"))
    assert kind == "kontext"
    pipe.condition_size = condition_size
    path = str(tmp_path / "source.png")
    source(*size).save(path)
    prompt = common.Prompt(PROMPT, {"prompt": PROMPT, "image": path}, images=(path,))
    steps, guidance = 2, 3.5
    shape = common.latent_shape(pipe, kind, 32)
    sigmas = common.pipeline_sigmas(pipe, kind, num_steps=steps, shape=shape)
    emb = common.encode_prompts(pipe, kind, [prompt], max_sequence_length=16, cfg=guidance)
    h, w = size if condition_size == 0 else (832, 1248)  # 40x56 floored to 32x48: the nearest is (1248, 832)
    tokens = (h // pipe.vae_scale_factor // 2) * (w // pipe.vae_scale_factor // 2)
    assert emb["cond"].shape == (1, tokens, 16) and (emb["cond_ids"][0, :, 0] == 1).all()
    noise = torch.randn((1, *shape), generator=torch.Generator().manual_seed(7))
    ours = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, emb,
                               guidance=guidance, micro_batch=4)
    theirs = pipe(prompt=PROMPT, image=Image.open(path), height=32, width=32, num_inference_steps=steps,
                  guidance_scale=guidance, generator=torch.Generator().manual_seed(7), output_type="latent",
                  max_sequence_length=16, max_area=32 * 32, _auto_resize=condition_size is None).images
    theirs = models.unpack(theirs, (1, *shape))
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
    plain = dict(emb)
    del plain["cond"], plain["cond_ids"]
    without = common.ode_complete(pipe.transformer, kind, noise, [list(range(steps + 1))], sigmas, plain,
                                  guidance=guidance, micro_batch=4)
    assert (without - ours).abs().max() > 1e-4  # the source acts


def test_the_size_a_source_enters_the_vae_at_is_the_encodes(kontext_dir):
    """models.kontext_source_hw (what rundir.check_editing reads) gives the size kontext_encode encodes a source
    at: the token grid of its position ids, for sources kept, resized to --condition-size and to the preferred
    resolution."""
    pipe, kind = common.load_pipeline(kontext_dir, torch.device("cpu"))
    for size, condition_size in [((32, 32), 0), ((40, 72), 0), ((41, 75), 48), ((200, 120), 64), ((40, 56), None)]:
        pipe.condition_size = condition_size
        image = torch.from_numpy(np.asarray(source(*size))).permute(2, 0, 1)
        ids = common.encode_prompts(pipe, kind, [common.Prompt(PROMPT, {}, images=(image,))],
                                    max_sequence_length=16)["cond_ids"][0]
        h, w = models.kontext_source_hw(pipe, *size)
        assert (int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1) == (h // 16, w // 16), (size, condition_size)


def test_a_set_whose_sources_resize_unlike_stops_before_training(kontext_dir, tmp_path):
    """Sources that enter the VAE at other sizes in one prompt set: one line when the run starts (naming two of
    them and their sizes), not when a batch that mixes them is first encoded; sources of one aspect ratio at
    --condition-size S resize alike; a source below the model's multiple is one line naming it."""
    import rundir
    pipe, kind = common.load_pipeline(kontext_dir, torch.device("cpu"))
    images = (("a.png", (32, 32)), ("b.png", (64, 64)), ("c.png", (32, 64)), ("d.png", (8, 8)))
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": "remove it", "image": "b.png"},
                                  {"prompt": "add a square", "image": "c.png"}], images=images)
    prompts = common.load_prompt_set(path)
    rundir.check_editing(pipe, kind, prompts[:2], condition_size=48)  # 32x32 and 64x64 -> 48x48 each
    message = one_line_error(lambda: rundir.check_editing(pipe, kind, prompts[:2], condition_size=0))
    assert message == ("error: the sources of 'make the red circle blue' ('a.png') and of 'remove it' ('b.png') "
                       "enter the VAE at 32x32 and 64x64 pixels (height x width); a batch's sources are encoded "
                       "together: pass --condition-size S (each source resized to S x S pixels' area) with "
                       "sources of one aspect ratio, or resize them alike first")
    message = one_line_error(lambda: rundir.check_editing(pipe, kind, [], prompts, condition_size=48))
    assert "('a.png') and of 'add a square' ('c.png') enter the VAE at 48x48 and 32x64 pixels" in message
    rundir.check_editing(pipe, kind, prompts[:1], prompts[2:], condition_size=48)  # each set alike: no batch mixes
    tiny = common.Prompt(PROMPT, {}, images=(str(tmp_path / "d.png"),))
    message = one_line_error(lambda: rundir.check_editing(pipe, kind, [tiny], condition_size=0))
    assert message.startswith("error: the source image 'd.png' of 'make the red circle blue': a source image of ")
    assert message.endswith("is smaller than this model's multiple 16; pass a larger --condition-size")
    flags = tiny_flags(kontext_dir, path, str(tmp_path / "runs"), condition_size=48)
    proc = run_script("flow_grpo.py", flags, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: the sources of 'make the red circle blue' ('a.png') and of 'add a square' ('c.png') enter the VAE")
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs")  # nothing was trained


def test_sources_of_other_sizes_in_one_batch_are_one_line(kontext_dir, tmp_path):
    pipe, kind = common.load_pipeline(kontext_dir, torch.device("cpu"))
    pipe.condition_size = 0
    prompts = []
    for i, size in enumerate([(32, 32), (32, 48)]):
        path = str(tmp_path / f"{i}.png")
        source(*size).save(path)
        prompts.append(common.Prompt(PROMPT, {}, images=(path,)))
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, prompts, max_sequence_length=16))
    assert "source images of one batch have different sizes" in message and "--condition-size" in message
    pipe.condition_size = 32  # one area, each at its own aspect ratio: 32x32, and 39x26 floored to 32x16
    message = one_line_error(lambda: common.encode_prompts(pipe, kind, prompts, max_sequence_length=16))
    assert "source images of one batch have different sizes" in message
    emb = common.encode_prompts(pipe, kind, prompts[:1] * 2, max_sequence_length=16)
    assert emb["cond"].shape[:2] == (2, 4)


def write_edits(tmp_path, rows, images=(("a.png", (32, 32)), ("b.png", (32, 32)))) -> str:
    for seed, (name, size) in enumerate(images):
        source(*size, seed=seed).save(str(tmp_path / name))
    path = str(tmp_path / "edits.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_an_editing_prompt_set_reads_its_images(tmp_path):
    """Flow-Factory's layout: {"prompt", "image"} or {"prompt", "images": [...]}, paths relative to the file;
    one instruction over two sources is two prompts (their keys differ)."""
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": PROMPT, "image": "b.png"},
                                  {"prompt": "remove it", "images": ["b.png"], "extra": 1}])
    prompts = common.load_prompt_set(path)
    assert [len(p.images) for p in prompts] == [1, 1, 1]
    assert prompts[0].images == (str(tmp_path / "a.png"),) and prompts[2].metadata["extra"] == 1
    assert prompts[0] == prompts[1] and len({common.prompt_key(p) for p in prompts}) == 3
    (tmp_path / "two.jsonl").write_text(json.dumps({"prompt": PROMPT, "images": ["a.png", "b.png"]}) + "\n")
    (two,) = common.load_prompt_set(str(tmp_path / "two.jsonl"))
    assert two.images == (str(tmp_path / "a.png"), str(tmp_path / "b.png"))


@pytest.mark.parametrize("row,images,expected", [
    ({"prompt": PROMPT, "image": "missing.png"}, (), "line 1 of prompt file {f!r}: image 'missing.png' does "
     "not exist"),
    ({"prompt": PROMPT, "image": "bad.png"}, (), "line 1 of prompt file {f!r}: image 'bad.png' cannot be read "
     "as an image"),
    ({"prompt": PROMPT, "image": 3}, (), "line 1 of prompt file {f!r}: \"image\" must be a path (a string)"),
    ({"prompt": PROMPT, "images": []}, (), "line 1 of prompt file {f!r}: \"images\" must be a list of 1 to 8 "
     "paths"),
    ({"prompt": PROMPT, "image": "a.png", "images": ["a.png"]}, (), "line 1 of prompt file {f!r} has both "
     "\"image\" and \"images\""),
    ({"prompt": PROMPT, "image": "big.png"}, (("big.png", (8200, 8)),), "line 1 of prompt file {f!r}: image "
     "'big.png' is 8x8200 pixels (width x height); a side may be 8 to 8192"),
])
def test_a_bad_image_row_is_one_line_naming_it(tmp_path, row, images, expected):
    path = write_edits(tmp_path, [row], images=(("a.png", (32, 32)),) + images)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    message = one_line_error(lambda: common.load_prompt_set(path))
    assert message.startswith("error: " + expected.format(f=path)), message


def test_a_prompt_set_that_mixes_edits_and_text_is_one_line(tmp_path):
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": "a red circle"}])
    message = one_line_error(lambda: common.load_prompt_set(path))
    assert f"line 2 of prompt file {path!r} has no image, line 1 has;" in message


def test_a_prompt_set_whose_edits_have_other_numbers_of_sources_is_one_line(tmp_path):
    """Read when the set loads, not when a batch that mixes them is first encoded, hours into a run."""
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": PROMPT, "images": ["a.png"]},
                                  {"prompt": PROMPT, "images": ["a.png", "b.png"]}])
    message = one_line_error(lambda: common.load_prompt_set(path))
    assert message == (f"error: line 3 of prompt file {path!r} has 2 source images, line 1 1; an editing prompt "
                       f"set gives every line as many (a batch's sources are encoded together)")


def test_the_text_cache_keeps_each_source(kontext_dir, tmp_path):
    """Two edits with one instruction and other sources: two cache rows, each the encoder's own embeddings."""
    import rundir
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": PROMPT, "image": "b.png"}])
    prompts = common.load_prompt_set(path)
    pipe, kind = common.load_pipeline(kontext_dir, torch.device("cpu"))
    pipe.condition_size = 0
    direct = common.encode_prompts(pipe, kind, prompts, max_sequence_length=16)
    assert (direct["cond"][0] - direct["cond"][1]).abs().max() > 1e-3
    rundir.fill_text_cache(pipe, kind, prompts, directory=str(tmp_path / "cache"), device="cpu",
                           max_sequence_length=16, cfg=3.5)
    assert len([f for f in os.listdir(tmp_path / "cache") if f.endswith(".safetensors")]) == 2
    cached = common.encode_prompts(pipe, kind, prompts[::-1], max_sequence_length=16)
    for k in direct:
        assert torch.equal(cached[k], direct[k].flip(0)), k


def test_the_editing_toy_rewards():
    """The target scene rendered scores 1 on every reward; the untouched source keeps everything but fails the
    instruction; noise outside the edited boxes costs preservation only there."""
    import edit_world
    edits = edit_world.draw_edits(64, seed=5)
    prompts = edit_world.edit_prompts(64, seed=5)
    target = torch.stack([edit_world.render(e["target_objects"]) for e in edits])
    src = torch.stack([p.images[0].float() / 255 for p in prompts])
    assert edit_world.toy_edit_strict_accuracy(target, prompts).all()
    assert (edit_world.toy_preserve_reward(target, prompts) > 0.99).all()
    assert edit_world.toy_edit_reward(target, prompts).min() > 0.9
    assert (edit_world.toy_preserve_reward(src, prompts) == 1).all()
    assert not edit_world.toy_edit_strict_accuracy(src, prompts).any()
    assert edit_world.toy_edit_reward(src, prompts).mean() < 0.6
    shifted = target.clone()
    shifted[:, :, :, :] += 0.1  # a grey veil everywhere: |difference| 0.1 outside the edit
    keep = edit_world.toy_preserve_reward(shifted.clamp(0, 1), prompts)
    assert torch.allclose(keep, torch.full_like(keep, 1 - 0.1 / edit_world.PRESERVE_SCALE), atol=0.02)


def test_the_editing_toy_rewards_read_a_jsonl_prompt_set(tmp_path):
    """The editing world's edits written as a .jsonl prompt set (each source a PNG, the scenes and boxes as fields)
    score as the prompt set 'toy-edit' does; a "changed" field that is not boxes is one line naming it."""
    import edit_world
    from helpers import write_edit_set
    prompts = edit_world.edit_prompts(6, seed=3)
    path = write_edit_set(str(tmp_path), prompts)
    read = common.load_prompt_set(path, rewards=("toy_edit", "toy_preserve"))
    images = torch.rand(6, 3, 32, 32)
    for reward in (edit_world.toy_edit_reward, edit_world.toy_preserve_reward, edit_world.toy_edit_strict_accuracy):
        assert torch.equal(reward(images, read), reward(images, prompts)), reward.__name__
    first = json.loads((tmp_path / "edits.jsonl").read_text().splitlines()[0])
    (tmp_path / "bad.jsonl").write_text(json.dumps({**first, "changed": [[1, 2, 3]]}) + "\n")
    with pytest.raises(SystemExit) as e:
        common.load_prompt_set(str(tmp_path / "bad.jsonl"), rewards=("toy_preserve",))
    assert "has a \"changed\" field that is not a list of at most 4 boxes" in str(e.value), e.value


@pytest.mark.slow
def test_flow_grpos_counting_edit_pair_trains(kontext_dir, tmp_path):
    """Flow-GRPO's counting_edit reward as the README's Kontext command trains on it, `--rewards image_similarity
    geneval` on counting edits (.jsonl rows with a source and a GenEval spec): every training request to the
    GenEval server (a local stand-in) carries each result's own edit spec, the similarity reads each result's
    source, and the run logs both rewards."""
    import threading

    from test_reward_server import StandIn
    from test_rewards import tiny_clip_model
    from transformers import CLIPImageProcessor
    clip = tiny_clip_model(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(clip)
    rows = [{"prompt": f"Change the number of {c}s to two.", "image": i, "tag": "counting",
             "include": [{"class": c, "count": 2}], "exclude": [{"class": c, "count": 3}]}
            for c, i in (("cat", "a.png"), ("dog", "b.png"))]
    prompts = write_edits(tmp_path, rows)
    server = StandIn()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        flags = tiny_flags(kontext_dir, prompts, tmp_path / "runs", rewards="image_similarity geneval",
                           num_iterations=1, eval_every=0, log_images_every=0, save_every=0, condition_size=0)
        run_script("flow_grpo.py", [*flags, "--geneval-url", server.url, "--similarity-clip", clip])
    finally:
        server.shutdown()
        server.server_close()
    (training,) = [r for r in server.requests if r["only_strict"]]
    assert len(training["images"]) == 2 * 4  # 2 edits x G = 4, one batch
    sent = training["meta_datas"]  # each group's row, whole: its spec (and its source's name)
    assert sorted({json.dumps(m, sort_keys=True) for m in sent}) == sorted(json.dumps(r, sort_keys=True) for r in rows)
    assert all(m == sent[4 * (i // 4)] for i, m in enumerate(sent))
    _, m = read_metrics(tmp_path / "runs")
    assert 0 <= m[1]["reward/geneval_mean"] <= 1 and -1 <= m[1]["reward/image_similarity_mean"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("script", list(__import__("test_families").CASES))
def test_every_file_trains_an_editing_model(kontext_dir, tmp_path, script):
    """One iteration of each file with LoRA on FLUX.1 Kontext and an editing prompt set (.jsonl rows with
    source images): the rollout NFE is the file's planned_nfe, a gradient, the LoRA saved, and the summary's
    loading snippet passes the source image."""
    from test_families import CASES
    prompts = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": "remove it", "image": "b.png"}])
    flags = dict(CASES[script], num_iterations=1, eval_every=0, log_images_every=0, save_every=1, condition_size=0)
    proc = run_script(script, tiny_flags(kontext_dir, prompts, tmp_path / "runs", **flags))
    run, m = read_metrics(tmp_path / "runs")
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] > 0
    assert os.path.isfile(os.path.join(run, "checkpoints", "iter_1", "lora", "pytorch_lora_weights.safetensors"))
    assert m[1]["train/grad_norm"] > 0
    assert "from diffusers import FluxKontextPipeline" in proc.stdout and "image=" in proc.stdout


def test_image_similarity_is_flow_grpos_clip_image_similarity(tmp_path):
    """The similarity half of Flow-GRPO's counting_edit, written out as its clip_scorer.py: torchvision Resize
    (shorter side) + CenterCrop + Normalize, CLIPModel.get_image_features, the cosine of edit and source."""
    import torchvision.transforms as T
    from test_rewards import tiny_clip_model
    from transformers import CLIPImageProcessor, CLIPModel
    root = tiny_clip_model(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root)
    path = write_edits(tmp_path, [{"prompt": PROMPT, "image": "a.png"}, {"prompt": PROMPT, "image": "b.png"}],
                       images=(("a.png", (40, 56)), ("b.png", (32, 32))))
    prompts = common.load_prompt_set(path)
    fn = common.load_rewards(["image_similarity"], "cpu", models=common.RewardModels(similarity_clip=root))
    edits = torch.rand(2, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    ours = common.score(fn, edits, prompts)["image_similarity"]
    model, processor = CLIPModel.from_pretrained(root), CLIPImageProcessor.from_pretrained(root)
    tform = T.Compose([T.Resize(32), T.CenterCrop(32), T.Normalize(processor.image_mean, processor.image_std)])

    def embed(x):
        with torch.no_grad():
            e = model.get_image_features(pixel_values=tform(x))
        e = getattr(e, "pooler_output", e)
        return e / e.norm(p=2, dim=-1, keepdim=True)
    refs = [torch.from_numpy(__import__("numpy").array(Image.open(p.images[0]))).permute(2, 0, 1)[None] / 255
            for p in prompts]
    official = torch.stack([(embed(edits[i:i + 1]) @ embed(refs[i]).T)[0, 0] for i in range(2)])
    assert torch.allclose(ours, official, atol=1e-5), (ours, official)
    same = common.score(fn, torch.cat(refs[1:]).expand(2, -1, -1, -1), prompts[1:] * 2)["image_similarity"]
    assert torch.allclose(same, torch.ones(2), atol=1e-5)  # the source itself


def test_editreward_sends_each_source_with_its_result(tmp_path):
    """The edit-judge client: a request per batch carrying the results, each edit's source images (all of them,
    at their own sizes) and the instructions; a stand-in judge answers a known function of all three; an answer out of range is one line."""
    import io
    import pickle
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np
    seen = []

    class Judge(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(data)
            bright = lambda jpeg: float(np.asarray(Image.open(io.BytesIO(jpeg)).convert("L")).mean()) / 255  # noqa
            scores = [bright(r) - bright(s[0]) + len(p) / 100
                      for r, s, p in zip(data["images"], data["sources"], data["prompts"])]
            body = pickle.dumps({"scores": scores} if not self.server.raw else self.server.raw)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.raw = None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        prompts = [common.Prompt(PROMPT, {}, images=(torch.zeros(3, 16, 24, dtype=torch.uint8),)),
                   common.Prompt("remove it", {}, images=(torch.full((3, 8, 8), 255, dtype=torch.uint8),
                                                          torch.zeros(3, 8, 16, dtype=torch.uint8)))]
        fn = common.load_rewards(["editreward"], "cpu", models=common.RewardModels(editreward_url=url,
                                                                                   reward_retries=0))
        scores = common.score(fn, torch.full((2, 3, 32, 32), 0.5), prompts)["editreward"]
        assert len(seen) == 1 and set(seen[0]) == {"images", "sources", "prompts"}
        sizes = [[Image.open(io.BytesIO(jpeg)).size for jpeg in s] for s in seen[0]["sources"]]
        assert sizes == [[(24, 16)], [(8, 8), (16, 8)]]  # every source of an edit, in order, at its own size
        assert torch.allclose(scores, torch.tensor([0.5 + len(PROMPT) / 100, -0.5 + 0.09]), atol=0.02)
        server.raw = {"scores": [0.0, float("nan")]}
        with pytest.raises(SystemExit) as e:
            common.score(fn, torch.full((2, 3, 32, 32), 0.5), prompts)
        assert str(e.value) == f"error: the reward server {url} answered scores[1] = nan, not a number in " \
                               f"[-100.0, 100.0]"
    finally:
        server.shutdown()


def test_the_editing_world_is_each_files_toy_preset_in_its_world(monkeypatch, tmp_path):
    """--model toy-edit (or a directory whose toy_world.json says "edit"): the file's TOY preset with
    rundir.TOY_EDIT_WORLD's world (its prompts, its rewards, the sources as they are); flags given still win; the
    committed pipeline is a FluxKontextPipeline that brings that marker."""
    import json as json_

    import dancegrpo
    import rundir
    copied = tmp_path / "kontext-shapes"
    copied.mkdir()
    (copied / "toy_world.json").write_text(json_.dumps({"world": "edit"}))
    for model in ("toy-edit", str(copied)):
        monkeypatch.setattr("sys.argv", ["dancegrpo.py", "--model", model, "--group-size", "4"])
        args = rundir.parse_args(dancegrpo.Args, toy=dancegrpo.TOY, description="")
        assert (args.model, args.prompts, args.condition_size, args.group_size) == (model, "toy-edit", 0, 4)
        assert args.rewards == ("toy_edit", "toy_preserve") and args.eval_rewards == ("toy_edit_strict",)
        assert args.learning_rate == dancegrpo.TOY["learning_rate"]
    with open(os.path.join(common.MODEL_ALIASES["toy-edit"], "model_index.json")) as f:
        assert json_.load(f)["_class_name"] == "FluxKontextPipeline"
    assert rundir.toy_world_of(common.MODEL_ALIASES["toy-edit"]) == "edit"


def test_evaluate_scores_an_editing_model_on_its_world(tmp_path):
    """evaluate.py on --model toy-edit: its preset's editing prompts, sources and metrics (each pair's source
    reaches the rewards, which read it, and scores.json records it); a text-to-image model given an editing set
    stops in one line."""
    proc = run_script("evaluate.py", ["--model", "toy-edit", "--num-prompts", "4", "--seeds-per-prompt", "1",
                                      "--steps", "2", "--out", str(tmp_path / "eval")])
    table = open(tmp_path / "eval" / "table.md").read()
    assert "toy-edit (kontext): 4 prompts" in table and "toy_preserve" in table and "toy_edit_strict" in table
    with open(tmp_path / "eval" / "scores.json") as f:
        settings = json.load(f)["settings"]
    import edit_world
    drawn = edit_world.edit_prompts(1024, seed=1)[:4]  # the preset's evaluation prompts (its held-out draw)
    assert settings["pair_prompts"] == [str(p) for p in drawn]  # each pair's source recorded beside it:
    assert settings["pair_sources"] == [[common.images_hash(p.images[:1])] for p in drawn]  # the pixels' hash
    proc = run_script("evaluate.py", ["--model", "toy", "--prompts", "toy-edit", "--metrics", "toy_edit",
                                      "--num-prompts", "4", "--out", str(tmp_path / "eval2")], check=False)
    assert proc.returncode != 0 and "the prompt set has source images (an editing set), and this FluxPipeline " \
        "generates from text alone" in proc.stderr


@pytest.mark.slow
def test_two_processes_edit_as_one(kontext_dir, tmp_path):
    """Two processes train the tiny Kontext on an editing set (each rank its prompts' sources; the first ratio
    exactly 1), and their evaluation of the base model holds the same pairs with the same scores as one process's:
    every source stays with its instruction across ranks."""
    import json as json_
    rows = [{"prompt": f"edit number {i}", "image": f"{'ab'[i % 2]}.png"} for i in range(4)]
    prompts = write_edits(tmp_path, rows, images=(("a.png", (32, 32)), ("b.png", (32, 32))))
    flags = dict(prompts_per_iteration=4, eval_num=8, condition_size=0)
    run_script("flow_grpo.py", tiny_flags(kontext_dir, prompts, tmp_path / "n2", **flags), nproc=2)
    two, m2 = read_metrics(tmp_path / "n2")
    assert m2[1]["train/first_ratio_max_dev"] <= 1e-6
    flags.update(num_iterations=1, eval_every=1, save_every=0)
    run_script("flow_grpo.py", tiny_flags(kontext_dir, prompts, tmp_path / "n1", **flags))
    one, _ = read_metrics(tmp_path / "n1")
    evals = [json_.load(open(os.path.join(r, "eval_0.json"))) for r in (two, one)]
    for k in evals[0]:
        assert evals[0][k] == pytest.approx(evals[1][k], rel=1e-5, abs=1e-6), k
