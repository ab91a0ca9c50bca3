"""A transformers ``LlamaForCausalLM`` served through the device token feed.

The model is built from a small config with random weights (nothing is downloaded). It implements
``ModelDeviceFeed`` through ``RuntimeFeedMixin``:

- its KV cache is paged: per layer, ``num_blocks`` blocks of ``block_size`` positions, handed out
  by the trait's ``reserve_decode_block``/``release_decode_blocks``; a row's history is gathered
  through its block table at each step;
- its forward is queued with ``metrale_feed.launch_host_func``, so it runs in stream order on the
  stream's worker (host backend) while the scheduler goes on: the input ids a fed step reads are
  resolved from the feed cells into a torch tensor first, on the same stream;
- its logits are a torch tensor, handed straight to the masked argmax (DLPack, no copy).

It is served by ``AsyncDeviceIo`` (the two-deep pipeline of ``metrale_feed.tools.demo.run_async``), and
its tokens equal ``model.generate(do_sample=False)`` for each prompt (tests/test_interop_torch.py).

It also runs through ``DecodePipeline``: with speculative decoding (``decode_batch_verify``
runs a row's input and its ``k`` drafts in one forward, and the n-gram drafter proposes them)
and with a repetition penalty, and its greedy tokens again equal ``generate``'s.

And it serves structured outputs: ``--json-schema FILE`` builds a byte-pair tokenizer here (trained
on a few lines of text, nothing downloaded), the outlines-core vocabulary of its tokens, and the
schema's ``TokenAutomaton`` over it; each request is submitted with ``grammar=`` that automaton,
so its mask, pick and next state are decided on the device in the step's own call. Every output
is JSON the schema validates, ending with the end-of-sequence id within ``max_new_tokens`` (the
longest output the automaton allows, computed from it: the schema must bound its strings, numbers
and arrays), and its greedy tokens equal a transformers ``generate`` whose logits are masked by
the outlines-core index's own allowed tokens (tests/test_hf_llama_json.py checks both; the run
itself checks that each output parses and ended with the end-of-sequence id).

Run ``python examples/hf_llama.py`` for a short comparison of the async and sync routers;
``--speculative ngram --k 4`` and/or ``--repetition-penalty 1.3`` (with ``--depth 1`` or
``2``) runs the pipeline with them instead; ``--json-schema examples/user.schema.json`` (with the
same options) serves JSON outputs.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import metrale_feed as mf
from metrale_feed import NO_TOKEN, FeedError, ModelDeviceFeed, RuntimeFeedMixin
from metrale_feed.kv import PagedKvMixin, SequenceState


def small_llama(dtype: torch.dtype = torch.float32, *, vocab: int = 256, seed: int = 0) -> Any:
    """A randomly initialised two-layer Llama (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model.to(dtype)


class HfLlamaFeed(PagedKvMixin, RuntimeFeedMixin, ModelDeviceFeed):
    """``ModelDeviceFeed`` over a transformers causal LM with a paged KV cache.

    Parameters
    ----------
    model : transformers.LlamaForCausalLM
        Any causal LM whose ``forward`` takes ``past_key_values`` as a ``DynamicCache``.
    max_rows : int
        The most rows a step may have.
    block_size, num_blocks : int
        The paged KV cache's geometry.
    stream : Stream, int or ``__cuda_stream__`` object
        Where the forwards run, in order with the feed's kernels (the router passes its own).
    """

    def __init__(self, model: Any, *, max_rows: int = 8, block_size: int = 16, num_blocks: int = 256,
                 stream: Any = 0) -> None:
        config = model.config
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.init_paged_kv(block_size=block_size, num_blocks=num_blocks)
        self.init_device_feed(vocab=config.vocab_size, logits_dtype=self.dtype, max_rows=max_rows)
        self.stream = stream
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, num_blocks * block_size, heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=self.dtype)
        self.v_pages = torch.zeros(shape, dtype=self.dtype)
        # Written on the stream: the fed inputs by resolve_feed, the logits by the forward.
        self.ids = torch.zeros(max_rows, dtype=torch.int32)
        self.logits = torch.zeros(max_rows, config.vocab_size, dtype=self.dtype)
        self.forwards = 0
        # transformers renamed past_key_values to cache; take whichever this version has.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    # ---- KV bookkeeping: PagedKvMixin's (the scheduler reserves; the forward checks) ----

    # ---- the forward, run in stream order by launch_host_func ----

    def _slots(self, table: Sequence[int], start: int, count: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, start + count)],
                            dtype=torch.long)

    def _run(self, ids: Sequence[int], start: int, table: Sequence[int]) -> torch.Tensor:
        """The model over ``ids`` at positions ``start..``, the history read from the pages
        through ``table`` and the new keys and values written back; the logits of every
        position, ``[len(ids), vocab]``."""
        from transformers import DynamicCache

        cache = DynamicCache()
        if start:
            past = self._slots(table, 0, start)
            for layer in range(self.k_pages.shape[0]):
                cache.update(self.k_pages[layer, past].permute(1, 0, 2).unsqueeze(0),
                             self.v_pages[layer, past].permute(1, 0, 2).unsqueeze(0), layer)
        n = len(ids)
        out = self.model(input_ids=torch.tensor([list(ids)]),
                         position_ids=torch.arange(start, start + n).unsqueeze(0),
                         use_cache=True, **{self._cache_arg: cache})
        new = self._slots(table, start, n)
        for layer, entry in enumerate(cache.layers):  # the forward appended to the cache in place
            self.k_pages[layer, new] = entry.keys[0, :, start:start + n].permute(1, 0, 2)
            self.v_pages[layer, new] = entry.values[0, :, start:start + n].permute(1, 0, 2)
        return out.logits[0]

    def _forward(self, tokens: Optional[List[int]], positions: List[int], tables: List[List[int]]) -> None:
        with torch.no_grad():
            ids = tokens if tokens is not None else self.ids[: len(positions)].tolist()
            for r, (token, position, table) in enumerate(zip(ids, positions, tables)):
                self.logits[r].copy_(self._run([token], position, table)[-1])
        self.forwards += 1

    def _prefill(self, ids: List[int], start: int, table: List[int]) -> None:
        with torch.no_grad():
            self._run(ids, start, table)

    def _launch(self, tokens: Optional[List[int]], seqs: Sequence[SequenceState], stream: Any) -> torch.Tensor:
        positions = [seq.seq_len for seq in seqs]
        tables = [list(seq.block_table) for seq in seqs]  # as reserved now, not as later edited
        mf.launch_host_func(stream, self._forward, tokens, positions, tables)
        return self.logits[: len(seqs)]

    def _check(self, n: int, seqs: Sequence[SequenceState]) -> None:
        if self.feed_cells is None:
            raise FeedError("the model is closed")
        if n != len(seqs) or not 1 <= n <= self.feed_max_rows:
            raise ValueError(f"{n} inputs for {len(seqs)} rows (at most {self.feed_max_rows})")

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState], stream: Any = None) -> Any:
        """A step whose inputs the host knows: pushes them and advances ``seq_len``."""
        stream = self.stream if stream is None else stream
        self._check(len(tokens), seqs)
        tokens = [int(t) for t in tokens]
        self.cover_decode_blocks(seqs)  # called without a router: the blocks it lacks
        logits = self._launch(tokens, seqs, stream)
        for token, seq in zip(tokens, seqs):
            seq.tokens.append(token)
            seq.seq_len += 1
        return logits

    def decode_batch_fed(self, sources: Sequence[int], seqs: Sequence[SequenceState], stream: Any = None) -> Any:
        """A step whose inputs are read on the device: resolved from the feed cells into the
        ``ids`` tensor, then read by the forward, both in stream order."""
        stream = self.stream if stream is None else stream
        self._check(len(sources), seqs)
        self.check_decode_blocks(seqs)  # reserved by the scheduler: a refused step takes none
        mf.resolve_feed(sources, self.feed_cells, self.ids, stream, prev_rows=self.feed_prev_rows)
        return self._launch(None, seqs, stream)

    # ---- speculative decoding: the verify step (metrale_feed.contract.VerifyStep) ----

    def _verify(self, k: int, ids: torch.Tensor, advance: Optional[torch.Tensor],
                positions: List[int], tables: List[List[int]], logits: torch.Tensor) -> None:
        """Row ``r``'s ``k + 1`` ids (its input, then its drafts) in one forward at positions
        ``positions[r] (+ advance[r])..``; their logits to rows ``r * (k + 1)..``."""
        vocab = logits.shape[1]
        with torch.no_grad():
            # A draft of NO_TOKEN (-1 as int32) ends a row's drafts: the verify rule reads no
            # logit after it, but the forward still needs an id there to embed.
            fed = torch.where((ids >= 0) & (ids < vocab), ids, torch.zeros_like(ids)).tolist()
            steps = [0] * len(positions) if advance is None else advance.tolist()
            for r, (position, table) in enumerate(zip(positions, tables)):
                rows = slice(r * (k + 1), (r + 1) * (k + 1))
                logits[rows].copy_(self._run(fed[rows], position + steps[r], table))
        self.forwards += 1

    def decode_batch_verify(self, input_ids: Any, seqs: Sequence[SequenceState], k: int,
                            stream: Any = None, advance: Any = None) -> torch.Tensor:
        """A speculative step's forward over ``k + 1`` positions a row (docs/speculative.md).

        Row ``r`` reads its ids from the device array ``input_ids`` at ``r * (k + 1) + j`` and
        writes their keys and values at positions ``seq.seq_len + j`` (plus ``advance[r]``, a
        device uint32 a row, at depth 2: how far the step still in flight moved the row); logit
        row ``r * (k + 1) + j`` is the logits after that position. Both arrays are copied on
        the stream, so the forward reads what the pipeline wrote there before it, never the
        host's idea of them. ``seq_len`` and ``tokens`` are left as they are: the pipeline
        advances them by the accepted count once it is read.
        """
        stream = self.stream if stream is None else stream
        if self.feed_cells is None:
            raise FeedError("the model is closed")
        rows = len(seqs)
        if k < 1 or not 1 <= rows <= self.feed_max_rows:
            raise ValueError(f"a verify step takes 1 to {self.feed_max_rows} rows and k >= 1, "
                             f"got {rows} rows and k={k}")
        self.check_verify_blocks(seqs, k, advance is not None)
        n = rows * (k + 1)
        # Fresh tensors each step, so no step's work can read another's; each lives until the
        # work queued on it has run (the package and the queued host function hold it).
        ids = torch.empty(n, dtype=torch.int32)
        mf.copy_d2d_async(ids, input_ids, 4 * n, stream)
        steps = None
        if advance is not None:
            steps = torch.empty(rows, dtype=torch.int32)
            mf.copy_d2d_async(steps, advance, 4 * rows, stream)
        logits = torch.empty(n, self.logits.shape[1], dtype=self.dtype)
        tables = [list(seq.block_table) for seq in seqs]  # as reserved now, not as later trimmed
        mf.launch_host_func(stream, self._verify, k, ids, steps, [seq.seq_len for seq in seqs],
                            tables, logits)
        return logits

    def prefill(self, seq: SequenceState, ids: Sequence[int], stream: Any = None) -> None:
        """Write ``ids``' keys and values at positions ``seq_len..``; no logits."""
        stream = self.stream if stream is None else stream
        ids = [int(i) for i in ids]
        if not ids:
            return
        self.take_prefill_blocks([seq], [ids])
        mf.launch_host_func(stream, self._prefill, ids, seq.seq_len, list(seq.block_table))
        seq.tokens.extend(ids)
        seq.seq_len += len(ids)

    def close(self) -> None:
        mf.stream_synchronize(self.stream)
        self.close_device_feed()


def greedy(model: Any, prompts: Sequence[Sequence[int]], max_new: int, bans: Sequence[Any],
           *, router: str = "async", host_work_us: float = 0.0) -> dict:
    """Greedy tokens of each prompt through the feed (``router``: "async" or "sync"); ``bans``
    holds a (a, b) RowMask per prompt (``NO_TOKEN`` unused)."""
    from metrale_feed.tools.demo import run_async, run_sync

    feed = HfLlamaFeed(model, max_rows=len(prompts))
    requests = [{"prompt": list(p), "mask": tuple(b), "stop": NO_TOKEN} for p, b in zip(prompts, bans)]
    try:
        run = run_async if router == "async" else run_sync
        return run(feed, requests, max_new, host_work_us, work_kind="spin")  # type: ignore[arg-type]
    finally:
        feed.close()


def pipeline_greedy(model: Any, prompts: Sequence[Sequence[int]], max_new: int, *,
                    depth: int = 2, speculative: Optional[str] = None, k: int = 4,
                    repetition_penalty: Any = 1.0, block_size: int = 16,
                    num_blocks: int = 256) -> dict:
    """Greedy tokens of each prompt through ``DecodePipeline`` (docs/pipeline.md).

    ``speculative="ngram"`` decodes with the n-gram (prompt lookup) drafter, ``k`` drafts a row
    a step, verified by ``HfLlamaFeed.decode_batch_verify`` (docs/speculative.md).
    ``repetition_penalty`` is one value for every prompt or one a prompt (1.0: none), with or
    without speculation (each verified position judged with the drafts before it). Returns
    ``{"tokens": [...], "stats": ...}``, the tokens in the prompts' order and the pipeline's
    counters.
    """
    from metrale_feed.sched.speculative import NGramDrafter

    if speculative not in (None, "ngram"):
        raise ValueError(f"speculative must be None or 'ngram', got {speculative!r}")
    penalties = (list(repetition_penalty) if isinstance(repetition_penalty, (list, tuple))
                 else [repetition_penalty] * len(prompts))
    drafter = NGramDrafter(k) if speculative == "ngram" else None
    feed = HfLlamaFeed(model, max_rows=len(prompts), block_size=block_size, num_blocks=num_blocks)
    try:
        with mf.DecodePipeline(feed, len(prompts), depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=max_new, repetition_penalty=rp)
                    for p, rp in zip(prompts, penalties)]
            pipe.run()
            stats = pipe.stats.as_dict()
    finally:
        feed.close()
    for req in reqs:
        if req.finish_reason != "length":
            raise FeedError(f"{req!r} finished with {req.finish_reason!r}: {req.error}")
    return {"tokens": [list(req.tokens) for req in reqs], "stats": stats}


def hf_greedy(model: Any, prompt: Sequence[int], max_new: int, ban: Any = (NO_TOKEN, NO_TOKEN),
              *, repetition_penalty: float = 1.0) -> List[int]:
    """What transformers' own greedy generate gives, with the same two ids banned and the same
    repetition penalty (transformers', over the prompt and the generated ids)."""
    bad = [[t] for t in ban if t != NO_TOKEN] or None
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=max_new,
                             min_new_tokens=max_new, bad_words_ids=bad, pad_token_id=0,
                             repetition_penalty=float(repetition_penalty),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


# ---- structured outputs: a JSON schema's automaton over a tokenizer built here ----

EOS = "</s>"  # the tokenizer's end-of-sequence token, id 0

#: What the tokenizer's merges are learnt from: English and JSON, so that both are a few ids a word.
CORPUS = [
    'A user record as JSON: {"name": "Ada Lovelace", "age": 36, "color": "green", "admin": true}',
    '{"name": "Alan", "age": 41, "color": "blue", "admin": false, "tags": ["a", "b"]}',
    '{"name":"Grace","age":85,"color":"red","admin":true,"tags":["c"]}',
    "Write the record of the next user of the system, then stop.",
    "The quick brown fox jumps over the lazy dog; names, ages and colors of users.",
]


def local_tokenizer(vocab: int = 256) -> Any:
    """A byte-pair tokenizer of at most ``vocab`` tokens, trained on ``CORPUS`` (deterministic,
    nothing downloaded): the end-of-sequence token ``EOS`` is id 0, then the printable ASCII
    characters, then the merges. Tokens are plain text (no pre-tokenizer, a fusing decoder), so a
    token's text is what it adds to the output."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.decoder = decoders.Fuse()
    printable = [chr(c) for c in range(32, 127)]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], initial_alphabet=printable,
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


def outlines_vocabulary(tokenizer: Any) -> Any:
    """The ``outlines_core.Vocabulary`` of ``tokenizer``'s tokens: each token's text to its id,
    its end-of-sequence id apart."""
    from outlines_core import Vocabulary

    eos = tokenizer.eos_token_id
    tokens = {text: [i] for text, i in tokenizer.get_vocab().items() if i != eos}
    return Vocabulary(eos, tokens)


def longest_output(automaton: Any) -> int:
    """The most ids an output of ``automaton`` can have (its longest path from the initial state
    to a state with no outgoing transition). Raises ValueError when it has a cycle: then nothing
    bounds an output, and no ``max_new_tokens`` ends every request."""
    longest: Dict[int, int] = {}  # a state's longest path to the end, once its successors' are known
    on_path: set = set()  # the states whose successors are being explored: one reached again is a cycle
    stack: List[Tuple[int, Optional[List[int]]]] = [(automaton.initial, None)]
    while stack:  # depth first, without recursion (a schema's automaton has hundreds of states)
        state, nexts = stack.pop()
        if nexts is not None:  # its successors are done
            longest[state] = max((1 + longest[n] for n in nexts), default=0)
            on_path.discard(state)
            continue
        if state in longest:
            continue
        if state in on_path:
            raise ValueError("the automaton has a cycle: bound the schema's strings (maxLength), "
                             "numbers (enum) and arrays (maxItems)")
        on_path.add(state)
        nexts = sorted({automaton.next(state, t) for t in automaton.allowed(state)})
        stack.append((state, nexts))
        stack.extend((n, None) for n in nexts if n not in longest)
    return longest[automaton.initial]


def json_automaton(schema: Any, tokenizer: Any, vocab: int) -> Any:
    """The ``TokenAutomaton`` of ``schema`` (a mapping) over ``tokenizer``'s tokens, ``vocab``
    (the model's logits' width) ids wide."""
    return mf.TokenAutomaton.from_json_schema(schema, outlines_vocabulary(tokenizer), vocab=vocab)


def pipeline_json(model: Any, automaton: Any, prompts: Sequence[Sequence[int]], max_new: int, *,
                  depth: int = 2, speculative: Optional[str] = None, k: int = 4,
                  block_size: int = 16, num_blocks: int = 256) -> dict:
    """Greedy tokens of each prompt through ``DecodePipeline`` with ``grammar=automaton`` (plain
    or with the n-gram drafter, as ``pipeline_greedy``). Returns ``{"tokens": [...], "finish":
    [...], "stats": ...}``: each request's tokens (its end-of-sequence id last when it ended so),
    its finish reason and the pipeline's counters."""
    from metrale_feed.sched.speculative import NGramDrafter

    drafter = NGramDrafter(k) if speculative == "ngram" else None
    feed = HfLlamaFeed(model, max_rows=len(prompts), block_size=block_size, num_blocks=num_blocks)
    try:
        with mf.DecodePipeline(feed, len(prompts), depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=max_new, grammar=automaton) for p in prompts]
            pipe.run()
            stats = pipe.stats.as_dict()
    finally:
        automaton.close()
        feed.close()
    return {"tokens": [list(r.tokens) for r in reqs], "finish": [r.finish_reason for r in reqs],
            "stats": stats}


def json_text(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The output's text: its tokens decoded, the end-of-sequence id that ended it left out."""
    ids = list(tokens)
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids.pop()
    text: str = tokenizer.decode(ids)
    return text


def _json_schema(model: Any, args: Any) -> None:
    """Structured outputs: ``args.json_schema``'s automaton on every request."""
    with open(args.json_schema) as f:
        schema = json.load(f)
    tokenizer = local_tokenizer(model.config.vocab_size)
    automaton = json_automaton(schema, tokenizer, model.config.vocab_size)
    max_new = longest_output(automaton)
    prompts = [tokenizer.encode(text) for text in (
        "A user record as JSON:", "Write the record of the next user:", "{",
        "The quick brown fox")]
    speculative = None if args.speculative == "none" else args.speculative
    start = time.perf_counter()
    result = pipeline_json(model, automaton, prompts, max_new, depth=args.depth,
                           speculative=speculative, k=args.k)
    seconds = time.perf_counter() - start
    stats = result["stats"]
    line = (f"pipeline depth {args.depth}, JSON schema {args.json_schema} ({automaton.num_states} "
            f"states, {automaton.nbytes} device bytes, max_new_tokens {max_new}): "
            f"{stats['steps']} steps, {sum(map(len, result['tokens'])) / seconds:7.1f} tok/s, "
            f"{stats['host_syncs'] / max(stats['steps'], 1):.2f} host syncs a step")
    if speculative:
        line += f"; k={args.k}: {stats['accepted']} of {stats['drafted']} drafts accepted"
    print(line)
    for tokens, finish in zip(result["tokens"], result["finish"]):
        text = json_text(tokenizer, tokens)
        assert finish == "stop" and tokens[-1] == tokenizer.eos_token_id, (finish, text)
        json.loads(text)
        print(f"  {len(tokens):3d} tokens: {text}")
    print("every output is JSON and ended with the end-of-sequence id")


def _routers(model: Any, prompts: List[List[int]], max_new: int) -> None:
    """The async and sync routers side by side, with bans."""
    bans = [(NO_TOKEN, NO_TOKEN), (3, NO_TOKEN), (NO_TOKEN, NO_TOKEN), (10, 11)]
    for router in ("sync", "async"):
        start = time.perf_counter()
        result = greedy(model, prompts, max_new, bans, router=router)
        tokens = sum(len(t) for t in result["tokens"])
        print(f"{router:5s}: {tokens / (time.perf_counter() - start):7.1f} tok/s")
    for prompt, ban, got in zip(prompts, bans, result["tokens"]):
        assert got == hf_greedy(model, prompt, max_new, ban), (prompt, got)


def _pipeline(model: Any, prompts: List[List[int]], max_new: int, args: Any) -> None:
    """``DecodePipeline`` with the options given: the n-gram drafter or a repetition penalty."""
    speculative = None if args.speculative == "none" else args.speculative
    start = time.perf_counter()
    result = pipeline_greedy(model, prompts, max_new, depth=args.depth, speculative=speculative,
                             k=args.k, repetition_penalty=args.repetition_penalty)
    seconds = time.perf_counter() - start
    stats = result["stats"]
    line = f"pipeline depth {args.depth}: {stats['steps']} steps, " \
           f"{sum(map(len, result['tokens'])) / seconds:7.1f} tok/s"
    if speculative:
        line += f"; k={args.k}: {stats['accepted']} of {stats['drafted']} drafts accepted"
    print(line)
    for prompt, got in zip(prompts, result["tokens"]):
        expect = hf_greedy(model, prompt, max_new, repetition_penalty=args.repetition_penalty)
        assert got == expect, (prompt, got, expect)


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="A random-weight transformers Llama through the feed; its greedy tokens are "
                    "checked against transformers' generate(do_sample=False). Without options: "
                    "the async and sync routers side by side. With --speculative or "
                    "--repetition-penalty: DecodePipeline with them.")
    parser.add_argument("--speculative", choices=("none", "ngram"), default="none",
                        help="speculative decoding with the n-gram (prompt lookup) drafter")
    parser.add_argument("--k", type=int, default=4, help="drafts a row a step (default 4)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="vLLM's and transformers' repetition penalty (default 1.0: none)")
    parser.add_argument("--depth", type=int, choices=(1, 2), default=2,
                        help="the pipeline's steps in flight (default 2)")
    parser.add_argument("--max-new", type=int, default=16, help="tokens a prompt (default 16)")
    parser.add_argument("--json-schema", metavar="FILE", default=None,
                        help="serve JSON outputs of this schema (a TokenAutomaton built with "
                             "outlines-core on every request); it must bound its strings, numbers "
                             "and arrays, e.g. examples/user.schema.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    mf.host_kernel_threads(1)
    model = small_llama()
    if args.json_schema:
        _json_schema(model, args)
        return
    # The random model soon repeats itself, so the n-gram drafter finds drafts it accepts.
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 5, 5, 5], [42, 17]]
    if args.speculative == "none" and args.repetition_penalty == 1.0:
        _routers(model, prompts, args.max_new)
    else:
        _pipeline(model, prompts, args.max_new, args)
    print("tokens equal transformers' greedy generate for every prompt")


if __name__ == "__main__":
    main()
