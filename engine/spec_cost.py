"""When drafts pay: a cost model of the engine's own steps, measured as it runs.

A step of the target model takes about ``a + b * tokens`` seconds, and a draft model's pass
about ``c + d * tokens`` (one pass per draft position, a token per request drafting that far, more
in a first pass that catches the draft's KV up). Both
lines are fitted online, by exponentially weighted least squares, from the step times the
engine observes; n-gram drafts cost no pass (c = d = 0).

A draft position i of a request whose drafts are accepted with probability p (each given the
ones before it) yields p**i tokens on average. Without drafts a step of B decodes yields B tokens
in ``a + b * B``, a token each ``(a + b * B) / B``; the position is worth its cost when
``p**i * (a + b * B) / B >= b + d + c / n`` (its token of compute, its row of the draft pass and
its share of the pass, which the n requests drafting lately share). A large batch (where a token
of compute is worth much of a token) or a low acceptance therefore drafts little or nothing, and
one user with a repetitive output drafts all k.
"""

from __future__ import annotations

HALF_LIFE_STEPS = 256
"""Observations weigh half as much this many observations later: the fit follows load changes."""
PRIOR_STEP_TOKENS = 8
"""Before two step sizes have been seen, a step's fixed part is taken as this many tokens' compute."""


class LinearFit:
    """``y ~ intercept + slope * x`` over exponentially weighted observations."""

    __slots__ = ("decay", "w", "sx", "sy", "sxx", "sxy")

    def __init__(self, half_life: int = HALF_LIFE_STEPS) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope), None before any observation. While x has barely varied, the slope
        is the prior's (a fixed part worth PRIOR_STEP_TOKENS tokens); slopes are never negative."""
        if self.w == 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < 0.25:  # one step size so far: the prior splits the mean time
            slope = my / (PRIOR_STEP_TOKENS + mx)
        else:
            slope = max((self.sxy / self.w - mx * my) / var, 0.0)
        return max(my - slope * mx, 0.0), slope


class StepCosts:
    """The target's and the draft model's step-time lines, and what they make of a draft position."""

    def __init__(self) -> None:
        self.target = LinearFit()
        self.draft = LinearFit()
        self.rows = 0.0
        """Requests per draft pass, a moving average: they share its fixed cost."""

    def observe_rows(self, rows: int) -> None:
        self.rows = rows if self.rows == 0.0 else 0.9 * self.rows + 0.1 * rows

    def threshold(self, batch: int) -> float:
        """The least acceptance probability a draft position needs in a step of ``batch`` decodes
        (0 before the first step is timed: drafts are tried until the fit says otherwise)."""
        line = self.target.line()
        if line is None:
            return 0.0
        a, b = line
        c, d = self.draft.line() or (0.0, 0.0)
        per_token = (a + b * batch) / batch
        sharing = min(batch, self.rows) if self.rows else batch
        return (b + d + c / sharing) / per_token if per_token > 0 else 0.0
