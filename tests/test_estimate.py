"""results/estimate.py on tiny architectures: the same code paths as the full estimate (fake tensors, FSDP2
over a fake process group, the algorithm files' own Args and closed-form NFE), in seconds, so that it cannot
rot; and results/gpu_check.py's whole-iteration runs through the algorithm files, on tiny models (CPU)."""
import copy
import dataclasses
import json
import math
import os
import re
import sys

import pytest
import torch

from helpers import ROOT, run_script

sys.path.insert(0, os.path.join(ROOT, "results"))
import estimate  # noqa: E402
import gpu_check  # noqa: E402

def command(prefix):
    return next(c for c in estimate.COMMANDS if c[0].startswith(prefix))


def test_sharded_and_lora_state_is_accounted():
    """Full fine-tuning over 16 ranks holds 1/16 of the float32 weights (FSDP2 pads each tensor's shard) and
    twice that in Adam states; LoRA holds the whole bf16 model plus float32 adapters; the rollout gathers bf16
    weights."""
    name, script, argv, world = command("G2RPO")
    sharded = estimate.estimate(name, script, argv, world, tiny=True)
    n = sharded["n_params"]
    b = sharded["bytes"]
    assert b["frozen transformer (bf16)"] == 0
    assert 4 * n / world <= b["trainable (float32)"] <= 4 * n / world * 1.2
    assert b["Adam states"] == pytest.approx(2 * b["trainable (float32)"], rel=0.01)
    resident = sum(v for k, v in b.items() if not k.startswith("text"))
    assert sharded["peak"]["rollout"] >= resident + 2 * n * (world - 1) / world  # all blocks gathered, bf16
    assert sharded["nfe"] == __import__("g2rpo").planned_nfe(sharded["args"])  # read from the file
    # the optimizer step clips the local shards' gradients (float32, 1/16 each): no whole tensor appears
    assert sharded["peak"]["optimizer step"] < resident + sharded["kept"] + 3 * 4 * n / world
    name, script, argv, world = command("1 GPU: G2RPO")
    lora = estimate.estimate(name, script, argv, world, tiny=True)
    frozen, trainable = lora["bytes"]["frozen transformer (bf16)"], lora["bytes"]["trainable (float32)"]
    assert frozen == pytest.approx(2 * lora["n_params"], rel=0.01) and trainable > 0  # (tiny: r 64 is large)
    per_row_train, per_row_forward = lora["flops"]["training step"], lora["flops"]["rollout"] / lora["mb"]
    assert per_row_train > 2 * per_row_forward > 0 and estimate.per_iteration(lora) > 0  # backward ~ 2 fwd


def test_undoing_a_change_never_lowers_the_peak():
    name, script, argv, world = command("DenseGRPO, SD3.5-M, PickScore")
    e = estimate.estimate(name, script, argv, world, tiny=True)
    now = estimate.peak(e)
    assert estimate.peak(e, ("text encoders off the GPU",)) == pytest.approx(
        now + e["bytes"]["text encoders (on the CPU between encodings)"] / estimate.GIB)
    assert estimate.peak(e, ("indexed embeddings",)) > now
    undone = estimate.undone(name, script, argv, world, tiny=True, e=e)
    assert set(undone) >= {"activation checkpointing", "text encoders off the GPU", "indexed embeddings"}
    assert all(v >= now - 1e-9 for v in undone.values()), undone


def test_new_algorithms_rows():
    """CoCA keeps the sampler's velocities (T x P x G latents in bf16) unless plain Flow-GRPO keeps them too
    (the estimator reads flow_grpo.py's source), and its credit's x0 predictions (T x P x G float32 latents)
    add to the rewards phase; MixGRPO-Flash samples fewer steps than MixGRPO (fewer latents kept, fewer FLOPs)
    and keeps log-probs only for the steps its SDE samples; DanceGRPO's rows run dancegrpo.py."""
    plain = estimate.estimate(*command("Flow-GRPO, SD3.5-M"), tiny=True)
    coca = estimate.estimate(*command("Flow-GRPO + CoCA, SD3.5-M"), tiny=True)
    a, P, T = coca["args"], coca["P"], coca["args"].num_steps
    latents = T * P * a.group_size * coca["latent_bytes"]  # T x P x G float32 latents
    always = estimate.appends_unguarded(os.path.join(ROOT, "flow_grpo.py"), "sampler_velocities", "credit")
    assert coca["kept"] - plain["kept"] == (0 if always else latents // 2)
    assert coca["steps"]["velocities"] == T and plain["steps"]["velocities"] == (T if always else 0)
    assert coca["peak"]["rewards"] >= plain["peak"]["rewards"] + latents
    assert coca["nfe"] == plain["nfe"] == __import__("flow_grpo").planned_nfe(a)
    mix = estimate.estimate(*command("MixGRPO,"), tiny=True)
    flash = estimate.estimate(*command("MixGRPO-Flash"), tiny=True)
    mixgrpo = __import__("mixgrpo")
    assert mix["nfe"] == mixgrpo.planned_nfe(mix["args"], 0)
    assert flash["nfe"] == mixgrpo.planned_nfe(flash["args"], 0)
    assert estimate.per_iteration(flash) < estimate.per_iteration(mix) and flash["kept"] < mix["kept"]
    assert flash["nfe"]["rollout"] < mix["nfe"]["rollout"] and flash["nfe"]["train"] == mix["nfe"]["train"]
    last = mixgrpo.window_steps(flash["args"], 0)[-1]
    assert flash["steps"]["log_probs"] == last + 1 and mix["steps"]["log_probs"] == mix["args"].num_steps
    assert flash["steps"]["latents"] == last + mixgrpo.flash_points(flash["args"], last) + 1
    assert all(c[1] == "dancegrpo" for c in estimate.COMMANDS if "DanceGRPO" in c[0])
    dance = estimate.estimate(*command("1 GPU: DanceGRPO"), tiny=True)
    assert dance["nfe"] == __import__("dancegrpo").planned_nfe(dance["args"])
    assert dance["mb"] <= dance["args"].micro_batch and dance["steps"]["velocities"] == 0
    assert dance["bytes"]["reward models (bf16 towers)"] > 0  # HPS + CLIP


def test_dpo_and_crd_rows():
    """dpo.py holds its reference as a copy of the trainable weights (no frozen model), crd.py its old and sampling
    snapshots; CRD's prompts carry the negatives of its CFG-guided KL reference at guidance 1; the NFE are the
    files'."""
    fast = dict(tiny=True, phases=("training step",), count_flops=False)
    dpo = estimate.estimate(*command("Online Diffusion-DPO, SD3.5-M"), **fast)
    crd = estimate.estimate(*command("CRD, SD3.5-M"), **fast)
    for e, copies in ((dpo, 1), (crd, 2)):
        b = e["bytes"]
        assert b["old policy (float32)"] == copies * b["trainable (float32)"] > 0
        assert e["nfe"] == __import__(e["script"]).planned_nfe(e["args"])
    assert dpo["bytes"]["reference (bf16)"] == 0 and crd["bytes"]["reference (bf16)"] == 0  # LoRA: adapters off
    assert crd["args"].guidance == 1.0 and crd["cfg"] and dpo["cfg"]


@pytest.fixture(scope="module")
def tiny_tables():
    """The reward models' table and the evaluations' rows on tiny architectures."""
    return estimate.reward_models(tiny=True), [estimate.estimate_evaluate(s, tiny=True) for s in estimate.EVALUATIONS]


def test_reward_models_and_evaluation_rows(tiny_tables):
    """Float32 reward models hold ~2x the bytes of bf16 towers with float32 heads (ImageReward included); the
    evaluate.py row scores with float32 rewards and counts the ODE's NFE."""
    table = tiny_tables[0]
    assert set(table) == set(estimate.REWARD_TABLE)
    for name, r in table.items():
        bf16, fp32 = r["bf16"], r["float32"]
        assert bf16["params"] == fp32["params"] and fp32["peak"] > fp32["resident"] > bf16["resident"], name
        assert bf16["flops"] > 0
    ir = table["imagereward"]
    heads = 4 * sum(p.numel() for p in estimate.reward_model("imagereward", tiny=True)().heads.parameters())
    assert ir["float32"]["resident"] == pytest.approx(2 * (ir["bf16"]["resident"] - heads) + heads, rel=0.01)
    ev, spec = tiny_tables[1][estimate.EVALUATIONS.index(estimate.EVALUATE)], estimate.EVALUATE
    assert ev["nfe"] == spec["prompts"] // spec["world"] * spec["steps"]
    fp32 = sum(table[r]["float32"]["resident"] for r in spec["rewards"])
    assert ev["bytes"]["reward models (float32)"] == fp32
    assert set(ev["peak"]) == {"encode", "ODE", "decode", "rewards"} and ev["total_flops"] > 0


def covering() -> list[int]:
    """Indices of COMMANDS whose tiny runs take every code path the whole list takes: each single-GPU row
    (gpu_check compares its measurements with them), then, greedily, rows until every file, family, file and
    family with LoRA and with full fine-tuning, one GPU and several, and the text cache appear; the report of
    all rows is test_the_committed_report_is_its_row_files'."""
    import importlib

    import tyro

    def features(script, argv, world):
        a = tyro.cli(importlib.import_module(script).Args, args=argv.split())
        arch, full = estimate.ARCHITECTURE.get(a.model, a.model), a.full_finetune
        return {("file", script), ("family", arch), ("family", arch, full), ("file", script, full),
                ("one GPU", world == 1, full), ("text cache", a.text_cache is not None)}
    wanted = [features(*c[1:]) for c in estimate.COMMANDS]
    chosen = [i for i, c in enumerate(estimate.COMMANDS) if c[3] == 1]
    left = set().union(*wanted) - set().union(*(wanted[i] for i in chosen))
    while left:
        best = max(range(len(wanted)), key=lambda i: len(wanted[i] & left))
        chosen.append(best)
        left -= wanted[best]
    return sorted(chosen)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """results/estimate.py --tiny's report of the covering rows (gpu_check's test compares with it too)."""
    out = tmp_path_factory.mktemp("estimate") / "estimate.md"
    only = [str(i) for i in covering()]
    proc = run_script("results/estimate.py", ["--tiny", "--no-undo", "--out", str(out), "--only", *only],
                      check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_estimate_script_writes_every_code_path(tiny_report):
    """Every covering command, reward model and evaluation in the report's tables (the re-measurements of the
    before/after table, estimate.undone, are test_undoing_a_change_never_lowers_the_peak's)."""
    out, names = tiny_report, [estimate.COMMANDS[i][0] for i in covering()]
    assert len(names) < len(estimate.COMMANDS) / 2
    text = out.read_text()
    for name in names:
        assert text.count(f"| {name} |") == 3, name  # the peak, the resident and the before/after tables
    for name in estimate.REWARD_TABLE:
        assert text.count(f"| {name} |") == 1, name
    for spec in estimate.EVALUATIONS:
        assert text.count(f"| {spec['name']} |") == 1
    rows = estimate.read_table(str(out))
    assert set(rows) == set(names)
    assert all(set(estimate.PHASES) <= set(r) for r in rows.values())


@pytest.mark.slow
def test_gpu_check_script_runs_on_a_tiny_model(tmp_path, tiny_report):
    """results/gpu_check.py is what a session with a GPU runs: one whole iteration of each single-GPU
    configuration through its algorithm file; its code path works on a CPU, on tiny models."""
    out = tmp_path / "gpu_check.json"
    # in bf16, the GPU's dtype: a float32 buffer filled with bf16 velocities failed only there
    proc = run_script("results/gpu_check.py", ["--tiny", "--dtype", "bf16", "--out", str(out), "--estimate",
                                               str(tiny_report)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = json.loads(out.read_text())["configurations"]
    single = [c for c in estimate.COMMANDS if c[0].startswith("1 GPU") and c[3] == 1]
    single += gpu_check.FAMILY_CHECKS
    models = [gpu_check.model_of(c) for c in single]
    grouped = [c[0] for m in dict.fromkeys(models) for c, n in zip(single, models) if n == m]  # a build each
    assert [c["name"] for c in configs] == grouped
    # one command per newer family (models.py), FLUX.2 [klein] and [dev] with a text cache of the check's own
    families = {estimate.model_architecture(m)[0] for m in models} - {"sd3", "flux"}
    assert families == {"qwenimage", "flux2", "zimage", "wan"} and len(set(models)) == 7
    assert sum("--text-cache" in c["argv"] for c in configs) == 4  # FLUX.2 [klein] (and editing), [dev], Wan
    for c in configs:
        assert c["ok"] and c["iterations"] == 1 and c["checkpoints_saved"] == 1, c
        if c["script"] not in ("diffusion_nft", "dgpo"):  # a ratio of likelihoods (DiffusionNFT, DGPO: none)
            assert c["first_ratio_max_dev"] == 0, c["name"]  # sampling and training agree exactly
        nfe = c["nfe"]
        assert nfe["rollout_per_prompt"] == nfe["planned_rollout_per_prompt"], c["name"]
        assert nfe["per_iteration"] == nfe["planned_per_iteration"], c["name"]
        not_run = {"evaluation encode", "evaluation", "seconds, H100"}
        assert set(c["measured_gib"]) == set(c["estimate"]) - not_run, c["name"]
        assert "training step" in c["measured_gib"] and c["lora gradients"] > 0, c["name"]
        assert c["base_weights_unchanged"] and c["seconds_per_iteration"] > 0 and c["rollout_seconds"] > 0
    assert "| training step |" in proc.stdout
    assert [c[0] for c in gpu_check.configurations(["coca"])] == ["1 GPU: Flow-GRPO + CoCA, SD3.5-M (LoRA)"]


# one LoRA command per newer family (models.py), small enough for seconds on tiny architectures
SMALL = " --lora-rank 4 --lora-alpha 8 --prompts-per-iteration 8 --group-size 4 --micro-batch 2 --eval-num 8"
FAMILY_COMMANDS = [("qwen-image", "flow_grpo", "--model qwen-image --guidance 4 --max-sequence-length 256"),
                   ("flux2-dev", "awm", "--model flux2-dev --guidance 4"),
                   ("flux2-klein-base-4b", "diffusion_nft", "--model flux2-klein-base-4b --guidance 4"),
                   ("z-image", "flow_grpo", "--model z-image --guidance 4")]
# Qwen-Image and [klein]: COMMANDS' rows, which test_estimate_script_writes_every_code_path runs as well
CHECKED = [c for c in FAMILY_COMMANDS if c[0] in ("flux2-dev", "z-image")]


@pytest.mark.parametrize("model,script,argv", CHECKED, ids=[c[0] for c in CHECKED])
def test_every_family_runs(model, script, argv):
    """Every phase of a newer family's command on its tiny architecture, with the embeddings its velocity
    reads (true CFG's negatives where the family has them; FLUX.2 [dev] embeds its guidance instead)."""
    e = estimate.estimate(model, script, argv + SMALL, 8, tiny=True)
    assert set(e["peak"]) == set(estimate.PHASES) and "fill" not in e
    assert e["kind"] == estimate.model_architecture(model)[0] and e["flops"]["training step"] > 0
    assert e["cfg"] == (model != "flux2-dev")
    assert e["bytes"]["text encoders (on the CPU between encodings)"] == e["text_bytes"] > 0
    assert min(e["peak"].values()) > sum(e["bytes"].values()) - e["text_bytes"]  # everything resident counted


def test_the_text_cache_drops_the_text_encoders():
    """With --text-cache the encode phases hold the embeddings alone (a smaller peak, no text encoder
    resident), the start-up's fill holds the encoders, and training is unchanged."""
    name, script, argv = FAMILY_COMMANDS[2]
    plain = estimate.estimate(name, script, argv + SMALL, 8, tiny=True)
    cached = estimate.estimate(name, script, argv + SMALL + " --text-cache /tmp/cache", 8, tiny=True)
    assert cached["bytes"]["text encoders (on the CPU between encodings)"] == 0
    for phase in ("encode", "evaluation encode"):
        assert cached["peak"][phase] < plain["peak"][phase] - plain["text_bytes"] // 2, phase
    assert cached["fill"] >= plain["text_bytes"]  # the encoders alone on the GPU, encoding 16 prompts
    assert cached["peak"]["training step"] == pytest.approx(plain["peak"]["training step"], rel=0.01)
    assert estimate.peak(cached, ("text encoders off the GPU",)) > estimate.peak(cached)


def test_editing_rows_carry_the_sources_tokens():
    """An editing row's forwards see the source's tokens after the target's: FLUX.2 [klein] with one reference
    at the target's size has twice the image tokens, so the rollout's and the training step's FLOPs grow by at
    least the sequence's factor (the linear layers) and at most its square (attention), and their peaks grow;
    Qwen-Image-Edit's encode reads the source's image tokens (and the VAE's), the Kontext README row scores
    with the CLIP image tower of image_similarity (GenEval: a server)."""
    name, script, argv, world = command("1 GPU (24 GB): Flow-GRPO, FLUX.2 [klein] base 4B, editing")
    fast = dict(tiny=True, phases=("rollout", "training step"))
    edit = estimate.estimate(name, script, argv, world, **fast)
    plain = estimate.estimate(name, script, argv.replace(" --condition-size 512", ""), world, **fast)
    image, cond = math.prod(edit["shape"][1:]), edit["edit"]["cond_tokens"]
    assert cond == image > 0 and plain["edit"] is None
    factor = (image + cond + edit["tokens"]) / (image + edit["tokens"])
    for phase in ("rollout", "training step"):
        ratio = edit["flops"][phase] / plain["flops"][phase]
        assert 0.95 * factor <= ratio <= factor**2, (phase, ratio, factor)
        assert edit["peak"][phase] > plain["peak"][phase], phase
    qwen = estimate.estimate(*command("Flow-GRPO, Qwen-Image-Edit-2511"), tiny=True, count_flops=False,
                             phases=("encode", "training step"))
    assert qwen["kind"] == "qwenimage_edit" and qwen["edit"]["vl_tokens"] > 0 and qwen["cfg"]
    assert qwen["edit"]["cond_tokens"] == math.prod(qwen["shape"][1:]) // 4  # packed 2 x 2, as the target
    kontext = estimate.estimate(*command("Flow-GRPO, FLUX.1 Kontext"), tiny=True, count_flops=False,
                                phases=("rewards",))
    assert kontext["kind"] == "kontext" and kontext["bytes"]["reward models (bf16 towers)"] > 0
    assert kontext["edit"]["cond_tokens"] == math.prod(kontext["shape"][1:]) // 4


def test_released_architectures_have_the_published_sizes():
    """The configs built at real size (on the meta device, seconds) have the published parameter counts."""
    for arch, published in estimate.PUBLISHED.items():
        for built, count in zip(estimate.parameter_counts(arch), published):
            assert built == pytest.approx(count, rel=0.06 if count < 1e9 else 0.02), arch  # VAEs: "0.08B"
    aliases = set(__import__("common").MODEL_ALIASES) - set(estimate.TOY_ALIASES)
    assert aliases == set(estimate.ARCHITECTURE)  # every --model alias has its architecture
    assert set(estimate.ARCHITECTURE.values()) <= set(estimate.PUBLISHED) | {"flux", "sd3"} | {
        a for a in estimate.ARCHITECTURE.values() if a.startswith("wan")}


@pytest.mark.slow
def test_video_rows():
    """The Wan rows: latents with a frame axis (33 frames -> 9 latent frames), decoded videos of every frame kept
    for the rewards, an image reward on the frames --frame-reduce picks (mean: all 33; stride:4 of 9: 3), the
    UMT5 embeddings from the text cache, and the 14B sharded (FSDP2) with true CFG."""
    rows = {c[0].split(",")[1].strip(): c for c in estimate.COMMANDS  # the scale rows, not the README's recipes
            if "Wan" in c[0] and c[3] == 8 and not c[0].endswith(("recipe)", "(ours)"))}
    assert set(rows) == {"Wan2.1-T2V-1.3B", "Wan2.2-TI2V-5B", "Wan2.1-T2V-14B"}
    e = estimate.estimate(*rows["Wan2.1-T2V-14B"], tiny=True, count_flops=False)
    assert len(e["shape"]) == 4 and e["shape"][1] == 9 and e["pixels"][:2] == (3, 33) and e["frames_scored"] == 33
    assert e["sharded"] and e["cfg"] and e["bytes"]["text encoders (on the CPU between encodings)"] == 0
    assert e["kept"] >= e["P"] * e["args"].group_size * 4 * math.prod(e["pixels"])  # the decoded videos
    e = estimate.estimate(*rows["Wan2.2-TI2V-5B"], tiny=True, count_flops=False)
    assert e["shape"][0] == 48 and e["pixels"][1] == 9 and e["frames_scored"] == 3 and not e["sharded"]
    assert set(e["peak"]) == set(estimate.PHASES)


def test_only_models_a_third_of_the_card_stay_gathered_over_a_rollout():
    """common.fits_gathered on an 80 GB card (as the estimate models it): FLUX.1-dev's and SD3.5-M's bf16
    weights stay gathered over a rollout, Qwen-Image's and FLUX.2 [dev]'s are gathered a block at a time."""
    import common

    share = common.GATHER_SHARE * estimate.CARD_BYTES
    for arch, fits in (("flux", True), ("sd3", True), ("qwen-image", False), ("flux2-dev", False)):
        assert (2 * estimate.parameter_counts(arch)[0] <= share) == fits, arch
    assert common.fits_gathered(torch.nn.Linear(4, 4))  # on a CPU: always


# ---------------------------------------------------------------- the row files and the committed report
def test_rows_are_reused_recomputed_or_rebuilt(tmp_path, monkeypatch, capsys, tiny_tables):
    """A rerun reuses the row file its command made and computes no estimate; a file made by another command
    or setting, one cut short, and every file under --fresh are recomputed; the report is rebuilt from the files
    and equals the one the live estimate gives."""
    index = next(i for i, c in enumerate(estimate.COMMANDS) if c[0] == "1 GPU: AWM, SD3.5-M (LoRA)")  # seconds
    name, made, real = estimate.COMMANDS[index][0], [], estimate.estimate

    def once(*args, **kwargs):  # the estimate made once, then handed out again (the test is of the row files)
        made.append(made[0] if made else real(*args, **kwargs))
        return copy.deepcopy(made[-1])
    monkeypatch.setattr(estimate, "estimate", once)
    rewards, evaluations = tiny_tables
    monkeypatch.setattr(estimate, "reward_models", lambda **k: copy.deepcopy(rewards))
    monkeypatch.setattr(estimate, "estimate_evaluate",
                        lambda spec, **k: copy.deepcopy(evaluations[estimate.EVALUATIONS.index(spec)]))
    out, path = tmp_path / "estimate.md", tmp_path / "estimate" / "rows" / (estimate.slug(name) + ".json")

    def run(*extra):
        argv = ["--tiny", "--no-undo", "--only", str(index), "--out", str(out), *extra]
        monkeypatch.setattr(sys, "argv", ["estimate.py", *argv])
        calls = len(made)
        estimate.main()
        return [e["name"] for e in made[calls:]], capsys.readouterr()

    assert run()[0] == [name] and path.is_file()
    first, live = out.read_text(), made[0]
    assert f"| {name} |" in first and "Not estimated yet: " in first and "Every row was measured at commit" in first
    computed, printed = run()
    assert computed == [] and f"{name}: reused {path}" in printed.out and out.read_text() == first
    row = json.loads(path.read_text())
    assert row["fingerprint"] == {"table": "command", "name": name, "script": "awm",
                                  "argv": estimate.COMMANDS[index][2], "world": 1, "tiny": True, "undo": False}
    assert row["commit"] == estimate.code_state()["commit"] and row["seconds"] > 0
    row["fingerprint"]["argv"] += " --eval-num 8"
    path.write_text(json.dumps(row))
    computed, printed = run()
    assert computed == [name] and f"{path}: made with another argv; recomputed" in printed.err
    text = path.read_text()
    path.write_text(text[:len(text) // 2])  # a write cut short by a kill (write_row itself renames a whole file)
    computed, printed = run()
    assert computed == [name] and f"{path}: unreadable (JSONDecodeError" in printed.err
    assert run("--fresh")[0] == [name]
    # a row with the before/after table's re-measurements serves a run without them, not the other way round
    fingerprint = row["fingerprint"]
    assert estimate.serves({**fingerprint, "undo": True}, fingerprint)
    assert not estimate.serves(fingerprint, {**fingerprint, "undo": True})
    # the report of the row read back is the report of the live estimate
    paths = [tmp_path / "live.md", tmp_path / "read.md"]
    for e, p in zip((live, estimate.from_row(estimate.plain(estimate.to_row(live)))), paths):
        estimate.report([e], str(p), made="")
    assert paths[0].read_text() == paths[1].read_text()
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["estimate.py", "--tiny", "--only", str(len(estimate.COMMANDS))])
    with pytest.raises(SystemExit, match=f"--only {len(estimate.COMMANDS)}: COMMANDS has indices 0 to"):
        estimate.main()


def test_the_committed_report_is_its_row_files(tmp_path):
    """results/estimate.md is what its row files give, with a row for every command, the reward models and
    each evaluation, each made by the command as COMMANDS has it now, and no other row file beside them."""
    rows = os.path.join(ROOT, "results", "estimate", "rows")
    paths = estimate.row_paths(rows)
    assert sorted(os.listdir(rows)) == sorted(os.path.basename(p) for p in paths.values())
    out = tmp_path / "estimate.md"
    estimate.write_report(rows, str(out), tiny=False)
    text = out.read_text()
    assert "Not estimated yet" not in text
    with open(os.path.join(ROOT, "results", "estimate.md")) as f:
        assert f.read() == text


# the README's command lines that have no row of their own: the calibration of DenseGRPO's psi(t) (a third of
# the training run's prompts per iteration); the data, checkpoint and cache paths do not change the estimate
NOT_ROWS = ("--calibrate",)
PATHS = ("prompts", "eval_prompts", "text_cache", "psi", "psi_out", "hps_checkpoint", "clip_model")


def parsed(script, argv):
    """The Args a command line gives its file, less the paths."""
    import tyro

    args = tyro.cli(__import__(script).Args, args=argv)
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in PATHS and k != "reward_models"}


def readme_commands():
    """(script, world, argv) of every torchrun line of the README, its shell variables expanded."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    variables, out = {}, []
    for line in lines:
        if m := re.fullmatch(r'([A-Z]+)="([^"]*)"(\s+#.*)?', line.strip()):
            variables[m[1]] = m[2]
        elif line.startswith("torchrun "):
            words = re.sub(r"\$([A-Z]+)", lambda m: variables[m[1]], re.split(r"\s+#", line)[0]).split()
            at = next(i for i, w in enumerate(words) if w.endswith(".py"))
            launcher = dict(zip(words[1:at:2], words[2:at:2]))
            world = int(launcher.get("--nnodes", 1)) * int(launcher["--nproc_per_node"])
            out.append((words[at][:-3], world, words[at + 1:]))
    return out


def test_every_readme_command_is_a_row():
    """Each torchrun line of the README (its shell variables expanded) is a row of COMMANDS: the same file, GPUs
    and Args but for data, checkpoint and cache paths; so results/estimate.md estimates what the README runs."""
    commands = readme_commands()
    assert len(commands) >= 20 and any(w == 32 for _, w, _ in commands)  # (the 4 x 8 MixGRPO line parsed)
    rows = {(script, world): [] for _, script, _, world in estimate.COMMANDS}
    for _, script, argv, world in estimate.COMMANDS:
        rows[(script, world)].append(parsed(script, argv.split()))
    for script, world, argv in commands:
        if any(flag in argv for flag in NOT_ROWS):
            continue
        assert parsed(script, argv) in rows.get((script, world), []), (script, world, " ".join(argv))
