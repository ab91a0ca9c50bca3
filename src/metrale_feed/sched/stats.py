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

    def __init__(self, router: Any, model: Any) -> None:
        # The router's counters (``RouterStats``, added to these) and the model, whose host
        # waits since the pipeline was made count as the pipeline's; never the pipeline itself.
        self._router = router
        self._model = model
        self._model_syncs_at_start = getattr(model, "host_syncs", 0)
        self._spec: Any = None  # the speculative step, whose launches and waits count here
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

    def add_speculative(self, step: Any) -> None:
        """Count ``step``'s launches and host waits (a ``SpeculativeStep``, made after these
        counters) beside the router's: it launches its verify steps itself, not through the
        ring, so they are added here, never written into the router's."""
        self._spec = step

    @property
    def host_syncs(self) -> int:
        model_syncs = getattr(self._model, "host_syncs", 0) - self._model_syncs_at_start
        spec = self._spec
        spec_syncs = 0 if spec is None else spec.host_syncs + getattr(spec.drafter, "host_syncs", 0)
        return self._router.host_syncs + model_syncs + spec_syncs

    @property
    def launches(self) -> int:
        spec = self._spec
        return self._router.launches + (0 if spec is None else spec.launches)

    @property
    def ahead_launches(self) -> int:
        spec = self._spec
        return self._router.ahead_launches + (0 if spec is None else spec.ahead_launches)

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._router[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> int:
        try:
            value: int = getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None
        return value

    def as_dict(self) -> Dict[str, int]:
        out = self._router.as_dict()
        for name in ("launches", "ahead_launches", "host_syncs"):
            out[name] = getattr(self, name)
        out.update((name, getattr(self, name)) for name in self._OWN)
        return out

    def __repr__(self) -> str:
        return f"PipelineStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"
