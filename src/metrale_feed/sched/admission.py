"""How a request joins the batch and gets its KV blocks: admission (first come, first served,
while rows and blocks allow), its prefill, the launch numbers it runs by, and each launch's
reservation of the blocks its rows cross into, with the preemption of the youngest row when the
pool runs dry (the one place that happens, for the plain step and the speculative step). A mixin
of ``DecodePipeline``: the loop thread calls these as it launches a step."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..errors import FeedError, KvPoolExhausted
from .request import _RUNNING, Request, _order_of


class Admission:
    """``DecodePipeline``'s admission half (requests joining the batch, and their blocks)."""

    def _blocks_for(self, positions: int) -> Optional[int]:
        bs = self._block_size
        return None if bs is None else -(-positions // bs)

    def admit(self) -> int:
        """Admit waiting requests now, as ``step()`` would at its next launch (first come, first
        served, while rows and blocks allow), so their prefill is queued before the next step.

        Returns
        -------
        int
            How many joined the batch.
        """
        with self._lock("admit"):
            if self._closed:
                raise FeedError("the pipeline is closed")
            self._drain()
            before = len(self._running)
            self._admit(self._launches)
            return len(self._running) - before

    def _admit(self, launch: int) -> None:
        """First come, first served: the oldest waiting requests join while there are rows and
        (when the pool is known) blocks for their histories and their first step. A model with
        ``prefill_many`` prefills them in one call (one forward for the reference model), so an
        admission does not fill the model's queue with forwards."""
        waiting = self._waiting
        room = self.max_rows - len(self._running)
        pool = self._pool
        free = pool.free_count if pool is not None else 0
        # Keep blocks for the running rows that cross a block boundary at this launch, so an
        # admitted request is not preempted at once.
        free -= len(self._boundary.get(launch, ()))
        batch: List[Request] = []
        for req in waiting:
            if len(batch) >= room:
                break
            if pool is not None:
                need = self._blocks_for(len(req.prompt) + len(req.tokens)
                                        + self._extra_positions) or 0
                if free < need:
                    break
                free -= need
            batch.append(req)
        if not batch:
            return
        prefill_many = self._prefill_many
        if prefill_many is None:  # one request at a time; stop at the first that does not fit
            for count, req in enumerate(batch):
                try:
                    prefill = self.model.prefill  # type: ignore[attr-defined]
                    fits = self._prefill([req], prefill, False)
                except BaseException:
                    for done in batch[:count]:  # they stay waiting, so with no view or block
                        self._release(done)
                    raise
                if not fits:
                    batch = batch[:count]
                    break
        elif not self._prefill(batch, prefill_many, True):
            return
        for req in batch:
            waiting.popleft()
            self._join(req, launch)
            req.status = _RUNNING
            self._running.append(req)
        self.stats.admitted += len(batch)
        self._dirty = True

    def _prefill(self, reqs: List[Request], prefill: Any, many: bool) -> bool:
        """Prefill each request's history but its last id into a fresh sequence view; False
        (and nothing kept) when the pool ran out (a pool the pipeline cannot see). A prefill
        that raises anything else keeps nothing either: the requests stay waiting, with no
        view and no block, and the error propagates."""
        views, histories = [], []
        for req in reqs:
            req._seq = self._view(req, req._order)
            req._base = 0
            views.append(req._seq)
            histories.append((list(req.prompt) + req.tokens)[:-1])
        try:
            if many:
                prefill(views, histories, self.stream)
            else:
                prefill(views[0], histories[0], self.stream)
        except KvPoolExhausted:
            for req in reqs:
                self._release(req)
            return False
        except BaseException:
            for req in reqs:
                self._release(req)
            raise
        return True

    def _join(self, req: Request, launch: int) -> None:
        req._join = launch
        req._last = launch + req.max_new_tokens - len(req.tokens) - 1
        # The step of launch L draws token len(tokens) + (L - launch): its position is known
        # from the launch number, and after a preemption it resumes from the committed tokens.
        req._pos0 = len(req.prompt) + len(req.tokens) - launch
        self._ending.setdefault(req._last, []).append(req)
        self._sampled += req.sampled
        self._with_lp += req.logprobs is not None
        self._constrained += req._grammar is not None
        self._hosted += req._host is not None
        if req.stop_ids:
            self._stop_union = self._stop_union | req.stop_ids
        bs = self._block_size
        if bs is not None and self._spec is None:  # the first launch whose position starts a block
            self._schedule(req, launch + (-req._base) % bs)

    def _schedule(self, req: Request, launch: int) -> None:
        if launch <= req._last:
            req._bound = launch
            self._boundary.setdefault(launch, []).append(req)

    def _reserve(self, rows: List[Request], launch: int) -> List[Request]:
        """KV blocks for this launch's positions, through the budget; returns the rows left
        (``_reserve_or_preempt``).

        With a known block size the pipeline reserves only for the rows its schedule says cross
        a block boundary, and keeps the in-flight accounting itself: a discarded step's block
        always leaves with its request (finish, abort or preemption return every block), so
        there is no single reservation to roll back and the router's ledger is not needed. A
        model that does not say its block size decides per row, through the budget's ledger (so
        a discarded step's reservation can be rolled back exactly)."""
        if self._block_size is None:
            budget = self.budget
            return self._reserve_or_preempt(
                rows, rows, lambda due: budget.reserve_many([r._seq for r in due]))  # type: ignore[misc]
        due = self._boundary.pop(launch, None)
        if not due:
            return rows
        try:
            rows = self._reserve_or_preempt(rows, due, self._take_due)
        except BaseException:
            # A model's reserve that raised (not a full pool) took nothing for the rows it did
            # not serve: they stay due at this launch, which the next step() makes again (the
            # rows served before it have their block, and the retry finds it there).
            again = [r for r in due if r.status is _RUNNING]
            if again:
                self._boundary[launch] = again
            raise
        self._reschedule(due, launch + self._block_size)
        return rows

    def _take_due(self, due: List[Request]) -> int:
        """The block of each of ``due`` for the launch being made, in one budget call (the
        rows given one join ``_taking``); the index of the first the pool could not serve, or
        -1."""
        served, missed = self.budget.take_many([r._seq for r in due])  # type: ignore[misc]
        if served:
            self._taking += (due[:served] if not missed else
                             [r for i, r in enumerate(due[:served]) if i not in missed])
        return served if served < len(due) else -1

    def _reserve_or_preempt(self, rows: List[Request], due: List[Request],
                            reserve: Callable[[List[Request]], int]) -> List[Request]:
        """The one place a full pool preempts (the plain step's and the speculative step's):
        ``reserve(due)`` takes the blocks of each of ``due`` in order and returns the index of
        the first one the pool could not serve (-1: all served). Then the youngest running row
        of ``rows`` gives its blocks back and waits to resume (recompute), and the rest of
        ``due`` is asked again. Returns the rows left."""
        while due:
            failed = reserve(due)
            if failed < 0:
                break
            victim = max((r for r in rows if r.status is _RUNNING), key=_order_of)
            if victim in self._taking:  # its block for the launch being made goes back with
                self._taking.remove(victim)  # the rest of its blocks, never reserved for it
                self.budget.untake(1)
            self._preempt(victim)
            rows = [r for r in rows if r is not victim]
            due = [r for r in due[failed:] if r is not victim]
        return rows

    def _reschedule(self, reqs: List[Request], launch: int) -> None:
        """``reqs`` crossed a block boundary at this launch: the ones still running cross the
        next one at ``launch``; the others are due nowhere (one pass: it runs every step)."""
        keep = []
        for r in reqs:
            if r.status is _RUNNING and r._last >= launch:
                r._bound = launch
                keep.append(r)
            else:
                r._bound = -1
        if keep:
            entries = self._boundary.get(launch)
            if entries is None:
                self._boundary[launch] = keep
            else:
                entries += keep
