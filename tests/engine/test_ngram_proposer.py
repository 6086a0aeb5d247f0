from __future__ import annotations

import pytest

from leanlm.engine.ngram_proposer import NgramProposer


def test_continues_the_latest_match_of_the_longest_tail():
    p = NgramProposer(min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9 10
    ids = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 1, 2, 3]
    assert p.propose(ids, 2) == [7, 6]  # tail [1, 2, 3] last seen at 5 (followed by 7, 6)
    assert p.propose(ids, 5) == [7, 6, 1, 2, 3]  # the match at 5 still has 5 tokens after it
    assert p.propose(ids, 6) == [9, 8, 1, 2, 3, 7]  # only the match at 0 has 6


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([5, 6, 7, 4, 6], 2) == [7, 4]  # no 2- or 3-gram match; the 1-gram 6 matches at 1
    assert p.propose([5, 6, 7, 8], 3) == []
    assert NgramProposer(min_n=2, max_n=3).propose([5, 6, 7, 4, 6], 2) == []
    assert p.propose([5], 2) == [] and p.propose([5, 5], 0) == []


def test_a_short_continuation_is_still_proposed():
    assert NgramProposer(1, 2).propose([4, 4, 4], 4) == [4]  # the 2-gram's only earlier match is at 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
