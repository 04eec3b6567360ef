"""Issue 27, findings 1-4: constraints compiled within a budget and off the engine thread, a bounded
index cache, errors that stay with their request, 400s for what the engine cannot honour.

The first tests are the compiler's own (no model); the last ones replay the attacks against a real
server on the real SmolLM2, checking that the attack is a 400 naming the bound (or, for the schemas
the grammar engine holds in a small grammar, a valid answer) while a concurrent
short request and /health are answered promptly, and that the server's memory stays put.
"""
import asyncio
import json
import threading
import time

import httpx
import jsonschema
import numpy as np
import pytest

from minillm.generation.constrained import (CompileBudget, ConstraintTooLarge, Guide, JsonGrammar, min_tokens_problem,
                                            schema_to_regex, token_index)
from minillm.generation.constrained import automata
from minillm.generation.constrained.automata import byte_dfa, compile_dfa
from minillm.generation.constrained.token_index import TokenIndex, TokenIndexCache
from minillm.generation.sampling import Sampler, SamplingParams, SamplingState
from minillm.generation.tokenizer import BYTE_TO_SYMBOL, Tokenizer
from minillm.llm import LLM
from minillm.serve.app import BackgroundServer, llm_app
from minillm.serve.config import ServerConfig

REPEATS = "(?:(?:a{1000}){1000}){2}"       # 24 characters standing for two million
PRINTABLE = "[ -~]{0,1000}"               # a thousand states that each allow most of the vocabulary


def nested_arrays(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def ref_chain(depth: int) -> dict:
    """depth $defs, each either of two references to the next: 2^depth paths to the last one."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(depth)}
    return {"$defs": {**defs, f"d{depth}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def refused(bound: str, build) -> ConstraintTooLarge:
    with pytest.raises(ValueError) as error:
        build()
    assert bound in str(error.value), error.value
    return error.value


# -----------------------------------------------------------------------------------------------
# Finding 1: every stage within the budget


def test_counted_repeats_are_refused_by_counting_before_any_nfa(monkeypatch):
    def no_nfa(*args):
        raise AssertionError("an NFA was built")

    monkeypatch.setattr(automata, "thompson", no_nfa)
    error = refused("expanded_length", lambda: byte_dfa(REPEATS))
    assert isinstance(error, ConstraintTooLarge) and error.bound == "expanded_length"
    refused("expanded_length", lambda: SamplingParams(guided_regex=REPEATS))   # when the request is read


def test_schemas_whose_regex_doubles_are_refused_while_it_is_written():
    # The regex path (tool calls still take it) refuses them as the regex grows ...
    for schema in (nested_arrays(16), ref_chain(16)):
        error = refused("regex_length", lambda: schema_to_regex(schema))
        assert "the schema at " in str(error)           # where it grew past the bound
    # ... while guided_json compiles them to a grammar, whose size does not double per level
    for schema in (nested_arrays(16), ref_chain(16)):
        start = time.process_time()
        assert isinstance(SamplingParams(guided_json=schema).guided_pattern, JsonGrammar)
        assert time.process_time() - start < 1.0


def test_nfa_dfa_and_nesting_bounds():
    def budget(**limits) -> CompileBudget:
        return CompileBudget(limits={**CompileBudget().limits, **limits})

    refused("nfa_states", lambda: byte_dfa("[a-z]{900}", budget(nfa_states=1000)))   # ~1,800 states
    refused("dfa_states", lambda: byte_dfa("(?:a|b)*a(?:a|b){12}", budget(dfa_states=1000)))   # 2^13 subsets
    refused("nesting_depth", lambda: SamplingParams(guided_regex="(" * 5000 + ")" * 5000))   # not a RecursionError
    assert byte_dfa("(?:a|b)*a(?:a|b){3}").fullmatch(b"abab")


def test_the_cpu_time_bound():
    instant = CompileBudget(limits={**CompileBudget().limits, "seconds": 0.0})
    refused("seconds", lambda: byte_dfa("(?:a|b)*a(?:a|b){8}", instant))


def tiny_vocabulary() -> Tokenizer:
    symbols = [BYTE_TO_SYMBOL[b] for b in range(256)] + ["ab", "abc", "<|end|>"]
    eos = len(symbols) - 1
    return Tokenizer(symbols, [], [r"\S+|\s+"], added_ids=[eos], special_ids=[eos], eos_id=eos)


def test_the_token_index_walk_stops_at_its_byte_bound():
    tokenizer, dfa = tiny_vocabulary(), byte_dfa("[ -~]{0,50}")
    full = TokenIndex(dfa, tokenizer)                         # 51 states x ~97 tokens
    limit = full.nbytes // 2
    refused("token_index_bytes", lambda: TokenIndex(dfa, tokenizer,
                                                    CompileBudget(limits={**CompileBudget().limits,
                                                                          "token_index_bytes": limit})))
    roomy = TokenIndex(dfa, tokenizer, CompileBudget(limits={**CompileBudget().limits,
                                                             "token_index_bytes": full.nbytes}))
    for state in range(dfa.num_states):                     # built in pieces, the same index
        assert np.array_equal(roomy.allowed(state), full.allowed(state))


# -----------------------------------------------------------------------------------------------
# Finding 2: the index cache is bounded in bytes


def test_the_index_cache_is_bounded_in_bytes_least_recently_used_out():
    tokenizer = tiny_vocabulary()
    sizes = {p: TokenIndex(byte_dfa(p), tokenizer).nbytes for p in ("a{1,40}", "b{1,40}", "c{1,40}")}
    cache = TokenIndexCache(max_bytes=sizes["a{1,40}"] + sizes["b{1,40}"])
    first = cache("a{1,40}", tokenizer)
    cache("b{1,40}", tokenizer)
    assert cache("a{1,40}", tokenizer) is first              # a hit, and now the most recently used
    cache("c{1,40}", tokenizer)                              # over the bound: b goes, a stays
    assert [key[0] for key in cache.entries] == ["a{1,40}", "c{1,40}"]   # (pattern, tokenizer, builders)
    assert cache.nbytes == sizes["a{1,40}"] + sizes["c{1,40}"] <= cache.max_bytes
    assert isinstance(token_index, TokenIndexCache)          # the one the engine uses is bounded too


# -----------------------------------------------------------------------------------------------
# Findings 3 and 4: what cannot be honoured is refused at admission, or ends its sequence alone


def test_min_tokens_beyond_the_longest_text_is_decided_at_admission():
    tokenizer = tiny_vocabulary()
    yes = token_index("yes|no", tokenizer)
    assert yes.longest_text == 3 and token_index("é", tokenizer).longest_text == 2   # bytes
    assert token_index("a*", tokenizer).longest_text is None
    assert "min_tokens = 10" in min_tokens_problem(yes, 10, room=100)
    assert min_tokens_problem(yes, 3, room=100) is None      # "y" "e" "s": three tokens may do
    assert min_tokens_problem(yes, 10, room=3) is None       # the length limit ends it first
    assert min_tokens_problem(token_index("a*", tokenizer), 10**6, room=10**7) is None


def test_a_row_left_without_a_token_is_flagged_and_the_others_are_sampled_as_alone():
    tokenizer = tiny_vocabulary()
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, tokenizer.vocab_size))
    stuck = SamplingState(SamplingParams(guided_choice=["a"], min_tokens=5, temperature=0.0),
                          guide=Guide(token_index("a", tokenizer)))
    stuck.guide.advance(ord("a"))                            # complete: only EOS is left, and min_tokens masks it
    others = [SamplingState(SamplingParams(temperature=0.7, seed=1)), SamplingState(SamplingParams(temperature=0.0))]
    sampler = Sampler(eos_token_ids=[tokenizer.eos_id])
    drawn = sampler.sample(logits, [others[0], stuck, others[1]])
    assert list(drawn.errors) == [1] and "min_tokens = 5" in drawn.errors[1]
    alone = Sampler(eos_token_ids=[tokenizer.eos_id]).sample(
        logits[[0, 2]], [SamplingState(SamplingParams(temperature=0.7, seed=1)),
                         SamplingState(SamplingParams(temperature=0.0))])
    assert drawn.token_ids[[0, 2]].tolist() == alone.token_ids.tolist()
    greedy_stuck = SamplingState(SamplingParams(guided_choice=["a"], temperature=0.0), guide=stuck.guide)
    assert not Sampler().sample(logits[:1], [greedy_stuck]).errors      # EOS allowed: nothing stuck


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "minLength": 5000}, "minLength"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10**6}}},
     "maxItems at $.properties.tags"),
    ({"type": "integer", "minimum": 1e400}, "minimum at $"),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^\\ud800$"}}},
     "pattern at $.properties.id"),
])
def test_schema_values_the_engine_cannot_honour_are_value_errors_naming_keyword_and_path(schema, keyword):
    with pytest.raises(ValueError) as error:
        SamplingParams(guided_json=schema)
    message = str(error.value)
    assert keyword in message and "\\x1f" not in message, message   # named, and no internal regex


def test_a_pattern_no_text_matches_is_refused():
    for pattern in ("\\ud800", "\ud800", "[\\ud800-\\udfff]+"):
        with pytest.raises(ValueError, match="matches no text"):
            SamplingParams(guided_regex=pattern)
    assert compile_dfa("a|\\ud800").fullmatch("a")           # an empty option beside others is fine


# -----------------------------------------------------------------------------------------------
# Against a real server


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_num_seqs=4, kv_cache_bytes=32 << 20)


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(llm_app(llm, ServerConfig(log_interval=60.0))) as server:
        # the vocabulary trie and the walk's kernel load once, with the first constraint: not an attack's cost
        assert httpx.post(server.url + "/v1/completions", timeout=300, json={
            "model": server.app.state.model_name, "prompt": "Hi", "max_tokens": 2, "guided_regex": "[a-z ]{1,9}"
        }).status_code == 200
        yield server


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakRss:
    """The process's resident memory, sampled every 10 ms while the block runs: its peak growth."""

    def __enter__(self):
        self.base, self.peak, self.done = rss_bytes(), 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while not self.done.wait(0.01):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.growth = max(self.peak, rss_bytes()) - self.base


# constraint, and the bound that refuses it (None: the grammar engine serves it, valid, within the budget)
ATTACKS = {"counted repeats": ({"guided_regex": REPEATS}, "expanded_length"),
           "16 nested arrays": ({"guided_json": nested_arrays(16)}, None),
           "16 $defs of two $refs": ({"guided_json": ref_chain(16)}, None),
           "a huge token index": ({"guided_regex": PRINTABLE}, "token_index_bytes")}


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attack_is_refused_or_served_while_others_are_served(server, monkeypatch, attack):
    constraint, bound = ATTACKS[attack]
    engine, model = server.app.state.client.engine, server.app.state.model_name
    compiling, compiled = threading.Event(), threading.Event()
    real = engine.constraint_index

    def watched(params):  # the attack's compile, in the compile thread (add_request asks for others' too)
        if params.guided_pattern is None:
            return real(params)
        compiling.set()
        try:
            return real(params)
        finally:
            compiled.set()

    monkeypatch.setattr(engine, "constraint_index", watched)

    short_body = {"model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            # two at once first: a decode step of two rows compiles its own fused kernel (seconds with a
            # cold Numba cache), which the timed short request below must not pay
            await asyncio.gather(*(http.post("/v1/completions", json=short_body) for _ in range(2)))
            start = time.perf_counter()
            assert (await http.post("/v1/completions", json=short_body)).status_code == 200
            alone_s = time.perf_counter() - start
            attack_reply = asyncio.ensure_future(http.post("/v1/completions", json={
                "model": model, "prompt": "Hi", "max_tokens": 16, **constraint}))
            while not (compiling.is_set() or attack_reply.done()):   # the attack is being compiled (or refused
                await asyncio.sleep(0.005)                             # already, when the schema gives it away)
            sent_while_compiling = not compiled.is_set() and not attack_reply.done()
            start = time.perf_counter()
            health = await http.get("/health")
            health_s = time.perf_counter() - start
            short = await http.post("/v1/completions", json=short_body)
            short_s = time.perf_counter() - start - health_s
            return await attack_reply, sent_while_compiling, health, health_s, short, short_s - alone_s

    with PeakRss() as memory:
        reply, overlapped, health, health_s, short, short_delay_s = asyncio.run(scenario())
    if bound is None:   # a small grammar: answered, and the answer an instance of the schema
        assert reply.status_code == 200, reply.text
        jsonschema.validate(json.loads(reply.json()["choices"][0]["text"]), constraint["guided_json"])
    else:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert bound in error["message"] and error["param"] == "guided_regex", error
    assert health.status_code == 200 and health_s < 0.5      # before: seconds, /health waited on the compile
    # The short request may take at most 2 s longer than it just took alone: a busy shared machine
    # makes its own time vary by seconds, a stall behind the compile added 23-48 s.
    assert short.status_code == 200 and short_delay_s < 2.0
    assert memory.growth < 300 << 20, memory.growth / 1e6    # before: +0.7 to +2 GB
    if bound == "token_index_bytes":                          # the one attack that takes a while to refuse
        assert overlapped


@pytest.mark.slow
def test_min_tokens_a_constraint_cannot_meet_is_a_400_naming_it(server):
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.app.state.model_name, "prompt": "Answer yes:", "max_tokens": 20, "min_tokens": 10,
        "guided_choice": ["yes"]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "min_tokens", reply.text


@pytest.mark.slow
def test_a_sequence_left_without_a_token_fails_alone(server, llm):
    """After its first token, the poisoned request may only write "a"s, and every all-"a" token is in
    its stop_token_ids, which min_tokens masks: no token is left, which admission cannot know
    (the language is infinite). It alone gets the error; the two streams beside it run to the end."""
    model, tokenizer = server.app.state.model_name, llm.tokenizer
    a_tokens = [t for t in range(tokenizer.vocab_size) if tokenizer.id_to_bytes[t].strip(b"a") == b""
                and tokenizer.id_to_bytes[t]]
    poison = {"model": model, "prompt": "Write x then a:", "max_tokens": 30, "min_tokens": 20, "temperature": 0,
              "guided_regex": "xa+", "stop_token_ids": a_tokens}
    plain = {"model": model, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
             "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async def stream():
                async with http.stream("POST", "/v1/completions", json=plain) as response:
                    return [line async for line in response.aiter_lines() if line.startswith("data: ")]

            streams = [asyncio.ensure_future(stream()) for _ in range(2)]
            await asyncio.sleep(0.3)                                  # they are running when it arrives
            failed = await http.post("/v1/completions", json=poison)
            return failed, [await s for s in streams]

    failed, streams = asyncio.run(scenario())
    assert failed.status_code == 400 and "min_tokens = 20" in failed.json()["error"]["message"], failed.text
    for lines in streams:                                             # before: both got the poison's error event
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
        assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    stats = server.app.state.client.engine.stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0      # nothing leaked


@pytest.mark.slow
def test_schema_errors_are_400s_through_the_server(server):
    """Sent as JSON text: 1e400 is a valid JSON number (inf once parsed) that json.dumps cannot write."""
    for schema, keyword in (('{"type": "string", "maxLength": 5000}', "maxLength at $"),
                            ('{"type": "integer", "minimum": 1e400}', "minimum at $"),
                            ('{"type": "string", "pattern": "^\\\\ud800$"}', "matches no text")):
        body = f'{{"model": "{server.app.state.model_name}", "prompt": "Hi", "max_tokens": 4, "guided_json": {schema}}}'
        reply = httpx.post(server.url + "/v1/completions", timeout=120, content=body,
                           headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and keyword in reply.json()["error"]["message"], reply.text
        assert "\\x1f" not in reply.json()["error"]["message"]     # no internal regex
