"""Structured outputs from a real model (examples/hf_llama.py ``--json-schema``): a transformers
Llama served through ``DecodePipeline`` with a JSON schema's ``TokenAutomaton`` over a tokenizer
built locally. Every output must parse as JSON, validate against the schema (``jsonschema``) and
end with the end-of-sequence id within ``max_new_tokens``; its greedy tokens must equal
transformers' own ``generate`` loop whose logits a processor masks by the outlines-core index's
``get_allowed_tokens``, advanced by ``get_next_state`` (the index built here, from the schema's
regex and the tokenizer's vocabulary). Plain and speculative, depth 1 and 2, with preemption by
recompute. Skipped cleanly without torch, transformers or outlines-core."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
outlines_core = pytest.importorskip("outlines_core")

import metrale_feed as mf  # noqa: E402

from helpers.modules import load_file  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_llama.py"
SCHEMA = ROOT / "examples" / "user.schema.json"
PROMPTS = ["A user record as JSON:", "Write the record of the next user:", "{", "The quick brown fox",
           "names, ages"]


def _example():
    return load_file("hf_llama_json", EXAMPLE)


def outlines_generate(model, index, prompt, max_new, eos):
    """Greedy ids of ``prompt`` by transformers' ``generate``, each step's logits masked to the
    ids ``index.get_allowed_tokens`` gives for the state ``get_next_state`` reached by the ids
    generated so far; it stops after ``eos``."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Mask(LogitsProcessor):
        def __init__(self):
            self.state, self.seen = index.get_initial_state(), len(prompt)

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > self.seen:  # the id generated last step
                self.state = index.get_next_state(self.state, int(input_ids[0, -1]))
                self.seen = input_ids.shape[1]
            allowed = torch.tensor(index.get_allowed_tokens(self.state), dtype=torch.long)
            out = torch.full_like(scores, float("-inf"))
            out[:, allowed] = scores[:, allowed]
            return out

    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=eos,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             logits_processor=LogitsProcessorList([Mask()]))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def served():
    """The example, its float32 model, tokenizer, schema, automaton builder and bound, the
    prompts' ids and the reference loop's tokens of each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = _example()
    model = hf.small_llama(torch.float32)
    tokenizer = hf.local_tokenizer(model.config.vocab_size)
    schema = json.loads(SCHEMA.read_text())
    eos = tokenizer.eos_token_id
    vocabulary = outlines_core.Vocabulary(
        eos, {text: [i] for text, i in tokenizer.get_vocab().items() if i != eos})
    index = outlines_core.Index(
        outlines_core.json_schema.build_regex_from_schema(json.dumps(schema)), vocabulary)
    max_new = hf.longest_output(hf.json_automaton(schema, tokenizer, model.config.vocab_size))
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    expect = [outlines_generate(model, index, p, max_new, eos) for p in prompts]
    yield dict(hf=hf, model=model, tokenizer=tokenizer, schema=schema, max_new=max_new,
               prompts=prompts, expect=expect, eos=eos)
    torch.set_num_threads(before)


def check_outputs(served, tokens, finish):
    """Each output ends with eos within max_new_tokens, finished "stop", and parses as JSON;
    returns the parsed outputs."""
    hf, tokenizer = served["hf"], served["tokenizer"]
    parsed = []
    for ids, reason in zip(tokens, finish):
        assert reason == "stop" and ids[-1] == served["eos"] and len(ids) <= served["max_new"]
        assert served["eos"] not in ids[:-1]
        text = hf.json_text(tokenizer, ids)
        assert text == "".join(tokenizer.convert_ids_to_tokens(ids[:-1]))  # the tokens' own text
        parsed.append(json.loads(text))
    return parsed


def test_the_reference_is_constrained_and_bounded(served):
    # Not vacuous: the reference loop ends every output with eos inside the bound, and its
    # outputs are JSON, unlike the model's free greedy tokens.
    check_outputs(served, served["expect"], ["stop"] * len(served["expect"]))
    hf, model = served["hf"], served["model"]
    free = [hf.hf_greedy(model, p, 12) for p in served["prompts"]]
    assert all(f != e[:12] for f, e in zip(free, served["expect"]))


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("blocks", [64, 18])
def test_json_outputs_equal_the_outlines_masked_generate(served, depth, speculative, blocks):
    hf = served["hf"]
    automaton = hf.json_automaton(served["schema"], served["tokenizer"], served["model"].config.vocab_size)
    got = hf.pipeline_json(served["model"], automaton, served["prompts"], served["max_new"],
                           depth=depth, speculative=speculative, k=3, block_size=8,
                           num_blocks=blocks)
    assert got["tokens"] == served["expect"]
    check_outputs(served, got["tokens"], got["finish"])
    stats = got["stats"]
    if speculative:
        assert stats["accepted"] > 0  # drafts were judged against the states the ones before reach
    assert (stats["preemptions"] > 0) == (blocks < 64)  # resumed rows rebuilt their state
    if depth == 2:
        assert stats["host_syncs"] == stats["steps"]


def test_outputs_validate_against_the_schema(served):
    jsonschema = pytest.importorskip("jsonschema")
    hf = served["hf"]
    automaton = hf.json_automaton(served["schema"], served["tokenizer"], served["model"].config.vocab_size)
    got = hf.pipeline_json(served["model"], automaton, served["prompts"], served["max_new"],
                           speculative="ngram", k=3)
    assert got["tokens"] == served["expect"]
    outputs = check_outputs(served, got["tokens"], got["finish"])
    for value in outputs:
        jsonschema.validate(value, served["schema"])
    # The validator is not vacuous: it refuses what the schema's bounds exclude.
    for bad in (dict(outputs[0], name="x" * 13), dict(outputs[0], age=8), {"name": "x"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, served["schema"])


def test_longest_output_is_the_longest_path_and_refuses_a_cycle(served):
    hf = served["hf"]
    chain = mf.TokenAutomaton({0: {1: 1, 2: 2}, 1: {3: 2, 5: 4}, 2: {4: 3}, 3: {}, 4: {}},
                              initial=0, vocab=8)
    assert hf.longest_output(chain) == 3  # 1, 3, 4
    assert hf.longest_output(mf.TokenAutomaton({0: {}}, initial=0, vocab=2)) == 0
    loop = mf.TokenAutomaton({0: {1: 1}, 1: {2: 0, 3: 2}, 2: {}}, initial=0, vocab=4)
    with pytest.raises(ValueError, match="cycle"):
        hf.longest_output(loop)
    unbounded = dict(served["schema"], properties={"name": {"type": "string"}}, required=["name"])
    with pytest.raises(ValueError, match="maxLength"):
        hf.longest_output(hf.json_automaton(unbounded, served["tokenizer"], 256))


@pytest.mark.parametrize("args", [[], ["--depth", "1"], ["--speculative", "ngram", "--k", "4"],
                                  ["--speculative", "ngram", "--k", "2", "--depth", "1"]])
def test_the_example_serves_its_schema(served, capsys, args):
    threads = mf.host_kernel_threads()
    try:
        served["hf"].main(["--json-schema", str(SCHEMA)] + args)
    finally:
        mf.host_kernel_threads(threads)
        torch.set_num_threads(1)
    out = capsys.readouterr().out
    assert "every output is JSON and ended with the end-of-sequence id" in out
    syncs = float(out.split(" host syncs a step")[0].rsplit(" ", 1)[1])
    assert syncs == 1.0  # the grammar adds no wait: one a step, the step's own read
    assert ("drafts accepted" in out) == ("--speculative" in args)
    texts = [line.split("tokens: ", 1)[1] for line in out.splitlines() if "tokens: " in line]
    assert len(texts) == 4 and all(isinstance(json.loads(t), dict) for t in texts)
