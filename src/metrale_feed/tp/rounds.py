"""What a shard's sampling calls exchange, fixed when the shard is made (``FilterRounds``);
docs/tensor-parallel.md, "Fixed rounds". No numpy or torch at import: the package's lazy names
resolve without them."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _core

CANDS_MAX = _core.SELECT_CANDS_MAX  # the largest top_k that the candidate lists serve
ROUNDS = 32 // _core.SELECT_DIGIT_BITS  # rounds of one radix select: the 32-bit key, a digit at a time


@dataclass(frozen=True)
class FilterRounds:
    """The filters a shard's sampling calls apply, in exchanges of one shape whatever the params.

    Without it (``VocabShard(..., filters=None)``) a filtered call's rounds follow its params: the
    fewest exchanges, but ranks whose params disagree would issue different collectives, which
    only the host backend's exchange can skip (the stream's worker sees the first decision's
    fault before the next collective). With it, every sampled call (host or device params, filters
    on or not) makes the same exchanges, sized by ``max_rows``: 2, plus 1 for ``top_k``, plus 4 for
    ``top_p``. The first decision finds, on every rank alike, a row whose params differ between
    ranks (each slice's first record carries a digest of the row's params) or that the rounds do
    not serve (a ``top_k`` above theirs, ``top_p`` alone without it); the fault is carried to the
    combine on the device: every row ``NO_TOKEN`` and a ``FeedError`` on every rank, after
    collectives that still matched. The cuda backend, whose NCCL collectives are queued with the
    call, needs it for ``top_k``, ``top_p`` and ``min_p``. What ranks must still agree on is the
    sequence of calls and their operations (argmax or sampling). ``VocabShard.max_call_bytes`` is
    what each sampled call then sends from a rank.

    Parameters
    ----------
    top_k : int
        The largest ``top_k`` served, 0 to ``SELECT_CANDS_MAX`` (0: none): one exchange of each
        slice's greatest ``top_k`` candidates, ``8 * top_k`` bytes a row.
    top_p : bool
        Serve ``top_p`` in rows without ``top_k`` (a radix select: 4 exchanges of 2 KiB a row).
        Rows with a ``top_k`` take ``top_p`` over their candidates without it. ``min_p`` is always
        served.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.FilterRounds(top_k=64, top_p=True).collectives
    7
    """

    top_k: int = 0
    top_p: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= CANDS_MAX:
            raise ValueError(f"FilterRounds.top_k must be an int in [0, {CANDS_MAX}], not {self.top_k!r}")
        if not isinstance(self.top_p, bool):
            raise ValueError(f"FilterRounds.top_p must be a bool, not {self.top_p!r}")

    @property
    def selects(self) -> tuple[str, ...]:
        """The radix selects every call runs."""
        return ("p",) if self.top_p else ()

    @property
    def collectives(self) -> int:
        """Exchanges per filtered call: the first, the candidates', the selects' rounds, the race's."""
        return 2 + (1 if self.top_k else 0) + ROUNDS * len(self.selects)

    def refusal(self, top_k: int, top_p: float) -> str | None:
        """Why a sampled row with these filters is not served (None: it is): the TOP decision's
        fault, said before anything is queued (``DecodePipeline.submit``)."""
        if top_k > self.top_k:
            return f"top_k={top_k} is above the shard's FilterRounds(top_k={self.top_k})"
        if not top_k and 0.0 < top_p < 1.0 and not self.top_p:
            return "top_p without top_k needs the shard's FilterRounds(top_p=True)"
        return None

    @property
    def code(self) -> int:
        """What the shard's agreement compares across ranks."""
        return self.top_k | (int(self.top_p) << 16)
