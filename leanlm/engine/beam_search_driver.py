"""BeamSearchDriver: the async engine's beam searches, run on the engine thread among ordinary requests.

A BeamSearch admits its round's requests before an engine step and decides the round after it (`admit` /
`collect`), so its beams are scheduler requests batched with the rest. Searches start in arrival order while
their beam widths fit in max_num_seqs together; each delivers one final output (beam search is not streamed),
and aborting it frees every block its beams hold.
"""

from __future__ import annotations

from leanlm.engine.beam_search import BeamSearch, BeamSearchOutput
from leanlm.engine.engine import LLMEngine
from leanlm.engine.errors import RequestFailedError
from leanlm.engine.outputs import CompletionOutput, RequestOutput

# (request id, its output or the error that failed it): what the async engine delivers to streams.
Item = tuple[str, RequestOutput | BaseException]


class BeamSearchDriver:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # request id -> (search, prompt text to report), in arrival order (started searches stay in front)
        self._searches: dict[str, tuple[BeamSearch, str | None]] = {}

    def has_searches(self) -> bool:
        return bool(self._searches)

    def add(self, request_id: str, search: BeamSearch, prompt_text: str | None) -> None:
        self._searches[request_id] = (search, prompt_text)

    def abort(self, request_id: str) -> bool:
        """Drop one search, freeing the blocks of its running and held beams; False if it is not a search."""
        entry = self._searches.pop(request_id, None)
        if entry is None:
            return False
        entry[0].abort()
        return True

    def admit(self, items: list[Item]) -> None:
        """Before a step: start searches in arrival order while their beams fit in max_num_seqs together. A
        search that does not fit waits, and so do the ones behind it."""
        budget = self.engine.engine_config.max_num_seqs
        for request_id, (search, _) in list(self._searches.items()):
            if search.params.beam_width > budget:
                break
            budget -= search.params.beam_width
            try:
                search.admit()
            except Exception as exc:  # e.g. a request id already in the engine: this search fails, alone
                self._fail(request_id, exc, items)

    def collect(self, items: list[Item]) -> None:
        """After a step: decide the beam rounds that completed; deliver finished searches, fail broken ones."""
        for request_id, (search, prompt_text) in list(self._searches.items()):
            try:
                done = search.collect()
            except Exception as exc:  # a beam request failed in the step; collect already freed its blocks
                self._fail(request_id, exc, items)
                continue
            if done:
                del self._searches[request_id]
                items.append((request_id, _as_request_output(request_id, prompt_text, done[0][1])))

    def abort_all(self, items: list[Item], error: BaseException | None = None) -> None:
        """Drop every search; each reports `error`, or an empty finished output when None."""
        for request_id, (search, _) in self._searches.items():
            search.abort()
            items.append((request_id, error or RequestOutput(request_id, None, [], None, [], finished=True)))
        self._searches.clear()

    def _fail(self, request_id: str, exc: Exception, items: list[Item]) -> None:
        self._searches.pop(request_id)[0].abort()
        items.append((request_id, RequestFailedError(f"beam search failed: {exc}")))


def _as_request_output(request_id: str, prompt_text: str | None, output: BeamSearchOutput) -> RequestOutput:
    """A finished beam search as a RequestOutput: one completion per hypothesis, best score first."""
    completions = [
        CompletionOutput(
            index=i, text=seq.text, token_ids=seq.token_ids, logprobs=None, finish_reason=seq.finish_reason
        )
        for i, seq in enumerate(output.sequences)
    ]
    return RequestOutput(request_id, prompt_text, output.prompt_token_ids, None, completions, finished=True)
