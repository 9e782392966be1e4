"""Speculative decoding standalone (`examples/speculative.py`): a drafter and its target compiled in one
process, greedy acceptance, token-equal to plain greedy decoding of the target; the drafter's steps are
replays of its captured graphs, one replay and its task updates each, nothing outside a graph; the two
models share one workspace slot (`workspace_group`)."""
from __future__ import annotations

import pytest

from examples import speculative


@pytest.mark.parametrize("draft_layers", [4, 2])
def test_speculative_decoding_is_token_equal_to_greedy_and_the_drafter_replays_its_graphs(draft_layers):
    r = speculative.main(["--requests", "2", "--k", "3", "--tokens", "24", "--draft-layers", str(draft_layers)])
    assert r["token_equal"], r
    if draft_layers == 4:  # the target's own layers: every proposal accepted, the drafter catching up two tokens
        assert r["accepted"] == r["proposed"] > 0, r
    else:  # proposals rejected: rows past each request's length written again before they are read
        assert r["accepted"] < r["proposed"], r
    assert r["draft_steps"] > 0 and r["draft_replays"] == r["draft_steps"] and r["draft_captures"] == 0, r
    assert r["draft_outside_graph"] == 0 and r["launches_per_draft_step"] == 1 + draft_layers, r
    assert r["target_replays"] > 0, r
    # one workspace slot for both models, sized for the larger need: a second slot saved
    ws = r["workspace"]
    needs = ws["needs_bytes"]
    assert set(needs) == {"target", "drafter"} and min(needs.values()) > 0, ws
    assert ws["slot_bytes"] == max(needs.values()) and ws["separate_slots_bytes"] == sum(needs.values()), ws
    assert ws["saved_bytes"] == min(needs.values()) > 0, ws
