"""The runner of the drawn pipeline schedules: submits, steps and aborts between steps, then
``run()``, each request finished once whatever its kind of submit."""

from __future__ import annotations


def play_ops(pipe, ops, submit, submitted):
    """Run the drawn ``ops`` on ``pipe``, then ``run()``.

    Parameters
    ----------
    pipe : DecodePipeline
        The pipeline the schedule drives.
    ops : list of (str, object)
        ``("submit", arg)``: ``submit(arg)`` makes a request; ``("step", _)``: a step unless the
        pipeline is idle; ``("abort", i)``: the ``i``-th submitted request, modulo their number,
        is aborted (nothing when none was submitted).
    submit : callable
        ``submit(arg)`` submits one request to ``pipe`` and returns it.
    submitted : list
        Each ``(request, arg)`` is appended as it is submitted, so that ``len(submitted)`` counts
        the earlier ones while ``submit`` runs.

    Returns
    -------
    list
        The finished requests: every submitted one, exactly once (checked).
    """
    finished = []
    for kind, arg in ops:
        if kind == "submit":
            submitted.append((submit(arg), arg))
        elif kind == "step" and not pipe.idle:
            finished += pipe.step()
        elif kind == "abort" and submitted:
            pipe.abort(submitted[arg % len(submitted)][0])
    finished += pipe.run()
    assert sorted(map(id, finished)) == sorted(id(r) for r, _ in submitted)
    assert len(set(map(id, finished))) == len(finished)
    return finished
