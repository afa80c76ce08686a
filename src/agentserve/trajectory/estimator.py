"""When does a paused trajectory come back? A survival model per pause class, learned online.

Gaps are heavy-tailed (after a tool result p50 9 s, p99 916 s on the Claude Code traces) and
many trajectories never return, so the model is a life-table (actuarial Kaplan-Meier) estimate
on a log-spaced grid with right-censoring (a trajectory that expired or finished unreturned is known only to have
waited at least that long) and a prior of pseudo-observations for classes with few samples.
What it answers is the probability of a return within a horizon given the time already
waited; the mass that never returns is whatever survival is left at the end of the grid. The
mean remaining time is never used: these tails make it meaningless.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

OTHER = "other"


def log_grid(lo_s: float = 0.25, hi_s: float = 86_400.0, per_decade: int = 8) -> tuple[float, ...]:
    """Bin edges from lo to hi, evenly spaced in log time."""
    n = math.ceil(math.log10(hi_s / lo_s) * per_decade)
    return tuple(lo_s * (hi_s / lo_s) ** (i / n) for i in range(n + 1))


@dataclass(frozen=True, slots=True)
class Prior:
    """Pseudo-observations for a class with no data: a log-normal gap with median `median_s`
    and log-sd `sigma`, of which `never` never returns; `weight` observations' worth."""

    median_s: float = 30.0
    sigma: float = 2.0
    never: float = 0.2
    weight: float = 4.0


@dataclass(slots=True)
class _Class:
    events: list[float]  # per bin: returns observed (weighted)
    censored: list[float]  # per bin: left unreturned after waiting into this bin
    num_returns: int = 0
    num_censored: int = 0
    open: list[float] | None = None  # per bin: pauses still open, at their wait so far
    _survival: list[float] | None = None  # S at each bin's upper edge, cached
    _survival_np: np.ndarray | None = None  # the same as an array, set with it


@dataclass(slots=True)
class ReturnEstimator:
    """Per class survival S(t) = P(gap > t). Classes beyond `max_classes` share `other` (a
    flood of distinct tool names stays bounded, in memory and in metrics labels)."""

    prior: Prior = field(default_factory=Prior)
    max_classes: int = 16
    grid: tuple[float, ...] = field(default_factory=log_grid)
    _classes: dict[str, _Class] = field(default_factory=dict)
    _grid_array: np.ndarray = field(init=False)  # the grid (fixed at construction) as arrays
    _log_grid_array: np.ndarray = field(init=False)
    _log_width: list[float] = field(init=False)  # log(grid[k + 1] / grid[k]), as survival() divides by it

    def __post_init__(self) -> None:
        self._grid_array = np.asarray(self.grid, dtype=np.float64)
        self._log_grid_array = np.log(self._grid_array)
        self._log_width = [math.log(hi / lo) for lo, hi in zip(self.grid, self.grid[1:])]

    def class_of(self, name: str) -> str:
        if name in self._classes or len(self._classes) < self.max_classes - 1 or name == OTHER:
            return name
        return OTHER

    def _get(self, name: str) -> _Class:
        name = self.class_of(name)
        c = self._classes.get(name)
        if c is None:
            c = self._classes[name] = self._with_prior()
        return c

    def _with_prior(self) -> _Class:
        n = len(self.grid) + 1  # bin k holds gaps in [grid[k-1], grid[k]); 0 and n-1 are open
        events, censored = [0.0] * n, [0.0] * n
        p = self.prior
        returning = p.weight * (1.0 - p.never)
        prev = 0.0
        for k, edge in enumerate(self.grid):
            cdf = 0.5 * (1.0 + math.erf(math.log(edge / p.median_s) / (p.sigma * math.sqrt(2.0))))
            events[k] += returning * (cdf - prev)
            prev = cdf
        events[n - 1] += returning * (1.0 - prev)
        censored[n - 1] += p.weight * p.never  # never returns: censored past the grid
        return _Class(events, censored)

    def _bin(self, gap_s: float) -> int:
        return bisect.bisect_right(self.grid, max(0.0, gap_s))

    def observe_return(self, name: str, gap_s: float) -> None:
        c = self._get(name)
        c.events[self._bin(gap_s)] += 1.0
        c.num_returns += 1
        c._survival = None

    def observe_censored(self, name: str, waited_s: float) -> None:
        """Left without returning after waiting waited_s (expired, finished, evicted from the
        registry): counts in the risk set up to there."""
        c = self._get(name)
        c.censored[self._bin(waited_s)] += 1.0
        c.num_censored += 1
        c._survival = None

    def set_open(self, waits: dict[str, list[float]]) -> None:
        """The pauses still open now, per class, at how long each has waited: they count as
        censored there until they close (a pause that has waited an hour says as much as one
        that expired after an hour). Replaces the previous call's; classes absent have none."""
        for name, c in self._classes.items():
            if c.open is not None and name not in waits:
                c.open, c._survival = None, None
        grid = self._grid_array
        for name, ws in waits.items():
            c = self._get(name)
            # _bin of each wait, counted (bisect_right over the grid, as searchsorted "right")
            k = np.searchsorted(grid, np.maximum(np.asarray(ws, dtype=np.float64), 0.0), side="right")
            counts = np.bincount(k, minlength=len(c.events)).astype(np.float64).tolist()
            if counts != c.open:  # (unchanged between most ticks: the bins are wide past a minute)
                c.open, c._survival = counts, None

    def _survival(self, c: _Class) -> list[float]:
        if c._survival is None:
            censored = c.censored if c.open is None else [a + b for a, b in zip(c.censored, c.open)]
            at_risk = sum(c.events) + sum(censored)
            s, out = 1.0, []
            for d, q in zip(c.events, censored):
                exposed = at_risk - q / 2  # life-table: the censored in a bin were at risk half of it
                if exposed > 0:
                    s *= max(0.0, 1.0 - d / exposed)
                out.append(s)
                at_risk -= d + q
            c._survival, c._survival_np = out, np.asarray(out, dtype=np.float64)
        return c._survival

    def survival(self, name: str, t_s: float) -> float:
        """P(gap > t), interpolated in log time inside a bin (S at bin edges is exact KM)."""
        return self._s_at(self._survival(self._get(name)), t_s)

    def _s_at(self, s: list[float], t_s: float) -> float:
        """survival() on a class's S at the bin edges (the eviction order's sort calls it per
        trajectory, so it does no more than it must)."""
        grid = self.grid
        k = bisect.bisect_right(grid, t_s) if t_s > 0.0 else 0  # _bin
        if k >= len(grid):  # past the grid: what is left never returns
            return s[-1]
        if k == 0:  # linear in time from S(0) = 1 to the first edge
            return 1.0 + (s[0] - 1.0) * min(1.0, max(0.0, t_s / grid[0]))
        lo_t, lo_s = grid[k - 1], s[k - 1]  # lo_t <= t_s < grid[k]
        return lo_s + (s[k] - lo_s) * min(1.0, max(0.0, math.log(t_s / lo_t) / self._log_width[k - 1]))

    def survival_many(self, name: str, t_s: np.ndarray) -> np.ndarray:
        """survival() at each of an array of times (the eviction order's sort: one call per
        class instead of one per trajectory). Inside the grid survival() is linear in log time
        between bin edges, which is np.interp over the log grid; before the first edge it is
        linear in time from S(0) = 1; from the last edge on it is what never returns."""
        c = self._get(name)
        self._survival(c)
        s, grid, log_grid = c._survival_np, self._grid_array, self._log_grid_array
        assert s is not None
        t = np.asarray(t_s, dtype=np.float64)
        n = len(grid)  # s[:n] is S at each edge; s[n], the open bin past the grid's end
        out = np.interp(np.log(np.maximum(t, grid[0])), log_grid, s[:n])
        out[t >= grid[-1]] = s[n]
        early = t < grid[0]
        if early.any():
            out[early] = 1.0 + (s[0] - 1.0) * (np.maximum(t[early], 0.0) / grid[0])
        return out

    def p_return_within_many(self, name: str, waited_s: np.ndarray, horizon_s: float) -> np.ndarray:
        """p_return_within() for an array of waits, one horizon."""
        waited = np.asarray(waited_s, dtype=np.float64)
        both = self.survival_many(name, np.concatenate((waited, waited + horizon_s)))
        now, later = both[: len(waited)], both[len(waited) :]
        alive = now > 1e-12
        return np.where(alive, np.maximum(0.0, (now - later) / np.where(alive, now, 1.0)), 0.0)

    def samples(self, name: str) -> int:
        """Pauses of this class seen so far (returned and censored), the prior not counted."""
        c = self._classes.get(self.class_of(name))
        return 0 if c is None else c.num_returns + c.num_censored

    def never(self, name: str) -> float:
        """The mass that never returns: survival past the grid's end."""
        return self._survival(self._get(name))[-1]

    def p_return_within(self, name: str, waited_s: float, horizon_s: float) -> float:
        """P(returns in (waited, waited + horizon] | not returned by waited)."""
        c = self._classes.get(name)
        s = self._survival(self._get(name) if c is None else c)
        now = self._s_at(s, waited_s)
        if now <= 1e-12:
            return 0.0
        return max(0.0, (now - self._s_at(s, waited_s + horizon_s)) / now)

    def p_return_within_each(self, name: str, waits: Sequence[float], horizon_s: float) -> list[float]:
        """p_return_within() at each of these waits, one horizon: the same arithmetic, bit for
        bit, in one loop (the scalar eviction order's: one call per class instead of a chain of
        calls per trajectory)."""
        c = self._classes.get(name)
        s = self._survival(self._get(name) if c is None else c)
        grid, log_width, log, right = self.grid, self._log_width, math.log, bisect.bisect_right
        n, first, never = len(self.grid), self.grid[0], s[-1]

        def at(t_s: float) -> float:  # _s_at(s, t_s)
            k = right(grid, t_s) if t_s > 0.0 else 0
            if k >= n:
                return never
            if k == 0:
                return 1.0 + (s[0] - 1.0) * min(1.0, max(0.0, t_s / first))
            lo_t, lo_s = grid[k - 1], s[k - 1]
            return lo_s + (s[k] - lo_s) * min(1.0, max(0.0, log(t_s / lo_t) / log_width[k - 1]))

        out = []
        for w in waits:
            now = at(w)
            out.append(0.0 if now <= 1e-12 else max(0.0, (now - at(w + horizon_s)) / now))
        return out

    def quantile(self, name: str, q: float) -> float | None:
        """The time t with P(gap <= t) = q among all pauses; None if the never-return mass makes
        q unreachable."""
        s = self._survival(self._get(name))
        for k, edge in enumerate(self.grid):
            if 1.0 - s[k] >= q:
                lo_t, lo_s = (self.grid[k - 1], s[k - 1]) if k else (edge / 2, 1.0)
                frac = (lo_s - (1.0 - q)) / (lo_s - s[k]) if lo_s > s[k] else 1.0
                return lo_t * (edge / lo_t) ** frac  # log-linear inside the bin, as survival()
        return None

    def stats(self) -> dict[str, dict[str, float | int | None]]:
        return {name: {"returns": c.num_returns, "censored": c.num_censored, "never": self.never(name),
                       "p50_s": self.quantile(name, 0.5), "p90_s": self.quantile(name, 0.9)}
                for name, c in sorted(self._classes.items())}
