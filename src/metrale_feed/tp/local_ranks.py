"""Local ranks for ``metrale-feed demo --tp`` and ``bench --tp``: one process a rank, one gloo
rendezvous on 127.0.0.1, each rank reporting one ``RESULT <json>`` line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple


def run_local_ranks(module: str, world: int, args: Sequence[str],
                    timeout: float = 600) -> List[Tuple[int, str, str]]:
    """Run ``python -m module RANK WORLD PORT *args`` for each rank on a free local port and wait
    for all of them (a rank still running after ``timeout`` seconds is killed). Each rank runs in
    a session of its own, so a Ctrl-C at the terminal reaches only this process. Returns each
    rank's (exit status, stdout, stderr)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", module, str(r), str(world), str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def result_of(stdout: str) -> Optional[Dict[str, Any]]:
    """The JSON of a rank's ``RESULT`` line, or None when it printed none."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    return None if line is None else dict(json.loads(line[len("RESULT "):]))
