"""Structured outputs decided on the device: a request's grammar as a ``TokenAutomaton``
(docs/encodings.md, "TokenAutomaton"), or on the host as a ``HostGrammar`` (an xgrammar
matcher, imported only when one is made).

Imported on first use of ``metrale_feed.TokenAutomaton``; it imports numpy.
"""

from __future__ import annotations

from .automaton import DEAD, EDGE_DTYPE, FINAL, STATE_DTYPE, TokenAutomaton
from .host import HostGrammar

__all__ = ["TokenAutomaton", "HostGrammar", "STATE_DTYPE", "EDGE_DTYPE", "DEAD", "FINAL"]
