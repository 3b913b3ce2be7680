"""Structured output on the tiny random Llama (seconds): every emitted output is in the constraint's
language (regex, choice, EBNF and Lark grammars, JSON schema), with sampling, chunked prefill, prefix
caching, preemption, ``n > 1``, stop strings and ``max_tokens``; unconstrained requests in the same
batch are unchanged; compilation runs off the step loop; bad constraints are refused by name."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer  # noqa: E402

from segserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from segserve.structured_output.grammar import build_grammar  # noqa: E402
from segserve.worker.grammar_mask import GrammarBitmask, apply_grammar_bitmask  # noqa: E402

ENGINE = dict(block_size=4, num_kv_blocks=257, max_num_batched_tokens=256, max_num_seqs=32, max_model_len=128)
PROMPTS = ["The quick brown", "Paged attention keeps", "fox", "chunked prefill splits a long prompt into"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0,
                                                                      "maximum": 99}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from segserve.models.loader import load_model

    path = tmp_path_factory.mktemp("tiny_so")
    save_tiny_hf_dir(path, tiny_hf_model(), train_tiny_tokenizer())
    return load_model(str(path))


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, **ENGINE)


def sampled(so: StructuredOutputsParams, max_tokens: int = 60, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def texts(outs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def run_seeds(llm, so, seeds=range(12), **kw) -> list[tuple[str, str]]:
    params = [sampled(so, seed=s, **kw) for s in seeds]
    return texts(llm.generate([PROMPTS[s % len(PROMPTS)] for s in seeds], params, use_tqdm=False))


def test_regex_output_matches_exactly(llm):
    outs = run_seeds(llm, StructuredOutputsParams(regex=r"[ab]{2}-\d{1,2}"))
    assert all(reason == "stop" for _, reason in outs)
    assert all(re.fullmatch(r"[ab]{2}-\d{1,2}", text) for text, _ in outs), outs
    assert len({t for t, _ in outs}) >= 3  # sampling explores the language, not one forced string
    llm.llm_engine.check_integrity()


def test_choice_output_is_one_of_them(llm):
    choices = ["yes", "no", 'say "hi"\n', "ünï"]
    outs = run_seeds(llm, StructuredOutputsParams(choice=choices), seeds=range(24))
    assert {t for t, _ in outs} <= set(choices) and len({t for t, _ in outs}) >= 2, outs
    assert all(reason == "stop" for _, reason in outs)


@pytest.mark.parametrize("grammar", [
    'root ::= "(" root ")" | "x" | "y"',  # EBNF
    'start: "(" start ")" | "x" | "y"',  # Lark
])
def test_small_grammar_output_is_in_its_language(llm, grammar):
    outs = run_seeds(llm, StructuredOutputsParams(grammar=grammar), max_tokens=40)
    for text, reason in outs:
        depth = len(text) - len(text.lstrip("("))
        if reason == "stop":
            assert text == "(" * depth + text[depth] + ")" * depth and text[depth] in "xy", text
        else:  # cut by max_tokens: still a prefix of a sentence
            assert reason == "length" and set(text) == {"("}, text
    assert any(reason == "stop" for _, reason in outs)


def test_json_schema_outputs_validate(llm):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = run_seeds(llm, so, max_tokens=80)
    done = [json.loads(t) for t, r in outs if r == "stop"]
    assert len(done) >= 6, outs
    for value in done:
        jsonschema.validate(value, SCHEMA)


def test_json_object_gives_an_object(llm):
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outs = run_seeds(llm, so, max_tokens=80)
    done = [json.loads(t) for t, r in outs if r == "stop"]
    assert done and all(isinstance(v, dict) for v in done), outs


def _prefix_ok(llm, so: StructuredOutputsParams, token_ids: list[int]) -> tuple[bool, bool]:
    """(every token accepted by a fresh matcher, grammar complete after them)."""
    manager = llm.llm_engine.grammar_gate.manager
    matcher = xgr.GrammarMatcher(manager.submit(so).result())
    ok = all(matcher.accept_token(t) for t in token_ids)
    return ok, matcher.is_completed()


def test_max_tokens_mid_object_is_length_and_a_valid_prefix(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(PROMPTS, [sampled(so, max_tokens=5, seed=s) for s in range(4)], use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        assert _prefix_ok(llm, so, c.token_ids) == (True, False)


def greedy(so=None, max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def test_unconstrained_requests_in_the_batch_are_unchanged(llm):
    alone = llm.generate(PROMPTS, greedy(ignore_eos=True), use_tqdm=False)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    mixed_params = [greedy(ignore_eos=True), greedy(so), greedy(ignore_eos=True), greedy(so)] * 4
    mixed = llm.generate(PROMPTS * 4, mixed_params, use_tqdm=False)  # 16 in one batch
    for i, out in enumerate(mixed):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == alone[i % 4].outputs[0].token_ids
        else:
            assert _prefix_ok(llm, so, out.outputs[0].token_ids)[0]


def test_chunking_prefix_cache_and_preemption_keep_constrained_greedy_output(loaded):
    so = StructuredOutputsParams(regex=r"[a-z]{3,12}\.")
    params = [greedy(so, max_tokens=20), greedy(StructuredOutputsParams(json=SCHEMA), max_tokens=30)] * 2
    prompts = [p * 3 for p in PROMPTS]
    reference = LLM(loaded, **ENGINE).generate(prompts, params, use_tqdm=False)
    # 5-token chunks; a pool so small that the four requests preempt each other.
    small = LLM(loaded, **{**ENGINE, "max_num_batched_tokens": 5, "num_kv_blocks": 30, "max_model_len": -1})
    cold = small.generate(prompts, params, use_tqdm=False)
    warm = small.generate(prompts, params, use_tqdm=False)
    stats = small.llm_engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and sum(o.num_cached_tokens for o in warm) > 0
    for runs in (cold, warm):
        assert [o.outputs[0].token_ids for o in runs] == [o.outputs[0].token_ids for o in reference]
    for out in reference[::2]:
        assert re.fullmatch(r"[a-z]{3,12}\.", out.outputs[0].text) or out.outputs[0].finish_reason == "length"
    small.llm_engine.check_integrity()
    assert not small.llm_engine.grammar_gate.manager.matchers  # finished requests leave no matcher


def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate("fox", sampled(StructuredOutputsParams(regex=r"[0-9]{4}"), n=6, seed=3),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 6 and all(re.fullmatch(r"[0-9]{4}", c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) >= 2


def test_stop_string_ends_a_constrained_output(llm):
    so = StructuredOutputsParams(regex=r"ab-cd-ef")
    out = llm.generate("fox", greedy(so, stop=["-e"]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab-cd", "stop", "-e")


def test_min_tokens_past_a_complete_grammar_lets_the_grammar_end_it(llm):
    """Regression: ``min_tokens`` forbade the EOS that a complete grammar allows alone, every logit was
    -inf and the sampler emitted token 0 outside the grammar. The grammar wins: the output is exactly
    the grammar's string, finished by EOS."""
    so = StructuredOutputsParams(regex=r"ab-cd")
    plain = llm.generate("fox", greedy(so), use_tqdm=False)[0].outputs[0]
    out = llm.generate("fox", greedy(so, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ab-cd", "stop")
    assert out.token_ids == plain.token_ids and 0 not in out.token_ids
    llm.llm_engine.check_integrity()


def test_same_constraint_compiles_once(llm):
    manager = llm.llm_engine.grammar_gate.manager
    so1 = StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "boolean"}}})
    so2 = StructuredOutputsParams(json=json.dumps(so1.json, indent=2))  # same schema as text
    before = manager.num_compiled
    llm.generate(["fox", "fox"], [greedy(so1), greedy(so2)], use_tqdm=False)
    assert manager.num_compiled == before + 1


def test_compilation_does_not_stall_other_requests(loaded, monkeypatch):
    llm = LLM(loaded, **ENGINE)
    engine = llm.llm_engine
    release = threading.Event()
    compiler = engine.grammar_gate.manager.compiler
    real = compiler.compile_grammar
    monkeypatch.setattr(compiler, "compile_grammar", lambda g: (release.wait(30), real(g))[1])
    engine.add_request("constrained", "fox", greedy(StructuredOutputsParams(regex="[xyz]{3}")))
    engine.add_request("free", "fox", greedy(max_tokens=6, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "constrained" in engine.grammar_gate and engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[xyz]{3}", finished["constrained"].outputs[0].text)
    assert len(finished["free"].outputs[0].token_ids) == 6


def test_abort_while_compiling_leaves_nothing(loaded, monkeypatch):
    llm = LLM(loaded, **ENGINE)
    engine = llm.llm_engine
    release = threading.Event()
    compiler = engine.grammar_gate.manager.compiler
    real = compiler.compile_grammar
    monkeypatch.setattr(compiler, "compile_grammar", lambda g: (release.wait(30), real(g))[1])
    engine.add_request("r", "fox", greedy(StructuredOutputsParams(regex="[xyz]{5}"), n=2))
    engine.abort_request("r")
    release.set()
    assert not engine.has_unfinished_requests() and not engine.grammar_gate.awaiting
    engine.check_integrity()


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("kwargs, message", [
    (dict(json={"type": "bogus"}), "structured_outputs.json is not a valid JSON schema at type"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "structured_outputs.json is invalid or unsupported"),
    (dict(regex="[a-"), "structured_outputs.regex is invalid or unsupported"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar is invalid or unsupported"),
    (dict(grammar="start: ("), "structured_outputs.grammar is invalid or unsupported"),
    # Regression (a new user's trial): Python's "maximum recursion depth exceeded" was the message.
    (dict(json=_nested_arrays(300)), "structured_outputs.json nests too deeply to check"),
])
def test_bad_constraint_is_refused_and_the_engine_keeps_serving(llm, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("fox", greedy(StructuredOutputsParams(**kwargs)), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.grammar_gate.awaiting
    out = llm.generate("fox", greedy(StructuredOutputsParams(choice=["ok"])), use_tqdm=False)[0]
    assert out.outputs[0].text == "ok"
    engine.check_integrity()


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of json, regex, choice, grammar, json_object must be set, got none"),
    (dict(regex="a", choice=["a"]), "got 2 (regex, choice)"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", 3]), "choice entries must be non-empty strings, got 3"),
    (dict(json_object=False), "json_object must be true when given"),
    (dict(json=5), "structured_outputs.json must be a JSON schema (dict or str), got int"),
])
def test_malformed_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_bitmask_sets_exactly_the_forbidden_logits_to_minus_inf():
    vocab = 70  # 3 words, the last one partial
    logits = torch.randn(4, vocab)
    before = logits.clone()
    allowed = {"d": [0, 31, 32, 69], "b": [5]}
    mask = torch.zeros(2, 3, dtype=torch.int32)
    for row, rid in enumerate(("d", "b")):  # bitmask rows in another order than the logits rows
        for t in allowed[rid]:
            mask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    apply_grammar_bitmask(logits, ["a", "b", "c", "d"], GrammarBitmask(("d", "b"), mask))
    for row, rid in ((3, "d"), (1, "b")):
        finite = torch.isfinite(logits[row]).nonzero().squeeze(1).tolist()
        assert finite == allowed[rid] and torch.equal(logits[row, finite], before[row, finite])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # unconstrained rows untouched



def test_failed_compilation_aborts_only_that_request(loaded, monkeypatch):
    llm = LLM(loaded, **ENGINE)
    engine = llm.llm_engine
    compiler = engine.grammar_gate.manager.compiler

    def broken(grammar):
        raise RuntimeError("out of memory while compiling")

    monkeypatch.setattr(compiler, "compile_grammar", broken)
    engine.add_request("bad", "fox", greedy(StructuredOutputsParams(regex="[xyz]{4}")))
    engine.add_request("free", "fox", greedy(max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["bad"].outputs[0].finish_reason == "abort" and finished["bad"].outputs[0].token_ids == []
    assert len(finished["free"].outputs[0].token_ids) == 3
    engine.check_integrity()


def test_a_constraint_no_output_satisfies_ends_with_error_and_the_engine_goes_on(llm):
    """A schema xgrammar compiles but no output satisfies ($ref cycle without a base case): the request
    ends with vLLM's "error" finish reason (it was "abort"), the others are served, nothing leaks."""
    bad = greedy(StructuredOutputsParams(json={"$ref": "#"}))
    out = llm.generate("fox", bad, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and len(out.token_ids) <= 1  # at most the token it rejected
    ok = llm.generate("fox", greedy(StructuredOutputsParams(choice=["ok"])), use_tqdm=False)[0]
    assert ok.outputs[0].text == "ok"
    llm.llm_engine.check_integrity()


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex="(["),
     "structured_outputs.regex is invalid or unsupported: Regex parsing error at position 3: Unclosed '['"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}),
     "structured_outputs.json is invalid or unsupported: Invalid range: minimum greater than maximum"),
    (dict(grammar="root ::= undefined_rule"),
     "structured_outputs.grammar is invalid or unsupported: EBNF parser error at line 1, column 10: "
     "Rule \"undefined_rule\" is not defined"),
])
def test_grammar_errors_carry_no_timestamp_or_source_path(kwargs, message):
    """A new user's trial: xgrammar's messages start with its log prefix, ``[18:42:50]
    /project/cpp/regex_converter.cc:83: ``, a time and a C++ source line of no use to a client."""
    with pytest.raises(ValueError) as info:
        build_grammar(StructuredOutputsParams(**kwargs))
    assert str(info.value) == message


@pytest.mark.parametrize("schema, message", [
    ({"not": {"type": "integer"}}, "uses `not` at (root)"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "uses `uniqueItems` at properties/a"),
    ({"type": "array", "contains": {"const": 7}}, "uses `contains` at (root)"),
    ({"if": {"type": "integer"}, "then": {"minimum": 10}}, "uses `if` at (root)"),
    ({"$defs": {"A": {"allOf": [{"type": "integer"}, {"minimum": 10}]}}, "$ref": "#/$defs/A"},
     "uses `allOf` with 2 schemas at $defs/A"),
])
def test_schema_keywords_the_grammar_does_not_enforce_are_refused(schema, message):
    """A new user's trial: ``{"not": {}}`` (which nothing satisfies) was accepted and generated "-0.03".
    xgrammar 0.2.8 compiles these keywords without enforcing them (each checked: a string that breaks
    the keyword matches its grammar), so the schema is refused rather than silently loosened."""
    with pytest.raises(ValueError) as info:
        build_grammar(StructuredOutputsParams(json=schema))
    assert str(info.value).startswith("structured_outputs.json " + message), str(info.value)
    assert "not enforced" in str(info.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}},  # names
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},  # a no-op
    {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "integer"}}},  # pydantic's one-entry allOf
    {"type": "integer", "multipleOf": 3},  # enforced by xgrammar
])
def test_schemas_without_unenforced_keywords_still_compile(schema):
    assert build_grammar(StructuredOutputsParams(json=schema)) is not None
