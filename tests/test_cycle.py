"""The SPD cycle in isolation (spd_ds/decoding/cycle.py): a token's way through the pipeline by hand, the rollback plan
against the stage caches of real cycles, stop conditions, and the anchor rows."""

from __future__ import annotations

import pytest
import torch

from spd_ds.decoding.ar import ARDecoder
from spd_ds.decoding.cycle import Anchors, RollbackPlan, SPDGeneration, TokenOutput
from spd_ds.decoding.drafters import Draft, HeadDrafter, OracleDrafter
from spd_ds.decoding.reference import SPDReferenceDecoder
from spd_ds.decoding.sampling import SamplingParams
from spd_ds.head import SpeculationHead
from spd_ds.models.adapter import Target, TargetArch
from spd_ds.partition import StagePartition
from tests.tiny_models import make_tiny_model

H, V = 4, 16


class ScriptedDrafter:
    """Proposes the tokens of ``script`` in turn and records every view it was given."""

    def __init__(self, script):
        self.script, self.views, self.started = list(script), [], None

    def start(self, feats):
        self.started = feats.shape

    def propose(self, completed, inflight, types, start_pos, sampling):
        self.views.append((completed.shape[0], inflight.shape[0], list(types), start_pos))
        return Draft(self.script.pop(0))


def one_hot(token):
    x = torch.full((V,), -10.0)
    x[token] = 10.0
    return x


def make_generation(n, script, target_tokens, eos=(), max_new=20):
    """A generation over ``n`` stages whose 'target' emits ``target_tokens[pos]`` after position ``pos`` (the hidden
    state carries the position), with embeddings that carry the token id."""
    part = StagePartition.build(2 * n, n)
    drafter = ScriptedDrafter(script)
    plans = []
    gen = SPDGeneration(part, drafter, SamplingParams(), frozenset(eos), max_new,
                        embed=lambda tok: torch.full((1, 1, H), float(tok)),
                        logits=lambda h: one_hot(target_tokens[int(h[0])]), rewind=plans.append)
    return gen, drafter, plans


def run_stages(gen, at_stage):
    """Stand-in stage forwards: the output carries the token's position; no anchors are captured."""
    for s, e in at_stage.items():
        e.hidden = torch.full((1, 1, H), float(e.pos))


def test_one_token_through_the_cycle_by_hand():
    # n = 2, prompt of 3 tokens: the prefill token 7 at position 3, then the target's token at position p + 1 is p + 5
    target = {p: p + 5 for p in range(3, 40)}
    gen, drafter, plans = make_generation(2, script=[8, 5, 10, 11, 12], target_tokens=target, max_new=4)
    m = gen.anchors.m
    gen.start(3, one_hot(7), torch.zeros(3, m, H), since=0.0)
    assert gen.out.tokens == [7] and [(e.pos, e.token, e.depth) for e in gen.pipeline] == [(3, 7, 0)]
    assert drafter.started == (3, m, H) and gen.head_start == 3
    # cycle 1: one token in flight, nothing to verify yet
    view, at_stage = gen.begin_cycle()
    assert list(at_stage) == [0] and view.inflight.shape == (1, m, H) and view.start_pos == 3
    assert torch.equal(view.inflight[0, 0], torch.full((H,), 7.0))  # type 0 = the embedding
    run_stages(gen, at_stage)
    gen.enter_draft(gen.propose(view))
    assert [(e.pos, e.token, e.depth, e.fill) for e in gen.pipeline] == [(3, 7, 1, 0), (4, 8, 0, 1)]
    assert not gen.verifiable
    # cycle 2: the prefill token leaves the last stage and verifies the draft 8 (accepted)
    view, at_stage = gen.begin_cycle()
    assert list(at_stage) == [1, 0] and view.types == [gen.f[1], gen.f[0]]
    run_stages(gen, at_stage)
    gen.enter_draft(gen.propose(view))
    assert gen.verifiable and gen.verify() and not gen.rejected
    assert gen.out.tokens == [7, 8] and len(gen.completed) == 1  # a pending row, committed by the next view
    # cycle 3: draft 5 (at position 5) is rejected by the target's 9: roll back to position 5
    view, at_stage = gen.begin_cycle()
    assert view.completed.shape[0] == 1 and view.start_pos == 3 and gen.head_start == 4 and gen.completed == []
    run_stages(gen, at_stage)
    gen.enter_draft(gen.propose(view))
    assert not gen.verify() and gen.rejected
    assert gen.plan == RollbackPlan(keep=5, token=9, drop=(1, 0))  # stage 0 ran the rejected draft, stage 1 not yet
    assert plans == []  # nothing rewound before rollback()
    e = gen.rollback()
    assert plans == [RollbackPlan(5, 9, (1, 0))] and not gen.rejected
    assert [(x.pos, x.token, x.verified) for x in gen.pipeline] == [(5, 9, True)] and e is gen.newest
    assert gen.out.tokens == [7, 8, 9]
    m = gen.metrics
    assert (m.num_cycles, m.num_drafts, m.num_accepted_tokens, m.num_rollbacks) == (3, 2, 1, 1)
    assert m.drafts_by_fill == [0, 1, 1] and m.accepted_by_fill == [0, 1, 0]
    # the length limit: two more cycles give the 4th token
    while not gen.finished:
        view, at_stage = gen.begin_cycle()
        run_stages(gen, at_stage)
        gen.enter_draft(gen.propose(view))
        if gen.verifiable:
            gen.verify()
            if gen.rejected:
                gen.rollback()
    res = gen.result(1.0, split_stages=range(2))
    assert res.tokens == [7, 8, 9, 10] and res.finish_reason == "length" and res.metrics.num_new_tokens == 4


def test_first_token_may_end_the_generation():
    gen, _, _ = make_generation(2, [], {}, eos=[7])
    gen.start(3, one_hot(7), torch.zeros(3, 3, H), since=0.0)
    assert gen.finished and gen.out.finish_reason == "eos" and gen.pipeline == []
    gen, _, _ = make_generation(2, [], {}, max_new=1)
    gen.start(3, one_hot(7), torch.zeros(3, 3, H), since=0.0)
    assert gen.finished and gen.out.finish_reason == "length"
    with pytest.raises(RuntimeError, match="rollback without"):
        gen.rollback()


def test_token_output_stop_conditions():
    out = TokenOutput(frozenset([2]), 3)
    assert not out.emit(5) and not out.emit(6) and out.emit(7) and out.finish_reason == "length"
    out = TokenOutput(frozenset([2]), 3)
    assert not out.emit(5) and out.emit(2) and out.finish_reason == "eos" and out.tokens == [5, 2]


def test_prompt_check_names_a_sliding_window_that_sets_the_context():
    """A Mistral window shorter than max_position_embeddings caps the context: the message says it is the window (and
    that full attention is exact only within it), not the model's maximum context; it never says to raise
    decoding.max_length, which is already capped there."""
    from spd_ds.decoding.cycle import PromptError, check_prompt

    with pytest.raises(PromptError) as e:
        check_prompt(list(range(10)), 6, 16, 2, model_max=16, model_max_source="sliding_window")
    assert str(e.value) == ("prompt of 10 tokens + max_new_tokens=6 (+2 in flight) exceeds the model's sliding-window "
                            "context of 16 positions (config.json sliding_window; full attention is exact only within "
                            "it); shorten the prompt or lower decoding.max_new_tokens")
    with pytest.raises(PromptError, match="exceeds the model's maximum context of 16 positions; shorten"):
        check_prompt(list(range(10)), 6, 16, 2, model_max=16)
    with pytest.raises(PromptError, match="raise decoding.max_length"):  # decoding.max_length sets it, not the window
        check_prompt(list(range(10)), 6, 16, 2, model_max=4096, model_max_source="sliding_window")


def test_prompt_check_does_not_advise_a_max_length_past_the_model():
    """decoding.max_length below the model's maximum, but the prompt and generation need more than the model has:
    raising decoding.max_length cannot help, so the message names the model's maximum (it used to say to raise
    decoding.max_length, and the next run failed again); within the model it says how far max_length may go."""
    from spd_ds.decoding.cycle import PromptError, check_prompt

    with pytest.raises(PromptError, match="exceeds the model's maximum context of 64 positions; shorten") as e:
        check_prompt(list(range(70)), 6, 32, 2, model_max=64)
    assert "max_length" not in str(e.value)
    with pytest.raises(PromptError, match=r"raise decoding.max_length \(to at most 64\)$"):
        check_prompt(list(range(30)), 6, 32, 2, model_max=64)


def test_anchors_rows_and_store():
    part = StagePartition.build(6, 3, anchors=[0, 3, 6])
    a = Anchors(part)
    emb = torch.arange(2 * H, dtype=torch.float32).view(2, H)
    rows = a.rows(emb)
    assert rows.shape == (2, 3, H) and torch.equal(rows[:, 0], emb) and rows[:, 1:].eq(0).all()
    a.store(rows, {3: torch.ones(1, 2, H), 5: torch.full((1, 2, H), 9.0)})  # layer 5 is no anchor: skipped
    assert rows[:, 1].eq(1).all() and rows[:, 2].eq(0).all()
    one = rows[0]
    a.store(one, {6: torch.full((1, 1, H), 2.0)})  # a single token's rows [m, H]
    assert one[2].eq(2).all() and rows[0, 2].eq(2).all()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rollback_plan_matches_the_stage_caches(tiny_root, n):
    """In real cycles of the reference decoder, stage s's cache holds exactly ``keep + drop[s]`` positions when a
    rollback is planned: the plan is what a per-stage state restore needs."""
    arch = TargetArch(make_tiny_model(tiny_root, "qwen3", 6))
    part = StagePartition.build(6, n)
    target = Target(arch, part, torch.float32, "cpu")
    torch.manual_seed(n)
    head = SpeculationHead(arch, part, num_layers=1)
    prompt = [3, 14, 15, 92, 65]
    ar = ARDecoder(target).generate(prompt, 30).tokens
    plans = []

    class Checked(SPDReferenceDecoder):
        def _rewind(self, plan):
            assert len(plan.drop) == n and plan.drop[n - 1] <= plan.drop[0] <= n - 1
            assert [c.length - d for c, d in zip(self.caches, plan.drop)] == [plan.keep] * n
            plans.append(plan)
            super()._rewind(plan)

    drafter = OracleDrafter(prompt + ar, 0.5, base=HeadDrafter(head, 128, torch.float32, "cpu"), seed=n)
    res = Checked(target, drafter, max_len=128).generate(prompt, 30)
    assert res.tokens == ar and len(plans) == res.metrics.num_rollbacks > 0
