"""``PipelineStats``: a pipeline's counters, its own and its router's, read as one."""

from __future__ import annotations

from typing import Any, Dict


class PipelineStats:
    """The router's counters plus the pipeline's own: ``steps`` (awaited), ``host_syncs`` (every
    wait of the host on the device: the router's, the model's and the pipeline's),
    ``rows_discarded`` (results thrown away for rows that finished, were aborted or preempted
    with a step in flight), ``preemptions``, ``admitted``, ``finished``; with ``speculative=``
    (docs/speculative.md): ``drafted`` (draft slots verified, ``k`` a row a step), ``accepted``
    (drafts the target agreed with), ``emitted`` (ids the verify steps emitted, ``accepted`` plus
    one a row a step), ``spec_discarded`` (emitted past a stop or ``max_new_tokens``, never
    committed) and ``spec_blocks_returned`` (KV blocks that held only rejected positions)."""

    _OWN = ("steps", "rows_discarded", "preemptions", "admitted", "finished", "drafted",
            "accepted", "emitted", "spec_discarded", "spec_blocks_returned")

    def __init__(self, pipe: Any) -> None:
        # The DecodePipeline whose router (``io``), speculative step (``_spec``) and model it
        # reads; typed loosely so this module stays below the pipeline's.
        self._pipe = pipe
        self.steps = 0
        self.rows_discarded = 0
        self.preemptions = 0
        self.admitted = 0
        self.finished = 0
        self.drafted = 0
        self.accepted = 0
        self.emitted = 0
        self.spec_discarded = 0
        self.spec_blocks_returned = 0

    @property
    def host_syncs(self) -> int:
        pipe = self._pipe
        model_syncs = getattr(pipe.model, "host_syncs", 0) - pipe._model_syncs_at_start
        spec = pipe._spec
        spec_syncs = 0 if spec is None else spec.host_syncs + getattr(spec.drafter, "host_syncs", 0)
        return pipe.io.stats.host_syncs + model_syncs + spec_syncs

    # A speculative step is launched by the pipeline's delegate, not through the ring: its
    # launches are counted there and added to the router's, never written into them.
    @property
    def launches(self) -> int:
        spec = self._pipe._spec
        return self._pipe.io.stats.launches + (0 if spec is None else spec.launches)

    @property
    def ahead_launches(self) -> int:
        spec = self._pipe._spec
        return self._pipe.io.stats.ahead_launches + (0 if spec is None else spec.ahead_launches)

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._pipe.io.stats[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> int:
        try:
            value: int = getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None
        return value

    def as_dict(self) -> Dict[str, int]:
        out = self._pipe.io.stats.as_dict()
        for name in ("launches", "ahead_launches", "host_syncs"):
            out[name] = getattr(self, name)
        out.update((name, getattr(self, name)) for name in self._OWN)
        return out

    def __repr__(self) -> str:
        return f"PipelineStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"
