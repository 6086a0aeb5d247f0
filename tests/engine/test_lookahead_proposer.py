from __future__ import annotations

import pytest

from leanlm.engine.lookahead_proposer import LookaheadProposer


def test_jacobi_guess_follows_the_rejected_window():
    p = LookaheadProposer(ngram_size=3)
    assert p.propose("r", [1, 2, 3], 3) == [3, 3, 3]  # nothing known yet: the last token repeated
    # window [3, 3, 3, 3] verified: predictions 4 (after 3), then 9, 5, 6; no draft matched
    p.observe("r", [3, 3, 3, 3], [4, 9, 5, 6], num_accepted=0)
    # new token 4; the guess for what follows is the predictions past the rejection: 9, 5, 6
    assert p.propose("r", [1, 2, 3, 4], 3) == [9, 5, 6]


def test_pool_ngrams_come_first_newest_wins():
    p = LookaheadProposer(ngram_size=3)
    p.observe("r", [7, 8, 9], [8, 1, 2], num_accepted=1)  # n-grams (7: 8, 1) and (8: 1, 2)
    assert p.propose("r", [5, 7], 2) == [8, 1]
    assert p.propose("r", [5, 6, 8, 7, 5, 6], 2) == [8, 7]  # (6: 8, 7), from the text itself
    assert p.propose("r", [5, 6, 8, 7, 5, 6, 9, 8], 2) == [
        7,
        5,
    ]  # the text's (8: 7, 5) is newer than the Jacobi (8: 1, 2)


def test_short_candidates_are_padded_and_requests_forgotten():
    p = LookaheadProposer(ngram_size=2)
    p.observe("r", [1, 2], [2, 3], num_accepted=1)
    assert p.propose("r", [0, 1], 4) == [2, 2, 2, 2]
    p.forget(["r"])
    assert p.propose("r", [0, 1], 2) == [1, 1]
    with pytest.raises(ValueError):
        LookaheadProposer(ngram_size=1)
