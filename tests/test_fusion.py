"""Fusion of the rules, retrieval and LLM votes into one label, action and confidence."""

from __future__ import annotations

import pytest

from logdx.diagnose.fusion import FusionWeights, format_neighbour_evidence, fuse, parse_evidence_label
from logdx.model import Action, Category, Evidence, Label, StageVote
from logdx.taxonomy import default_action, make_label

ECC = make_label("infrastructure", "ecc_error")
XID79 = make_label("infrastructure", "gpu_fell_off_bus")
NCCL_T = make_label("infrastructure", "nccl_timeout")
NET = make_label("infrastructure", "network_error")
OOM = make_label("framework", "cuda_oom")
CFG = make_label("framework", "config_error")
FWK = make_label("framework", "framework_error")
KEY = make_label("script", "key_error")
SCRIPT = make_label("script", "script_error")


def rules(*scores, evidence=()):
    return StageVote("rules", list(scores), list(evidence))


def retrieval(*scores):
    ev = [
        Evidence(None, format_neighbour_evidence(lab, 0.9, f"root of {lab.failure_type}"), f"retrieval:inc-{i}")
        for i, (lab, _) in enumerate(scores)
    ]
    return StageVote("retrieval", list(scores), ev)


def llm(*scores, explanation="model says so"):
    return StageVote("llm", list(scores), [Evidence(None, "the root", "llm:embedded")], explanation)


def test_precise_rule_outweighs_a_neighbour_vote():
    res = fuse([rules((ECC, 0.97)), retrieval((OOM, 0.9))], rule_hit_precise=True)
    assert res.label == ECC and res.decided_by == "rules"
    assert res.confidence < 0.97  # a confident contradiction lowers confidence
    assert any("retrieval disagrees" in n for n in res.notes)


def test_precise_rule_alone_keeps_its_confidence():
    res = fuse([rules((ECC, 0.95))], rule_hit_precise=True)
    assert res.label == ECC and res.confidence == pytest.approx(0.95)


def test_agreement_raises_confidence():
    alone = fuse([rules((ECC, 0.9))], rule_hit_precise=True).confidence
    both = fuse([rules((ECC, 0.9)), retrieval((ECC, 0.7))], rule_hit_precise=True).confidence
    all3 = fuse([rules((ECC, 0.9)), retrieval((ECC, 0.7)), llm((ECC, 0.8))], rule_hit_precise=True).confidence
    assert alone < both < all3 <= 0.99


def test_neighbour_vote_beats_a_fallback_rule_and_action_is_derived():
    res = fuse([rules((SCRIPT, 0.6)), retrieval((XID79, 0.7))], rule_hit_precise=False)
    assert res.label is not None and res.label.failure_type == "gpu_fell_off_bus"
    assert res.decided_by == "retrieval"
    assert res.label.action is Action.CORDON_AND_RESTART  # infrastructure hardware


def test_neighbour_action_is_not_trusted():
    # The neighbour incident was cordoned (its culprit was known); a network error restarts.
    stored = Label(Category.INFRASTRUCTURE, "network_error", Action.CORDON_AND_RESTART)
    res = fuse([retrieval((stored, 0.8))], rule_hit_precise=False)
    assert res.label.action is Action.RESTART
    res = fuse([retrieval((Label(Category.SCRIPT, "key_error", Action.RESTART), 0.8))], rule_hit_precise=False)
    assert res.label.action is Action.NO_RESTART


def test_rule_action_is_trusted():
    rule_says = Label(Category.INFRASTRUCTURE, "ecc_error", Action.RESTART)  # pack chose restart
    res = fuse([rules((rule_says, 0.9)), retrieval((ECC, 0.5))], rule_hit_precise=True)
    assert res.label.action is Action.RESTART


def test_llm_arbitrates_when_rules_are_silent_and_retrieval_is_split():
    votes = [retrieval((CFG, 0.40), (OOM, 0.35)), llm((OOM, 0.9), (CFG, 0.1))]
    res = fuse(votes, rule_hit_precise=False)
    assert res.label.failure_type == "cuda_oom"
    assert res.weights_used["llm"] == FusionWeights().llm_arbiter
    assert any("llm arbitrates" in n for n in res.notes)
    assert res.explanation == "model says so"


def test_llm_cannot_overturn_a_precise_rule_or_a_clear_neighbour_vote():
    res = fuse([rules((ECC, 0.95)), llm((OOM, 0.9), (ECC, 0.1))], rule_hit_precise=True)
    assert res.label == ECC
    assert res.explanation is None  # the LLM explained cuda_oom, not the winner
    res = fuse([retrieval((KEY, 0.8)), llm((SCRIPT, 1.0))], rule_hit_precise=False)
    assert res.label.failure_type == "key_error"
    assert res.weights_used["llm"] == FusionWeights().llm_advisor


def test_same_category_counts_as_partial_support():
    with_cat = fuse([rules((NET, 0.9)), retrieval((NCCL_T, 0.6))], rule_hit_precise=True)
    other_cat = fuse([rules((NET, 0.9)), retrieval((OOM, 0.6))], rule_hit_precise=True)
    assert with_cat.label == NET and other_cat.label == NET
    assert with_cat.confidence > 0.9 > other_cat.confidence
    assert any("agrees on category" in n for n in with_cat.notes)


def test_no_votes_or_weak_votes_give_no_label():
    unavailable = StageVote("llm", [], note="llm unavailable: timeout; fell back to rules + retrieval")
    res = fuse([StageVote("rules", []), StageVote("retrieval", []), unavailable], rule_hit_precise=False)
    assert res.label is None and res.confidence == 0.0
    assert "llm unavailable: timeout; fell back to rules + retrieval" in res.notes
    res = fuse([retrieval((KEY, 0.1))], rule_hit_precise=False)
    assert res.label is None and "support" in res.notes[-1]


def test_evidence_keeps_supporting_sources_and_matching_neighbours_only():
    rule_ev = Evidence(1233, "NVRM: Xid 48 ...", "rule:xid-48-dbe")
    votes = [rules((ECC, 0.95), evidence=[rule_ev]), retrieval((ECC, 0.5), (OOM, 0.2))]
    res = fuse(votes, rule_hit_precise=True)
    assert res.evidence[0] == rule_ev  # the deciding source first
    srcs = [e.source for e in res.evidence]
    assert "retrieval:inc-0" in srcs and "retrieval:inc-1" not in srcs  # inc-1 voted cuda_oom


def test_weights_are_configurable():
    votes = [rules((ECC, 0.9)), retrieval((OOM, 0.9))]
    assert fuse(votes, rule_hit_precise=True).label == ECC
    heavy = FusionWeights(retrieval=2.0)
    assert fuse(votes, rule_hit_precise=True, weights=heavy).label.failure_type == "cuda_oom"


def test_ties_prefer_rules_then_retrieval():
    res = fuse([rules((ECC, 0.5)), retrieval((OOM, 0.5))], rule_hit_precise=True,
               weights=FusionWeights(rules_precise=1.0, retrieval=1.0))
    assert res.label == ECC


def test_ranking_lists_alternatives():
    res = fuse([rules((ECC, 0.9)), retrieval((OOM, 0.4), (FWK, 0.2))], rule_hit_precise=True)
    assert [lab.failure_type for lab, _ in res.ranking] == ["ecc_error", "cuda_oom", "framework_error"]


@pytest.mark.parametrize(
    ("category", "failure_type", "action"),
    [
        ("infrastructure", "gpu_fell_off_bus", Action.CORDON_AND_RESTART),
        ("infrastructure", "node_failure", Action.CORDON_AND_RESTART),
        ("infrastructure", "nccl_timeout", Action.RESTART),
        ("infrastructure", "disk_full", Action.RESTART),
        ("framework", "cuda_oom", Action.NO_RESTART),
        ("script", "key_error", Action.NO_RESTART),
    ],
)
def test_default_action(category, failure_type, action):
    assert default_action(category, failure_type) is action


def test_make_label_validates_and_evidence_tags_round_trip():
    with pytest.raises(ValueError):
        make_label("framework", "ecc_error")
    ev = Evidence(None, format_neighbour_evidence(KEY, 0.8765, "KeyError: 'x'"), "retrieval:inc-1")
    assert parse_evidence_label(ev) == ("script", "key_error")
    assert ev.text.endswith("KeyError: 'x'") and "sim=0.88" in ev.text
    assert parse_evidence_label(Evidence(3, "[not a tag] x", "rule:y")) is None
