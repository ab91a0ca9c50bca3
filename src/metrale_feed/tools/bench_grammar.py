"""What a representative JSON schema's ``TokenAutomaton`` costs over a 32k and a 152k vocabulary:
its states, edges and device bytes (beside a bitmask a state), the time outlines-core takes to
compile it, the time to encode it, and the time to upload it on the active backend.

The vocabularies are synthetic and deterministic (no download): the 256 single bytes, then
byte-level-like merges of 2 to 8 characters (half with a leading space, some with UTF-8
fragments), and an end-of-sequence id last. Run ``python -m metrale_feed.tools.bench_grammar``;
it needs outlines-core (``pip install 'metrale-feed[grammar]'``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, List, Optional, Sequence

#: An object with a string, an integer, an enum and an array of numbers.
SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "color", "scores"],
}


def synthetic_vocabulary(size: int, seed: int = 0) -> Any:
    """An ``outlines_core.Vocabulary`` of ``size`` ids: ``size - 1`` distinct byte strings and
    the end-of-sequence id ``size - 1``; the same for the same arguments."""
    import numpy as np
    from outlines_core import Vocabulary

    if size < 258:
        raise ValueError(f"size must be at least 258 (the single bytes and an end id), got {size}")
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz" * 3 + b"ETAOINSHRDLU0123456789"
                             + b"\"{}[]:,.-_\\/'!?()", np.uint8)
    tails = "\u00e9\u4e2d".encode()
    tokens: List[bytes] = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    while len(tokens) < size - 1:
        length = int(rng.integers(2, 9))
        token = bytes(alphabet[rng.integers(0, len(alphabet), length)])
        if rng.random() < 0.5:
            token = b" " + token
        if rng.random() < 0.02:
            token += tails[: int(rng.integers(1, len(tails) + 1))]
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return Vocabulary(size - 1, {token: [i] for i, token in enumerate(tokens)})


def measure(size: int, schema: Optional[Dict[str, Any]] = None, repeats: int = 3) -> Dict[str, Any]:
    """One row: the schema's automaton over a synthetic vocabulary of ``size`` ids (median of
    ``repeats`` timings each)."""
    import numpy as np
    import outlines_core

    import metrale_feed as mf
    from metrale_feed.grammar import TokenAutomaton

    vocabulary = synthetic_vocabulary(size)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema or SCHEMA))
    compile_s, encode_s, upload_s = [], [], []
    automaton = None
    for _ in range(repeats):
        start = time.perf_counter()
        index = outlines_core.Index(regex, vocabulary)
        compile_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        automaton = TokenAutomaton.from_outlines(index, size, eos=size - 1)
        encode_s.append(time.perf_counter() - start)
        with mf.Stream() as stream:
            mf.stream_synchronize(stream)
            start = time.perf_counter()
            automaton.to_device(stream)
            mf.stream_synchronize(stream)
            upload_s.append(time.perf_counter() - start)
            automaton.close()
    assert automaton is not None
    dense = int(np.count_nonzero(automaton.states["fallback"] != 0xFFFFFFFF))
    return {
        "vocab": size, "states": automaton.num_states, "dense": dense,
        "edges": len(automaton.edges), "bytes": automaton.nbytes,
        "bitmask_bytes": automaton.num_states * ((size + 31) // 32) * 4,
        "compile_ms": 1e3 * sorted(compile_s)[len(compile_s) // 2],
        "encode_ms": 1e3 * sorted(encode_s)[len(encode_s) // 2],
        "upload_ms": 1e3 * sorted(upload_s)[len(upload_s) // 2],
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=None,
                        help="bound the string's length (each length left is a state of its own)")
    args = parser.parse_args(argv)
    import metrale_feed as mf

    schema = json.loads(json.dumps(SCHEMA))
    if args.max_length is not None:
        schema["properties"]["name"]["maxLength"] = args.max_length
    print(f"backend {mf.backend()}; schema {json.dumps(schema)}")
    print(f"{'vocab':>7} {'states':>6} {'dense':>5} {'edges':>7} {'bytes':>9} {'bitmasks':>11} "
          f"{'compile ms':>10} {'encode ms':>9} {'upload ms':>9}")
    for size in args.vocab:
        row = measure(size, schema, repeats=args.repeats)
        print(f"{row['vocab']:>7} {row['states']:>6} {row['dense']:>5} {row['edges']:>7} "
              f"{row['bytes']:>9} {row['bitmask_bytes']:>11} {row['compile_ms']:>10.1f} "
              f"{row['encode_ms']:>9.1f} {row['upload_ms']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
