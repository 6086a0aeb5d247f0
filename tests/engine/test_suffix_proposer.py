from __future__ import annotations

import pytest

from leanlm.engine.ngram_proposer import NgramProposer
from leanlm.engine.suffix_proposer import SuffixProposer


def _decode(proposer, prompt: list[int], output: list[int], k: int) -> tuple[int, int]:
    """Greedy speculation against a known output: (steps, accepted drafts). Each step verifies the draft,
    keeps its longest correct prefix and one more token (the verifier's), as the engine does."""
    text, pos, steps, accepted = list(prompt), 0, 0, 0
    while pos < len(output):
        if isinstance(proposer, SuffixProposer):
            draft = proposer.propose("r", text, k)
        else:
            draft = proposer.propose(text, k)
        a = 0
        while a < len(draft) and pos + a < len(output) and draft[a] == output[pos + a]:
            a += 1
        accepted += a
        text += output[pos : pos + a + 1]
        pos += a + 1
        steps += 1
    return steps, accepted


def test_follows_the_source_and_drafts_k_tokens():
    p = SuffixProposer(1, 3)
    prompt = [50, 1, 2, 3, 4, 5, 6, 7, 8, 9, 51]
    assert p.propose("r", [*prompt, 1], 4) == [2, 3, 4, 5]
    assert p.propose("r", [*prompt, 1, 2, 3, 4], 4) == [5, 6, 7, 8]  # followed


def test_resumes_just_past_an_edit_not_at_the_latest_occurrence():
    """The token 7 recurs later in the prompt; after the edit (99 replaces 4) the copy resumes at the 5
    after the first 7, just past where the text left its source, not after the latest 7."""
    #         0   1  2  3  4  5  6  7  8  9 10 11 12 13 14
    prompt = [60, 1, 2, 3, 4, 7, 5, 6, 8, 9, 7, 30, 31, 32, 61]
    p = SuffixProposer(1, 3)
    assert p.propose("r", [*prompt, 1], 4) == [2, 3, 4, 7]
    assert p.propose("r", [*prompt, 1, 2, 3], 4) == [4, 7, 5, 6]  # following the source from 1
    text = [*prompt, 1, 2, 3, 99, 7]  # the edit: 99 for 4; then 7, which occurs at 5 and at 10
    assert p.propose("r", text, 4)[:2] == [5, 6]
    assert NgramProposer(1, 3).propose(text, 4)[:2] == [30, 31]  # the old rule: after the latest 7


def test_a_rename_is_learned_and_drafted_at_its_next_occurrences():
    """A 'function' whose argument (token 5) recurs; the output renames it (to 8, 9) and copies the rest.
    After the first occurrence the substitution 5 -> 8, 9 is learned and every later one is drafted."""
    body = [10, 11, 5, 12, 13, 14, 5, 15, 16, 17, 18, 5, 19, 20, 21, 22, 23, 5, 24, 25, 26, 27, 28]
    prompt = [1, 2, *body, 3]
    output = [10, 11, 8, 9, 12, 13, 14, 8, 9, 15, 16, 17, 18, 8, 9, 19, 20, 21, 22, 23, 8, 9, 24, 25, 26, 27, 28]
    suffix_steps, suffix_accepted = _decode(SuffixProposer(1, 4), prompt, output, 4)
    ngram_steps, ngram_accepted = _decode(NgramProposer(1, 4), prompt, output, 4)
    assert suffix_steps < ngram_steps
    assert suffix_accepted > ngram_accepted


def test_a_substitution_that_does_not_hold_is_dropped():
    """After learning 5 -> 8, 9 the text keeps a 5: the rule's draft is rejected once, then the source is
    drafted as it is."""
    body = [10, 11, 5, 12, 13, 14, 5, 15, 16, 17, 18, 5, 19, 20, 21, 22, 23]
    prompt = [1, 2, *body, 3]
    output = [10, 11, 8, 9, 12, 13, 14, 5, 15, 16, 17, 18, 5, 19, 20, 21, 22, 23]
    p = SuffixProposer(1, 4)
    _decode(p, prompt, output[:7], 4)  # through the rename and the copy after it: the rule is learned
    assert p._copies["r"].rules == {5: {(5,): (8, 9)}}
    text = [*prompt, *output[:7]]
    assert p.propose("r", text, 4) == [8, 9, 15, 16]
    text.append(5)  # the verifier kept the original
    p.propose("r", text, 4)
    assert p._copies["r"].rules == {5: {}}


def test_an_inserted_span_resumes_at_the_edit_point():
    """Type hints: tokens inserted after 'path' (40); the copy resumes at the ')' (41) that followed it."""
    #         0  1   2   3   4   5   6   7   8   9  10  11  12  13  14 15
    prompt = [1, 20, 21, 22, 40, 41, 42, 43, 44, 45, 46, 41, 47, 48, 49, 2]
    output = [20, 21, 22, 40, 90, 91, 41]
    p = SuffixProposer(1, 4)
    text = [*prompt]
    for token in output[:-1]:  # up to and including the inserted 91, one token at a time
        p.propose("r", text, 4)
        text.append(token)
    assert p.propose("r", [*text, 41], 4) == [42, 43, 44, 45]  # ')' at 5 (just past the edit), not at 11


def test_state_is_per_request_and_forgotten():
    p = SuffixProposer(1, 2)
    assert p.propose("a", [1, 2, 3, 1], 2) == [2, 3]
    assert p.propose("b", [7, 8, 7], 2) == [8, 7]
    p.forget(["a", "b"])
    assert p.propose("a", [4, 5], 2) == []  # a new text under a reused id starts over
    assert p.propose("a", [4, 5, 4], 0) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        SuffixProposer(0, 2)
    with pytest.raises(ValueError, match="min_n"):
        SuffixProposer(3, 2)


_EDIT_REQUEST = (
    "Rename `total` to `acc` in this function. Reply with the whole function.\n\n"
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n"
)


@pytest.mark.real_model
def test_real_model_greedy_suffix_speculation_on_an_edit_is_token_identical():
    """SmolLM2 on an edit request: the same tokens as plain greedy decoding, with drafts accepted. One load;
    the speculative engine shares the plain one's weights."""
    import torch

    from leanlm import LLM
    from leanlm.config import EngineConfig
    from leanlm.engine.engine import LLMEngine
    from leanlm.kernels import cpu_decode, cpu_gemv
    from leanlm.sampling_params import SamplingParams
    from tests.conftest import run_to_completion

    if not (cpu_gemv.is_available() and cpu_decode.is_available()):
        pytest.skip("exact verification needs the native bf16 kernels (test_spec_decode covers the fallback)")
    llm = LLM(dtype="bfloat16", progress=False, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": _EDIT_REQUEST}], add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    config = EngineConfig.from_options(
        enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, speculative="suffix"
    )
    spec = LLMEngine(llm.llm_engine.model_runner.model, tok, config, torch.device("cpu"), torch.bfloat16)
    outputs = []
    for engine in (llm.llm_engine, spec):
        request_id = engine.add_request(ids, params)
        outputs.append(run_to_completion(engine)[request_id].outputs[0].token_ids)
    assert outputs[1] == outputs[0]
    stats = spec.model_runner.spec_decoder.stats()
    assert stats.num_accepted_tokens > 0, stats
