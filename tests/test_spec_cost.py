"""When drafts pay (engine.spec_cost): the step-time lines fitted from observations, the acceptance
a draft position needs, and how many positions a request drafts, on synthetic step times (the
engine's own are measured as it runs, and vary with the host)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config import SpeculativeConfig
from engine.kv.block_manager import BlockManager
from engine.request import Request
from engine.spec_cost import PRIOR_STEP_TOKENS, LinearFit, StepCosts
from engine.spec_decode import Speculator
from tests.test_spec_decode import NGRAM, _prompts, _run, copy_model  # noqa: F401 (a fixture)


def test_the_fit_recovers_a_line_and_follows_a_change():
    fit = LinearFit(half_life=32)
    assert fit.line() is None
    for i in range(200):
        x = 1 + i % 9
        fit.observe(x, 0.030 + 0.002 * x)
    a, b = fit.line()
    assert a == pytest.approx(0.030, abs=1e-9) and b == pytest.approx(0.002, abs=1e-9)
    for i in range(400):  # the host got slower: the old observations fade
        x = 1 + i % 9
        fit.observe(x, 0.060 + 0.004 * x)
    a, b = fit.line()
    assert a == pytest.approx(0.060, rel=1e-3) and b == pytest.approx(0.004, rel=1e-3)


def test_one_step_size_splits_the_time_by_the_prior_and_slopes_stay_positive():
    fit = LinearFit()
    for _ in range(10):
        fit.observe(4, 0.012)
    a, b = fit.line()
    assert b == pytest.approx(0.012 / (PRIOR_STEP_TOKENS + 4)) and a + 4 * b == pytest.approx(0.012)
    noisy = LinearFit()
    for x, y in [(1, 0.05), (5, 0.03), (1, 0.05), (5, 0.03)]:  # bigger steps faster: noise
        noisy.observe(x, y)
    assert noisy.line()[1] == 0.0


def _costs(a, b, c=None, d=None) -> StepCosts:
    costs = StepCosts()
    for x in (1, 2, 4, 8, 16, 20):
        costs.target.observe(x, a + b * x)
        if c is not None:
            costs.draft.observe(x, c + d * x)
    return costs


def test_the_threshold_grows_with_the_batch_and_with_a_draft_models_passes():
    assert StepCosts().threshold(4) == 0.0  # nothing timed yet: drafts are tried
    ngram = _costs(0.031, 0.002)
    # B = 1: a token of compute is 0.002 of a 0.033 s token; B = 16: 0.002 of (0.031 + 0.032) / 16
    assert ngram.threshold(1) == pytest.approx(0.002 / 0.033)
    assert ngram.threshold(16) == pytest.approx(0.002 * 16 / 0.063)
    assert ngram.threshold(1) < ngram.threshold(4) < ngram.threshold(16) < 1
    model = _costs(0.031, 0.002, 0.010, 0.0014)
    assert model.threshold(1) == pytest.approx((0.002 + 0.0014 + 0.010) / 0.033)
    assert model.threshold(16) == pytest.approx((0.002 + 0.0014 + 0.010 / 16) * 16 / 0.063)
    model.observe_rows(4)  # only 4 requests drafted lately: each bears a quarter of a pass
    assert model.threshold(16) == pytest.approx((0.002 + 0.0014 + 0.010 / 4) * 16 / 0.063)
    assert model.threshold(16) > 1  # too dear for a full batch: no position pays
    assert model.threshold(2) == pytest.approx((0.002 + 0.0014 + 0.010 / 2) * 2 / 0.035)  # fewer than 4 run


def _request(prompt, accepted, rejections) -> Request:
    req = Request("x", prompt, SamplingParams(temperature=0), 0, 0, 1000, 0, frozenset())
    req.token_ids.append(1)
    req.num_computed_tokens = len(prompt)
    return req


@pytest.mark.parametrize("batch, accepted, rejections, want", [
    # p = (accepted + 2 * 0.5) / (accepted + rejections + 2): no other request has drafted yet
    (1, 0, 0, 4),      # one user, no history: p = 0.5 is worth all 4 at threshold 0.06
    (16, 0, 0, 0),     # a full batch: threshold 0.51, p = 0.5 is not
    (16, 90, 4, 4),    # ... but a request whose drafts are nearly always right drafts all 4 (0.95**4 > 0.51)
    (16, 48, 10, 3),   # p = 0.817: 0.817**3 = 0.545 >= 0.508, 0.817**4 = 0.445 is not
    (4, 2, 30, 0),     # rarely right: not at 4 running (threshold 0.21, p 0.09)
    (1, 2, 30, 1),     # ... but alone it drafts one token (0.09 >= 0.06)
])
def test_a_request_drafts_the_positions_worth_their_cost(batch, accepted, rejections, want):
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4), BlockManager(64, 8, True))
    spec.costs = _costs(0.031, 0.002)
    req = _request([3, 4, 5, 3, 4], accepted, rejections)
    assert spec._room(req, 64) == 4
    req.spec.accepted, req.spec.rejections = accepted, rejections
    assert spec._worth(req, 4, batch) == want


def test_record_counts_acceptance_for_the_cost_model():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4), BlockManager(64, 8, True))
    req = _request([3, 4, 5], 0, 0)
    spec._room(req, 64)
    spec.record(req, 4, 4)  # all accepted: no rejection
    spec.record(req, 4, 1)
    assert (req.spec.accepted, req.spec.rejections, spec.num_rejections) == (5, 1, 1)


def test_with_the_cost_model_on_the_output_is_still_exact(copy_model):
    """Whatever the measured step times decide, drafts never change the tokens."""
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(30, (9, 20, 31, 12))
    want, _ = _run(path, prompts, params)
    got, engine = _run(path, prompts, params, speculative_config={**NGRAM, "cost_model": True})
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.scheduler.speculator.costs.target.line() is not None  # the engine fed it
