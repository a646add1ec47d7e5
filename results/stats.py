"""The one statistical procedure behind every interval and verdict of results/ (compare.py, hacking.py; described
in docs/results.md, "How the intervals are made").

What varies between repetitions of a comparison is which training seeds a configuration ran and which prompt/seed
pairs it was evaluated on. Every run is scored on the same fixed pairs, so seeds and pairs are crossed, not nested,
and an interval resamples both (Owen 2007, "The pigeonhole bootstrap"): each of RESAMPLES resamples draws the pairs
with replacement once, the same draw for every run and every configuration (a difference between configurations
stays paired), and, independently per configuration, its seeds with replacement; a statistic (a mean change, a
difference, a speed-up, a peak chosen out of sample) is recomputed on each resample from the runs' per-pair scores.

The interval is the percentile interval of all resamples, none left out (a resample in which a curve never
reaches a target counts at the least and at the most that its runs allow, see `interval`), widened for few seeds:
each half of it, from the resamples' median to its 2.5th and 97.5th percentiles, is stretched by
c = sqrt(n / (n - 1)) t_{n-1}(0.975) / z(0.975), n the smallest seed count of the configurations involved.
For a mean of n normal seeds (pairs aside) that is the t interval: the bootstrap's spread is the seeds' SD over
sqrt(n) times sqrt((n - 1) / n) (Hesterberg 2015, "What teachers should know about the bootstrap", widens the
percentile interval by the same two factors), and the percentiles keep what is skewed in a ratio or a peak.
c = 1.22 for 10 seeds, 1.58 for 5, 2.69 for 3. Ratios and times are stretched on the log scale.

A claim is resolved only by such an interval: "better" when the interval of a - b lies above 0, "comparable" when
it lies within the stated margin, and otherwise its verdict says "unresolved".
"""
import math
import statistics
import zlib

import numpy as np

RESAMPLES = 10_000
LEVEL = 0.95


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with an integer df >= 1, in closed form (Abramowitz and Stegun 26.7.3-4)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + ... + (2.4...(df-3))/(1.3...(df-2)) cos^(df-3)))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(2, df - 1, 2):
            term *= k / (k + 1) * c * c
            total += term
        inside = 2 / math.pi * (theta + (s * c * total if df > 1 else 0.0))
    else:  # even: sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ... + (1.3...(df-3))/(2.4...(df-2)) cos^(df-2))
        term, total = 1.0, 1.0
        for k in range(1, df - 2, 2):
            term *= k / (k + 1) * c * c
            total += term
        inside = s * total
    return 0.5 + math.copysign(inside / 2, t)


def t_quantile(p: float, df: int) -> float:
    """The p quantile of Student's t with df degrees of freedom (bisection on t_cdf, to 1e-12)."""
    lo, hi = -1e4, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def stretch(seeds: int) -> float:
    """How much wider than the plain percentile interval the interval for `seeds` seeds (>= 2) is."""
    q = 1 - (1 - LEVEL) / 2
    return math.sqrt(seeds / (seeds - 1)) * t_quantile(q, seeds - 1) / statistics.NormalDist().inv_cdf(q)


def _rng(key: str):
    return np.random.default_rng(zlib.crc32(key.encode()))


_PAIRS: dict = {}


def pair_weights(pairs: int, *, first: int | None = None) -> np.ndarray:
    """[RESAMPLES, pairs]: each resample's weight of every pair (how often it was drawn, over the number of draws),
    the same wherever it is asked for; `first`: the weights of the first `first` pairs, renormalised (a measure taken
    on those pairs only, as the KL to the base on the first 64)."""
    if pairs not in _PAIRS:
        _PAIRS[pairs] = _rng(f"pairs/{pairs}").multinomial(pairs, np.full(pairs, 1 / pairs), size=RESAMPLES) / pairs
    w = _PAIRS[pairs]
    if first is None or first == pairs:
        return w
    w = w[:, :first]
    return w / np.maximum(w.sum(1, keepdims=True), 1e-300)


def on_pairs(per_pair: np.ndarray, *, first: int | None = None, pairs: int | None = None) -> np.ndarray:
    """A per-pair quantity [..., P] -> its mean over each resample's pairs [..., RESAMPLES]. With `first` < pairs the
    P = first values are the first pairs of `pairs` (their weights renormalised)."""
    x = np.asarray(per_pair, dtype=np.float64)
    return x @ pair_weights(pairs or x.shape[-1], first=first if pairs else None).T


def seed_draws(key: str, seeds: int) -> np.ndarray:
    """[RESAMPLES, seeds]: which of a configuration's seeds each resample draws, from `key` (the configuration)
    alone, so that a row's resamples do not depend on which other rows exist."""
    return _rng(f"seeds/{key}/{seeds}").integers(seeds, size=(RESAMPLES, seeds))


def over_seeds(per_run: np.ndarray, key: str) -> np.ndarray:
    """Each run's resampled values [seeds, RESAMPLES, ...] -> the mean over each resample's seeds [RESAMPLES, ...]."""
    x = np.asarray(per_run, dtype=np.float64)
    draws = seed_draws(key, x.shape[0])  # [R, n]
    return x[draws, np.arange(RESAMPLES)[:, None]].mean(1)


def _quantile(values: np.ndarray, q: float) -> float:
    """An order statistic (no interpolation: infinite values in a tail stay infinite, never NaN)."""
    return float(np.quantile(values, q, method="inverted_cdf"))


def _stretched(m: float, q: float, c: float) -> float:
    return q if math.isinf(q) or math.isinf(m) else m + c * (q - m)


def interval(draws, *, seeds: int, upper=None, log: bool = False) -> tuple[float, float]:
    """The interval of a statistic from its resamples (see the module's docstring). For a statistic whose value in
    some resamples is only bounded (a curve that never reaches a target), `draws` holds each resample's least
    possible value and `upper` its greatest: the lower end comes from `draws`, the upper from `upper`. log: a
    positive statistic (a ratio, a time) stretched on the log scale (0 is -inf there)."""
    c, q = stretch(seeds), round((1 - LEVEL) / 2, 12)
    ends = []
    for values, p in ((draws, q), (draws if upper is None else upper, 1 - q)):
        v = np.asarray(values, dtype=np.float64)
        if log:
            with np.errstate(divide="ignore"):
                v = np.log(v)
        end = _stretched(_quantile(v, 0.5), _quantile(v, p), c)
        ends.append(math.exp(end) if log else end)
    return ends[0], ends[1]


def verdict(lo: float, hi: float, *, kind: str = "better", margin: float = 0.0) -> str:
    """better: supported when the interval of a - b lies above 0, not supported when below; comparable: supported
    when it lies within +- margin, not supported when it lies beyond it; unresolved otherwise."""
    if not (math.isfinite(lo) or math.isfinite(hi)) or math.isnan(lo) or math.isnan(hi):
        return "unresolved"
    if kind == "better":
        return "supported" if lo > 0 else "not supported" if hi < 0 else "unresolved"
    return "supported" if -margin <= lo and hi <= margin else "not supported" if lo > margin or hi < -margin \
        else "unresolved"


def fmt(point: float, lo: float, hi: float, *, digits: int = 4, sign: str = "+") -> str:
    """'+0.0273 [+0.0221, +0.0325]': a statistic and its interval."""
    def f(v):
        if math.isinf(v):
            return "-inf" if v < 0 else "inf"
        v = round(v, digits) + 0.0  # no "-0.0000"
        return f"{v:{sign}.{digits}f}" if sign != "," else f"{v:,.{digits}f}"
    return f"{f(point)} [{f(lo)}, {f(hi)}]"
