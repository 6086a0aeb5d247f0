"""The stop rule: whether a request ends with the token just appended to it, and why. A function of the
request and the engine's limits; the scheduler applies its answer."""

from __future__ import annotations

import time
from collections.abc import Callable

from leanlm.engine.request import Request, RequestStatus

# Returns the stop string the request's text now ends with (e.g. via the detokenizer), or None.
StopChecker = Callable[[Request], str | None]


def check_stop(
    request: Request,
    token_id: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    stop_checker: StopChecker | None = None,
) -> tuple[RequestStatus, int | str | None] | None:
    """(status, stop_reason) when `request` ends with `token_id` (already appended), else None. Conditions in
    priority order; EOS, stop token ids and stop strings count only once min_tokens tokens exist. stop_reason
    is the stop token id or string that matched (None for EOS and length). A failing stop_checker raises."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if stop_checker is not None:
            stop_str = stop_checker(request)
            if stop_str is not None:
                return RequestStatus.FINISHED_STOPPED, stop_str
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def append_tokens(
    request: Request,
    token_ids: list[int],
    logprobs: list | None,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    stop_checker: StopChecker | None = None,
    error: str | None = None,  # why the step failed this request alone (its grammar refused a token): nothing appended
) -> RequestStatus | None:
    """Append sampled tokens one by one (with their logprobs and times), stopping at the first stop condition.
    Returns the status the request finishes with (its stop_reason or error set), or None while it goes on; tokens
    after a stop (speculative ones) are dropped."""
    if error is not None:
        request.error = error
        return RequestStatus.FINISHED_ERROR
    for token_idx, token_id in enumerate(token_ids):
        request.append_output_token_ids(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs[token_idx])
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        try:
            stop = check_stop(request, token_id, eos_token_ids, max_model_len, stop_checker)
        except Exception as exc:  # a stop check (detokenization) that fails fails its request alone
            request.error = f"stop check failed: {type(exc).__name__}: {exc}"
            return RequestStatus.FINISHED_ERROR
        if stop is not None:
            request.stop_reason = stop[1]
            return stop[0]
    return None
