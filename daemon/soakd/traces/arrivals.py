"""Arrival times for traffic that has none recorded: a renewal process under a diurnal rate profile.

The process runs in "operational time", where the rate is 1: gaps are exponential (Poisson), gamma with
shape `burstiness` and mean 1 (burstiness < 1: clumped, > 1: smoother; the same convention as
`vllm bench serve --burstiness`), or constant. Operational time tau maps to wall time t through the
integrated rate Lambda(t) = integral of rate(u) du with

    rate(t) = rate_rps * (1 + A * cos(2 pi (t - peak) / period))

so a diurnal profile (A > 0) stretches and squeezes the same renewal process without changing its
burstiness. Lambda has a closed form and a derivative >= rate_rps * (1 - A) > 0, so its inverse is found
by a few vectorised Newton steps. Everything is seeded: the same config and seed give the same times.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from soakd.config import ArrivalConfig

_CHUNK = 4096
_NEWTON_STEPS = 50
_F64 = npt.NDArray[np.float64]


def _gaps(rng: np.random.Generator, cfg: ArrivalConfig, n: int) -> _F64:
    """`n` inter-arrival gaps of the unit-rate process."""
    if cfg.process == "constant":
        return np.ones(n)
    if cfg.process == "gamma":
        shape = cfg.burstiness
        return rng.gamma(shape, 1.0 / shape, size=n)
    return rng.exponential(1.0, size=n)


def _integrated(cfg: ArrivalConfig, t: _F64) -> _F64:
    """Lambda(t): expected arrivals in [0, t]."""
    r = cfg.rate_rps
    a = cfg.diurnal_amplitude
    if a == 0:
        return r * t
    w = 2 * math.pi / cfg.diurnal_period
    return r * t + r * a / w * (np.sin(w * (t - cfg.diurnal_peak)) + math.sin(w * cfg.diurnal_peak))


def rate_at(cfg: ArrivalConfig, t: float) -> float:
    """The configured rate at time t (requests per second)."""
    w = 2 * math.pi / cfg.diurnal_period
    return cfg.rate_rps * (1 + cfg.diurnal_amplitude * math.cos(w * (t - cfg.diurnal_peak)))


def _invert(cfg: ArrivalConfig, tau: _F64) -> _F64:
    """t with Lambda(t) = tau, elementwise."""
    r = cfg.rate_rps
    t = tau / r
    if cfg.diurnal_amplitude == 0:
        return t
    w = 2 * math.pi / cfg.diurnal_period
    for _ in range(_NEWTON_STEPS):
        rate = r * (1 + cfg.diurnal_amplitude * np.cos(w * (t - cfg.diurnal_peak)))
        step = (_integrated(cfg, t) - tau) / rate
        t = t - step
        if float(np.max(np.abs(step), initial=0.0)) < 1e-9:
            break
    return t


def arrival_stream(cfg: ArrivalConfig, seed: int) -> Iterator[float]:
    """Arrival times in seconds, the first at 0, increasing, without end (generated in chunks)."""
    rng = np.random.default_rng([seed % 2**64, 0xA11])
    tau = 0.0
    yield 0.0
    while True:
        taus = tau + np.cumsum(_gaps(rng, cfg, _CHUNK))
        tau = float(taus[-1])
        yield from _invert(cfg, taus).tolist()


def arrivals_until(cfg: ArrivalConfig, seed: int, duration_s: float) -> list[float]:
    """Arrival times in [0, duration_s)."""
    out: list[float] = []
    for t in arrival_stream(cfg, seed):
        if t >= duration_s:
            return out
        out.append(t)
    return out  # pragma: no cover - the stream never ends


def think_times(cfg: ArrivalConfig, seed: int) -> Iterator[float]:
    """Gaps between the turns of a session with no recorded times: exponential, mean `think_time`."""
    rng = np.random.default_rng([seed % 2**64, 0x7417])
    while True:
        if cfg.think_time == 0:
            yield 0.0
            continue
        yield from rng.exponential(cfg.think_time, size=_CHUNK).tolist()
