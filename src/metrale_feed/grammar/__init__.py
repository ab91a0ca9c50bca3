"""Structured outputs decided on the device: a request's grammar as a ``TokenAutomaton``
(docs/encodings.md, "TokenAutomaton").

Imported on first use of ``metrale_feed.TokenAutomaton``; it imports numpy.
"""

from __future__ import annotations

from .automaton import DEAD, EDGE_DTYPE, FINAL, STATE_DTYPE, TokenAutomaton

__all__ = ["TokenAutomaton", "STATE_DTYPE", "EDGE_DTYPE", "DEAD", "FINAL"]
