"""SharedKV: requests whose KV blocks are shared beyond the scheduler's plain rule.

Two kinds (both copy-on-write through KVCacheManager.fork): finished keeps_kv requests holding their blocks
for forks until released (beam search), and parallel-sampling siblings waiting, in no queue, for the group's
first request to compute the prompt they fork. The scheduler owns one and applies its answers to its queues.
"""

from __future__ import annotations

from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.request import Request, RequestStatus


class SharedKV:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        # Finished keeps_kv requests by id, oldest first: they hold their blocks until release, or until the
        # pool runs short (evict_oldest).
        self.held: dict[str, Request] = {}
        # Parallel sampling: the first request's id -> its siblings, which fork its KV once it has computed all
        # but its prompt's last token.
        self._siblings: dict[str, list[Request]] = {}

    # ---- held KV (beam search) -----------------------------------------------------------------------

    def hold(self, request: Request) -> None:
        self.held[request.request_id] = request

    def is_held(self, request_id: str) -> bool:
        return request_id in self.held

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks; False when it holds none here."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv_cache_manager.free(request)
        return True

    def check_fork(self, parent: Request, child: Request, num_computed_tokens: int) -> None:
        """Refuse a fork from a parent without KV (neither running nor held) or of a count outside the child."""
        if not self.is_held(parent.request_id) and parent.status != RequestStatus.RUNNING:
            raise ValueError(
                f"request {parent.request_id!r} holds no KV to fork ({parent.status.name}); fork a running request "
                f"or a finished one made with keeps_kv=True"
            )
        if not 0 <= num_computed_tokens < child.num_tokens:
            raise ValueError(f"a fork shares 0..{child.num_tokens - 1} computed tokens, not {num_computed_tokens}")

    def evict_oldest(self) -> Request | None:
        """Free the blocks of the oldest held request that has any (idle KV goes before running requests are
        preempted), keeping their prefix hashes; the scheduler then marks its KV gone. None if none has any."""
        for request in self.held.values():
            if request.num_computed_tokens > 0:
                self.kv_cache_manager.free(request, keep_hashes=True)
                return request
        return None

    # ---- parallel-sampling siblings ------------------------------------------------------------------

    def add_siblings(self, first: Request, siblings: list[Request]) -> None:
        """`siblings` (same prompt as `first`, checked by the scheduler) wait for `first`'s prompt KV."""
        self._siblings[first.request_id] = list(siblings)

    def has_siblings(self, request_id: str) -> bool:
        return request_id in self._siblings

    def take_siblings(self, first: Request) -> list[Request]:
        """The siblings waiting on `first` (none left waiting after)."""
        return self._siblings.pop(first.request_id, [])

    def drop_sibling(self, request: Request) -> bool:
        """Forget a sibling still waiting to fork; False if it is not one."""
        for siblings in self._siblings.values():
            if request in siblings:
                siblings.remove(request)
                return True
        return False
