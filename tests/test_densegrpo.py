"""densegrpo.py: dense rewards, calibration, NFE against the closed form, smoke runs on tiny random pipelines."""
import json
import re

import pytest
import torch

import densegrpo
from helpers import check_args, read_metrics, run_script, tiny_flags


def test_dense_rewards_telescope_exactly():
    r = torch.rand(11, 50, generator=torch.Generator().manual_seed(0))  # R(x_i), i = 0 (noise) .. 10 (final image)
    delta = densegrpo.dense_rewards(r)
    assert delta.shape == (10, 50)
    assert torch.equal(delta.sum(0), r[10].double() - r[0].double())  # sum_t Delta R_t = R_0 - R_T, bit for bit
    assert torch.equal(densegrpo.dense_rewards(r, baseline=True), r[1:].double())


def test_calibration_rule():
    psi = [0.7, 0.7, 0.7, 1.0, 0.1]
    delta = torch.tensor([[1.0, 1.0, 1.0, 0.5, 0.1], [-1.0, 1.0, 1.0, -0.5, 0.2], [0.0, 1.0, -1.0, 0.0, 0.3]])
    # balance |#pos - #neg| per step: 0, 3, 1, 0, 3 -> < eps1 = 2 raises psi, else lowers it; clamped to [0.1, 1.0]
    new = densegrpo.calibrate_step(psi, delta, eps1=2, eps2=0.01, psi_range=(0.1, 1.0), groups=1)
    assert new == pytest.approx([0.71, 0.69, 0.71, 1.0, 0.1])


@pytest.mark.slow
@pytest.mark.parametrize("n,expected", [(1, 240), (2, 456), (None, 1320)])
def test_nfe_equals_closed_form(tiny, tmp_path, n, expected):
    """Per prompt G (T + sum_t (min(n, t) - 1)), the sampler's v(x_t) reused as each completion's first step:
    240 / 456 / 1320 for n = 1 / 2 / t at T = 10, G = 24 (Flow-GRPO: 240)."""
    run_script("densegrpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, num_steps=10, group_size=24,
                                          prompts_per_iteration=1, micro_batch=48, dense_ode_steps=n, num_iterations=1,
                                          eval_every=0, updates_per_iteration=1))
    _, m = read_metrics(tmp_path)
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] == expected


def test_pure_ode_gives_zero_dense_rewards(tmp_path):
    """Without noise (psi = 0) every latent of a trajectory is a point of the ODE path, so its completion (n = t)
    lands on the trajectory's final latent: every R_t is equal and every Delta R_t is 0. A psi file that is 0 at
    every trained step is therefore refused (nothing could be trained, yet a checkpoint would be exported)."""
    import common
    from tiny import build_flux

    pipe = build_flux()
    sigmas = common.pipeline_sigmas(pipe, "flux", num_steps=4, shape=(16, 16, 16))
    emb = common.encode_prompts(pipe, "flux", ["a red circle"], max_sequence_length=16)
    x = [torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        for i in range(4):  # the sampler with psi = 0 at every step: the Euler ODE
            v = common.velocity(pipe.transformer, "flux", x[i], sigmas[i], emb, guidance=3.5)
            x.append(densegrpo.sde_step(v, x[i], sigmas, i, 0.0)[0])
        paths = [densegrpo.spaced_indices(i, 4, 4) for i in range(4)]
        x0 = common.ode_complete(pipe.transformer, "flux", torch.cat(x[:4]), paths, sigmas, emb, guidance=3.5,
                                 micro_batch=4, emb_index=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(x0, x[4].expand(4, -1, -1, -1), rtol=0, atol=1e-5)
    r = common.score({"jpeg": common.jpeg_compressibility}, common.decode(pipe, torch.cat([x0, x[4]])), [""] * 5)
    assert densegrpo.dense_rewards(r["jpeg"].view(5, 1)).abs().max() < 1e-4  # a flipped pixel at most
    (tmp_path / "psi.json").write_text(json.dumps({"psi": [0.0] * 4}))
    with pytest.raises(SystemExit, match=r"is 0 at every trained step \(the first 3\): none has noise to train"):
        check_args(densegrpo, num_steps=4, psi=str(tmp_path / "psi.json"))


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_two_iterations(tiny, tmp_path, kind):
    run_script("densegrpo.py", tiny_flags(tiny[kind], tiny["prompts"], tmp_path, guidance=4.5 if kind == "sd3" else 3.5))
    _, m = read_metrics(tmp_path)
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6 and "eval/jpeg" in m[2] and m[2]["train/kl"] > 0
    assert m[1]["perf/nfe_rollout_per_prompt"] == m[1]["perf/nfe_min_per_prompt"] == 4 * (4 + 6)


@pytest.mark.slow
def test_calibration_mode_writes_psi_and_training_loads_it(tiny, tmp_path):
    out = tmp_path / "psi.json"
    proc = run_script("densegrpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "cal", calibrate=True,
                                                 psi_out=out, num_iterations=3, eval_every=0))
    # its own summary: the calibration's iterations and NFE (closed form: G (T + sum_i (T - i - 1)) per prompt), psi's file
    assert re.search(r"densegrpo on .*: 3 iterations in \d+ s, 240 transformer evaluations", proc.stdout), proc.stdout
    assert f"psi(t) after the last calibration iteration: {out} (train with --psi {out})" in proc.stdout
    saved = json.loads(out.read_text())
    psi = saved["psi"]
    assert len(psi) == 4 and all(round(abs(p - 0.7), 9) in (0.01, 0.03) for p in psi[:3])  # 3 moves of +-0.01 each
    assert psi[3] == 0.7  # the untrained last step is taken without noise: no information, psi left alone
    assert len(saved["history"]) == 3 and saved["history"][-1] == psi
    run_script("densegrpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "train", psi=out, num_iterations=1,
                                          eval_every=0))
    _, m = read_metrics(tmp_path / "train")
    assert [m[1][f"psi/step_{i}"] for i in range(4)] == pytest.approx(psi)


@pytest.mark.slow
def test_torchrun_two_processes(tiny, tmp_path):
    run_script("densegrpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path, prompts_per_iteration=4), nproc=2)
    _, m = read_metrics(tmp_path)
    assert m[1]["train/first_ratio_max_dev"] <= 1e-6 and "eval/jpeg" in m[2]
    # calibration on two ranks: every rank leaves its last iteration (no rank waits in a checkpoint barrier alone)
    out = tmp_path / "psi.json"
    run_script("densegrpo.py", tiny_flags(tiny["flux"], tiny["prompts"], tmp_path / "cal", prompts_per_iteration=4,
                                          calibrate=True, psi_out=out, num_iterations=2, save_every=1), nproc=2, timeout=300)
    assert len(json.loads(out.read_text())["history"]) == 2



@pytest.mark.parametrize("over,message", [
    ({"dense_ode_steps": 0}, r"--dense-ode-steps 0 is not allowed; use a value in \[1, 1000\]"),
    ({"dense_ode_steps": 11}, r"--dense-ode-steps 11 is not allowed; use 1..10 or t"),
    ({"eps1": 0.0}, "--eps1 0.0 is not allowed; use a value in \\(0, 1e4\\]"),
    ({"eps2": -0.01}, "--eps2 -0.01 is not allowed; use a value in \\(0, 10\\]"),
    ({"calibrate": True, "psi_range": (1.5, 0.1)}, r"--psi-range 1.5 0.1 is not allowed; give the lower bound first"),
    ({"group_size": 1}, "--group-size 1 is not allowed; GRPO needs at least 2 images per prompt"),
])
def test_bad_input(over, message):
    with pytest.raises(SystemExit, match=message):
        check_args(densegrpo, **over)


def test_bad_psi_files(tmp_path):
    (tmp_path / "short.json").write_text(json.dumps({"psi": [0.7] * 3}))
    with pytest.raises(SystemExit, match="has 3 values; --num-steps 10 needs one per step"):
        densegrpo.load_psi(str(tmp_path / "short.json"), 10)
    for bad in ([0.7, -0.1], [0.7, float("nan")], [0.7, 50], [True, True], [0.7, "0.7"]):  # JSON: NaN, true
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=r"holds no list of noise levels in \[0, 10\]; expected"):
            densegrpo.load_psi(str(tmp_path / "bad.json"), 2)
    (tmp_path / "zero.json").write_text(json.dumps([0.0] * 9 + [0.7]))  # noise only at the untrained last step
    with pytest.raises(SystemExit, match=r"is 0 at every trained step \(the first 9\): none has noise to train"):
        check_args(densegrpo, psi=str(tmp_path / "zero.json"))
    with pytest.raises(SystemExit, match=r"cannot be read as JSON \(FileNotFoundError\); write one with --calibrate"):
        densegrpo.load_psi(str(tmp_path / "missing.json"), 2)
    (tmp_path / "broken.json").write_text('{"psi": [0.7, ')
    with pytest.raises(SystemExit, match=r"cannot be read as JSON \(JSONDecodeError\); write one with --calibrate"):
        densegrpo.load_psi(str(tmp_path / "broken.json"), 2)
    (tmp_path / "latin1.json").write_bytes('{"psi": [0.7, 0.7]} \u00e9'.encode("latin-1"))  # not UTF-8
    with pytest.raises(SystemExit, match=r"cannot be read as JSON \(UnicodeDecodeError\); write one with --calibrate"):
        densegrpo.load_psi(str(tmp_path / "latin1.json"), 2)
    (tmp_path / "words.json").write_text('{"psi": ["a", "b"]}')
    with pytest.raises(SystemExit, match="holds no list of noise levels"):
        densegrpo.load_psi(str(tmp_path / "words.json"), 2)
    # checked before any model loads
    with pytest.raises(SystemExit, match="cannot be read as JSON"):
        check_args(densegrpo, psi=str(tmp_path / "broken.json"))
