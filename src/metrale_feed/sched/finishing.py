"""How a request leaves the batch: the host's walk of constrained rows, a row left with no
candidate, a step's fault, a finish, a preemption and the return of its blocks and penalty slot.
A mixin of ``DecodePipeline``: the loop thread calls these as it commits a step."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Set, Tuple

from ..feed import NO_TOKEN
from .request import _PREEMPTED, _RUNNING, Request, RequestStatus


class Finishing:
    """``DecodePipeline``'s finishing half (requests leaving the batch)."""

    def _walk(self, gram: List[Tuple[int, Request]], ids: List[int], dead: Optional[Set[int]],
              finishing: List[Tuple[Request, RequestStatus]]
              ) -> Tuple[Optional[Set[int]], List[Request]]:
        """The host's walk of each row with a grammar over the id its step picked, before the
        ids are committed: the request's state after its committed tokens (what a row that
        joins again takes as its word), and the requests whose state now has no outgoing
        transition (returned). An id its state does not allow (the device's state word and the
        host's disagree) is never committed: the request finishes ``"grammar"`` and the row
        joins the returned set of rows thrown away."""
        from .grammar import walk

        ends: List[Request] = []
        copied = False
        for i, req in gram:
            if (dead is not None and i in dead) or req.status is not _RUNNING:
                continue
            state, end = walk(req._grammar, req._gstate, ids[i])
            if state is None:
                if not copied:  # a copy: the step's own set keeps what was thrown away
                    dead, copied = set(dead or ()), True
                dead.add(i)  # type: ignore[union-attr]
                finishing.append((req, RequestStatus.FINISHED_GRAMMAR))
                continue
            req._gstate = state
            if end:
                ends.append(req)
        return dead, ends

    def _no_candidate(self, rows: List[Request], ids: List[int], dead: Optional[Set[int]],
                      hits: Any, finishing: List[Tuple[Request, RequestStatus]]
                      ) -> Optional[Set[int]]:
        """The rows of an awaited step that had no id they may pick: ``NO_TOKEN`` (a sampled
        row whose every allowed logit was not finite), or a stop id while ``min_tokens`` bans it
        (a greedy row whose every candidate was ``-inf``: the argmax answers the lowest). None
        of it is committed nor fed to a later step: each finishes ``"no_candidate"``
        (``"grammar"`` with a grammar: its state allowed no id it may pick). Returns the rows
        whose ids are not committed."""
        out: Optional[Set[int]] = None  # a copy: the step's own set keeps what was thrown away
        for i, (req, token) in enumerate(zip(rows, ids)):
            if (token == NO_TOKEN or (hits and token in hits and token in req.stop_ids
                                      and len(req.tokens) < req.min_tokens)) and (
                    dead is None or i not in dead) and req.status is _RUNNING:
                if out is None:
                    out = set(dead or ())
                out.add(i)
                finishing.append((req, RequestStatus.FINISHED_NO_CANDIDATE
                                  if req._grammar is None and req._host is None
                                  else RequestStatus.FINISHED_GRAMMAR))
        return dead if out is None else out

    def _fault(self, launch: int, added: int, exc: BaseException) -> None:
        """A step whose wait failed (a device-side fault: a host function that raised, a
        kernel fault) or whose debug check failed. Its ids cannot be trusted, nor those of the
        steps in flight after it (they were fed from its cells, and their forwards ran behind
        the fault), nor the KV its forward should have written: every running request is in it
        or joined after it, so each one finishes with ``"error"`` and returns its blocks. The
        steps still in flight are waited for (their ring slots come back) and thrown away.
        Waiting requests are untouched: their prefills come after the fault in stream order."""
        budget = self.budget
        budget.settle(added)  # the failed step's blocks, returned below with their requests
        for later in self._inflight:
            try:
                self.io.await_result(later.ticket)
            except Exception:
                pass  # the same fault, reported again: nothing of it is kept either way
            self.stats.steps += 1
            budget.settle(len(later.taken))
            self.stats.rows_discarded += len(later.rows) - len(later.dead or ())
        self._inflight.clear()
        reason = f"step {launch} failed: {type(exc).__name__}: {exc}"
        for req in self._running:
            req.error = reason
        self._rows, self._seqs, self._lists = [], None, None  # the next launch starts afresh
        self._prev_ids = []
        self._dirty = True
        try:
            self._finish_all([(req, RequestStatus.FINISHED_ERROR) for req in self._running])
        except Exception:
            pass  # a return refused after the fault: they finished, and the fault is the news

    # ---- finishing, aborts and preemption ----

    def _discard_in_flight(self, req: Request) -> None:
        """Mark ``req``'s rows in the steps still in flight as thrown away."""
        for step in self._inflight:
            if step.launch <= req._last and step.launch >= req._join:
                try:
                    at = step.rows.index(req)
                except ValueError:
                    continue
                if step.dead is None:
                    step.dead = set()
                step.dead.add(at)
                self.stats.rows_discarded += 1
                if req in step.taken:  # its block for this step goes back with the rest
                    step.taken.remove(req)  # type: ignore[attr-defined]
                    self.budget.discard(1)

    def _release(self, req: Request) -> None:
        """Every uncommitted reservation rolled back, every block back to the pool. ``req`` has a
        view: it runs, or its prefill is being undone (a request has one exactly then)."""
        self.budget.free(req._seq)  # type: ignore[arg-type]
        req._seq = None

    def _leave(self, req: Request) -> None:
        # Out of the launch schedules, so a long-running pipeline keeps no stale entries.
        for table, key in ((self._ending, req._last), (self._boundary, req._bound)):
            entries = table.get(key)
            if entries is not None and req in entries:
                entries.remove(req)
                if not entries:
                    del table[key]
        req._bound = -1
        self._sampled -= req.sampled
        self._with_lp -= req.logprobs is not None
        self._constrained -= req._grammar is not None
        self._hosted -= req._host is not None
        if not self._constrained and self._gram is not None:
            self._gram.release()  # the joined automaton, after the steps queued with it
        self._discard_in_flight(req)
        if self._spec is not None:
            self._spec.discard(req)
        self._running.remove(req)
        self._dirty = True
        # Its blocks and its penalty slot last: one the model or the stream refuses raises with
        # the request already out of the batch, never left running with no view.
        try:
            self._release(req)
        finally:
            if self._pen is not None:
                self._pen.leave(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        try:
            if req.status is _RUNNING:
                self._leave(req)
            else:  # waiting or preempted: in the queue, with no view and no block
                self._waiting.remove(req)
        finally:
            req.status = status
            self.stats.finished += 1
            self._finished.append(req)

    def _finish_all(self, finishing: Iterable[Tuple[Request, RequestStatus]]) -> None:
        """Finish each one; a return of blocks or of a penalty slot that raises does not stop
        the others (a row left running past its last launch would never finish): the first such
        error is raised once all have finished."""
        error: Optional[BaseException] = None
        for req, status in finishing:
            try:
                self._finish(req, status)
            except Exception as exc:
                if error is None:
                    error = exc
        if error is not None:
            raise error

    def _preempt(self, req: Request) -> None:
        try:
            self._leave(req)
        finally:
            req.status = _PREEMPTED
            self._waiting.appendleft(req)  # first in line to resume
            self.stats.preemptions += 1
