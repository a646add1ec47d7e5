"""Closed-form and equivalence checks of the schedule, SDE/ODE steps, log-probs and advantages (the files' own
functions: flow_grpo.py's SDE step and advantages, dancegrpo.py's, g2rpo.py's ODE step and strides)."""
import math

import pytest
import torch

import dancegrpo
import flow_grpo
from common import shifted_sigmas
from flow_grpo import group_advantages, sde_step
from g2rpo import ode_step, strided_indices

SDE_STEP = {"flow_grpo": flow_grpo.sde_step, "dance": dancegrpo.sde_step}  # g = a sqrt(sigma / (1 - sigma)), eta


def exact_velocity(x, sigma, m, s):
    """Flow-matching velocity E[eps - x0 | x_sigma] for data ~ N(m, s^2 I), x_sigma = (1 - sigma) x0 + sigma eps."""
    a = 1 - sigma
    var = a**2 * s**2 + sigma**2
    return (sigma - a * s**2) / var * (x - a * m) - m


M, S, N = 1.5, 0.5, 40_000  # data mean and std; Monte Carlo samples (4 dims each)
TOL = 5 * math.sqrt(2 / (4 * N)) + 0.02  # 5 standard errors of a std estimate plus discretisation slack


def test_schedule_endpoints_and_shift():
    s = shifted_sigmas(16, shift=3.0)
    assert len(s) == 17 and s[0] == 1 and s[-1] == 0 and (s[1:] < s[:-1]).all()
    u = torch.linspace(1, 0, 17, dtype=torch.float64)
    torch.testing.assert_close(s, (3 * u / (1 + 2 * u)).float())
    torch.testing.assert_close(shifted_sigmas(4, shift=1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


@pytest.mark.parametrize("start,end,stride,expected", [(1, 16, 1, list(range(1, 17))), (1, 16, 3, [1, 4, 7, 10, 13, 16]),
                                                        (3, 16, 2, [3, 5, 7, 9, 11, 13, 15, 16]), (15, 16, 3, [15, 16])])
def test_strided_indices_end_at_zero(start, end, stride, expected):
    idx = strided_indices(start, end, stride)
    assert idx == expected and len(idx) - 1 == math.ceil((end - start) / stride)


def test_ode_transports_noise_to_data():
    torch.manual_seed(0)
    sigmas = shifted_sigmas(200, shift=1.0)
    x = torch.randn(N, 4)
    for i in range(200):
        x = ode_step(exact_velocity(x, float(sigmas[i]), M, S), x, sigmas[i], sigmas[i + 1])
    assert abs(x.mean() - M) < TOL and abs(x.std() - S) < TOL


@pytest.mark.parametrize("form,level", [("flow_grpo", 0.3), ("flow_grpo", 0.7), ("flow_grpo", 1.0), ("dance", 0.3),
                                        ("dance", 0.7)])
def test_sde_keeps_every_marginal(form, level):
    """The correction term makes the SDE share the ODE's marginals N((1 - sigma) m, (1 - sigma)^2 s^2 + sigma^2).
    Started from the exact marginal at sigma = 0.9 (away from the singular coefficient at sigma = 1, see below)."""
    gen = torch.Generator().manual_seed(1)
    sigmas = torch.cat([torch.ones(1), torch.linspace(0.9, 0, 101)])  # index 0 (sigma = 1) is only the reference
    x = (1 - 0.9) * (M + S * torch.randn(N, 4, generator=gen)) + 0.9 * torch.randn(N, 4, generator=gen)
    for i in range(1, 101):
        x, _, _, _ = SDE_STEP[form](exact_velocity(x, float(sigmas[i]), M, S), x, sigmas, i, level, generator=gen)
        sig = float(sigmas[i + 1])
        assert abs(x.mean() - (1 - sig) * M) < TOL, (i, sig)
        assert abs(x.std() - math.sqrt((1 - sig) ** 2 * S**2 + sig**2)) < TOL, (i, sig)


@pytest.mark.parametrize("level", [0.3, 0.7, 1.0])
def test_first_step_from_pure_noise_closed_form(level):
    """At sigma = 1 the official coefficient uses sigma' = sigmas[1], so g^2 |dt| = a^2 and one Euler-Maruyama step
    gives Var = (1 + dt - a^2 / 2)^2 + a^2 exactly (the continuous SDE would give (1 + dt)^2 + dt^2 s^2)."""
    gen = torch.Generator().manual_seed(3)
    sigmas = shifted_sigmas(100, shift=1.0)
    x = torch.randn(N, 4, generator=gen)
    x1, _, _, std = sde_step(exact_velocity(x, 1.0, M, S), x, sigmas, 0, level, generator=gen)
    dt = float(sigmas[1]) - 1
    assert std**2 == pytest.approx(level**2, rel=1e-5)
    assert abs(x1.var() - ((1 + dt - level**2 / 2) ** 2 + level**2)) < 5 * math.sqrt(2 / (4 * N)) * 1.5


def test_log_prob_matches_torch_normal_and_noise_scale():
    gen = torch.Generator().manual_seed(2)
    sigmas = shifted_sigmas(10, shift=3.0)
    x, v = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 4, 8, 8, generator=gen)
    for i in (0, 4, 9):
        x_next, log_prob, mean, std = sde_step(v, x, sigmas, i, 0.7, generator=gen)
        ref = torch.distributions.Normal(mean, std).log_prob(x_next).mean(dim=(1, 2, 3))
        torch.testing.assert_close(log_prob, ref, rtol=1e-5, atol=1e-5)
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        denom = 1 - (float(sigmas[1]) if i == 0 else sigma)  # sigma == 1 uses the schedule's second sigma
        assert std == pytest.approx(0.7 * math.sqrt(sigma / denom) * math.sqrt(sigma - sigma_next), rel=1e-6)
        # recomputing with the sample given reproduces the same log-prob bit for bit
        assert torch.equal(sde_step(v, x, sigmas, i, 0.7, prev_sample=x_next)[1], log_prob)
        # the mean and std the KL uses are the step's own whatever sample is given
        _, _, m2, s2 = sde_step(v, x, sigmas, i, 0.7, prev_sample=torch.zeros_like(x))
        assert torch.equal(m2, mean) and s2 == std
    # DanceGRPO's constant coefficient: std = eta sqrt(-dt)
    _, _, _, std = dancegrpo.sde_step(v, x, sigmas, 4, 0.3, generator=gen)
    assert std == pytest.approx(0.3 * math.sqrt(float(sigmas[4] - sigmas[5])), rel=1e-6)


def test_noise_level_zero_is_euler():
    sigmas = shifted_sigmas(10, shift=3.0)
    x, v = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    x_next, log_prob, mean, std = sde_step(v, x, sigmas, 3, 0.0, generator=torch.Generator())
    assert std == 0 and torch.equal(x_next, mean) and (log_prob == 0).all()
    torch.testing.assert_close(x_next, ode_step(v, x, sigmas[3], sigmas[4]))


def test_group_advantages():
    """DanceGRPO's sample std per group, Flow-GRPO's population std (here over all the iteration's rewards)."""
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.1, 0.1, 0.1, 0.1]])
    adv = dancegrpo.group_advantages(r, eps=1e-8, global_std=False)
    expected = (r[0] - 2.5) / (r[0].std() + 1e-8)
    torch.testing.assert_close(adv[0], expected)
    assert torch.equal(adv[1], torch.zeros(4))  # equal rewards: exactly zero, not (r - mean) / eps
    pop = group_advantages(r, eps=1e-4, global_std=True)
    torch.testing.assert_close(pop[0], (r[0] - 2.5) / (r.double().std(unbiased=False).float() + 1e-4))
    per_group = group_advantages(r, eps=1e-4, global_std=False)
    torch.testing.assert_close(per_group[0], (r[0] - 2.5) / (r[0].std(unbiased=False) + 1e-4))


def test_combine_advantages_modes():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 6, generator=g), 100 * torch.rand(3, 6, generator=g)
    norm = dict(eps=1e-8, global_std=False)
    for module in (flow_grpo, dancegrpo):  # the same combination over each file's own advantages
        per = module.combined_advantages({"a": a, "b": b}, {"a": 1.0, "b": 2.0}, mode="advantages", **norm)
        torch.testing.assert_close(per, module.group_advantages(a, **norm) + 2 * module.group_advantages(b, **norm))
        summed = module.combined_advantages({"a": a, "b": b}, {"a": 1.0, "b": 2.0}, mode="rewards", **norm)
        torch.testing.assert_close(summed, module.group_advantages(a + 2 * b, **norm))
    # no clipping inside: one outlier of 100 gets (1 - 0.01) / std = 9.9, the files clip it to +-5 themselves
    big = dancegrpo.combined_advantages({"a": torch.tensor([[0.0] * 99 + [1.0]])}, {"a": 1.0}, mode="rewards",
                                        **norm)
    assert big.max() == pytest.approx(9.9, rel=1e-3) and big.clamp(-5, 5).max() == 5.0
