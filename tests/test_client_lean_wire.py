"""The client's rule for a turn's wire form (prorsa/client/lean_wire.py): prompts in, references and segments out."""

from __future__ import annotations

from prorsa.client.lean_wire import LeanPrompts, TurnWire


def test_a_prompt_that_extends_the_last_logged_one_sends_only_the_new_ids() -> None:
    lean = LeanPrompts()
    first = [5, 6, 7]
    assert lean.plan(first, inline_max=10) == TurnWire(0, 0, [5, 6, 7], [5, 6, 7])
    lean.logged_as(0, list(first))
    first += [8, 9]  # the caller extends its own list in place: the logged copy does not move
    assert lean.plan(first, inline_max=10) == TurnWire(0, 3, [8, 9], [8, 9])
    lean.logged_as(1, list(first))
    assert lean.plan([5, 6, 7, 8, 9, 1, 2, 3], inline_max=2) == TurnWire(1, 5, [1, 2, 3], [])  # not inline
    assert lean.logged


def test_a_rewritten_history_or_a_shorter_prompt_logs_itself_whole() -> None:
    lean = LeanPrompts()
    lean.logged_as(4, [1, 2, 3])
    assert lean.plan([1, 9, 3, 4], inline_max=10) == TurnWire(0, 0, [1, 9, 3, 4], [1, 9, 3, 4])
    assert lean.plan([1, 2], inline_max=10).prefix_len == 0
    assert lean.plan([1, 2, 3], inline_max=10) == TurnWire(4, 3, [], [])  # the same prompt again: nothing new
