"""vLLM's routes and shapes (``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models``), the API key,
the input-length boundary, and vLLM's command-line and ``LLM(...)`` forms."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from tests.server.harness import SERVED_NAME, running_server


def test_tokenize_detokenize_prompt_and_messages(tiny_server, tiny_offline):
    handle, _ = tiny_server
    tok = tiny_offline.get_tokenizer()
    r = httpx.post(f"{handle.base_url}/tokenize", json={"model": SERVED_NAME, "prompt": "The lazy dog",
                                                        "return_token_strs": True}).json()
    ids = tok.encode("The lazy dog")
    assert r == {"count": len(ids), "max_model_len": 128, "tokens": ids,
                 "token_strs": tok.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{handle.base_url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tiny_offline.apply_chat_template(messages) and chat["token_strs"] is None
    back = httpx.post(f"{handle.base_url}/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": "The lazy dog"}
    bad = httpx.post(f"{handle.base_url}/detokenize", json={"tokens": [5, 300]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert "[0, 300)" in bad.json()["error"]["message"]
    both = httpx.post(f"{handle.base_url}/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400
    for tokens in ([True], [1.0]):  # strict types, as every request body (a new user's trial)
        r = httpx.post(f"{handle.base_url}/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    r = httpx.post(f"{handle.base_url}/tokenize", json={"prompt": "a", "add_special_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


def test_tokenize_takes_vllms_chat_fields_tools_and_continue_final_message(tiny_server, tiny_offline):
    """A new user's trial (2026-12-05): ``tools`` and ``continue_final_message`` were refused as unknown
    fields (vLLM 0.32's TokenizeChatRequest has them)."""
    handle, _ = tiny_server
    tok = tiny_offline.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    tools = [{"type": "function", "function": {"name": "now", "description": "the time"}}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "tools": tools}
    r = httpx.post(f"{handle.base_url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    want = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False,
                                   continue_final_message=True, tokenize=False)
    assert want.endswith("Sure, the")  # the last message left open
    assert r.json()["tokens"] == tok.encode(want, add_special_tokens=False)
    both = httpx.post(f"{handle.base_url}/tokenize",
                      json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    chat = httpx.post(f"{handle.base_url}/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": messages, "max_tokens": 2, "continue_final_message": True})
    assert chat.status_code == 400 and "Cannot set both" in chat.json()["error"]["message"]
    ok = httpx.post(f"{handle.base_url}/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": messages, "max_tokens": 2, "continue_final_message": True,
        "add_generation_prompt": False})
    plain = httpx.post(f"{handle.base_url}/tokenize", json={
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True}).json()
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == plain["count"]
    handle.assert_idle_and_clean()


def test_version_and_model_card_fields(tiny_server):
    handle, _ = tiny_server
    from segserve import __version__

    assert httpx.get(f"{handle.base_url}/version").json() == {"version": __version__}
    card = httpx.get(f"{handle.base_url}/v1/models").json()["data"][0]
    fields = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert fields <= set(card)
    assert card["id"] == SERVED_NAME and card["max_model_len"] == 128 and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"


def test_prompt_must_leave_room_for_one_token(tiny_server, tiny_offline):
    handle, _ = tiny_server
    ids = (tiny_offline.get_tokenizer().encode("the quick brown fox " * 40))[:128]
    assert len(ids) == 128
    r = httpx.post(f"{handle.base_url}/v1/completions", json={"model": SERVED_NAME, "prompt": ids,
                                                              "max_tokens": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "maximum context length is 128" in r.json()["error"]["message"]
    ok = httpx.post(f"{handle.base_url}/v1/completions", json={"model": SERVED_NAME, "prompt": ids[:127],
                                                               "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    handle.assert_idle_and_clean()


def test_api_key_guards_v1_with_openai_401(tiny_loaded):
    from segserve import LLMEngine
    from tests.server.conftest import TINY_ENGINE

    with running_server(LLMEngine(tiny_loaded, **TINY_ENGINE), api_key="sekret") as (handle, _):
        body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 1}
        url = f"{handle.base_url}/v1/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{handle.base_url}/health").status_code == 200  # not under /v1
        import openai

        client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="sekret", max_retries=0)
        assert client.models.list().data[0].id == SERVED_NAME
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="nope", max_retries=0).models.list()


def _serve_args(argv: list[str]) -> argparse.Namespace:
    from segserve.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *argv, "--max-num-batched-tokens", "256"])


def test_serve_takes_the_model_positionally_and_vllm_flags(tmp_path):
    from segserve.engine_args import EngineArgs
    from segserve.entrypoints.serve import resolve_model_arg

    x, y = tmp_path / "x", tmp_path / "y"  # the model paths must exist (checked before any model work)
    x.mkdir()
    y.mkdir()
    args = _serve_args([str(x), "--dtype", "auto", "--api-key", "k",
                        "--kv-cache-memory-bytes", "2Gi"])
    resolve_model_arg(args)
    assert args.model == str(x) and args.api_key == "k"
    assert args.dtype == "float32"  # auto: no config.json there, so float32 (as for a GGUF file)
    assert EngineArgs.from_cli_args(args).kv_cache_memory_bytes == 2 * 2**30
    args = _serve_args(["--model", str(y), "--kv-cache-memory-bytes", "1500000000"])
    resolve_model_arg(args)
    assert args.model == str(y)
    assert EngineArgs.from_cli_args(args).kv_cache_memory_bytes == 1_500_000_000
    # vLLM's human_readable_int: upper-case suffixes are binary, lower-case decimal.
    three = EngineArgs.from_cli_args(_serve_args(["--kv-cache-memory-bytes", "3G"]))
    assert three.kv_cache_memory_bytes == 3 * 2**30
    three = EngineArgs.from_cli_args(_serve_args(["--kv-cache-memory-bytes", "3g"]))
    assert three.kv_cache_memory_bytes == 3 * 10**9
    twice = _serve_args(["/models/a", "--model", "/models/b"])
    with pytest.raises(ValueError, match="given twice"):
        resolve_model_arg(twice)
    with pytest.raises(SystemExit):
        _serve_args(["--kv-cache-memory-bytes", "lots"])


def test_a_port_in_use_is_refused_before_any_model_work(tmp_path):
    """A new user's trial: ``serve --port P`` with P taken loaded the model (3-8 s), then said only
    "[Errno 98] Address already in use". The socket is now bound first (as vLLM does), and the error
    names the host and port: here before the (empty, so unloadable) model directory is read."""
    import socket

    from segserve.entrypoints.serve import run_serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = _serve_args([str(tmp_path), "--host", "127.0.0.1", "--port", str(port)])
        with pytest.raises(OSError, match=rf"--host 127.0.0.1 --port {port}: address already in use"):
            run_serve(args)


def test_dtype_auto_follows_the_checkpoint(tmp_path, tiny_loaded):
    import torch

    from segserve.engine.llm_engine import auto_dtype

    for name, expected in (("bfloat16", torch.bfloat16), ("float16", torch.bfloat16),
                           ("float32", torch.float32)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"torch_dtype": name}))
        assert auto_dtype(str(d)) == expected
    assert auto_dtype(str(tmp_path / "model.gguf")) == torch.float32
    assert auto_dtype(tiny_loaded) == torch.float32


def test_llm_accepts_vllm_cpu_no_ops_and_refuses_the_rest(tiny_loaded, caplog):
    from segserve import LLM, SamplingParams
    from tests.server.conftest import TINY_ENGINE

    with caplog.at_level("INFO", logger="segserve"):
        llm = LLM(tiny_loaded, **TINY_ENGINE, tensor_parallel_size=1, gpu_memory_utilization=0.9,
                  enforce_eager=True, dtype="auto")
    assert "gpu_memory_utilization=0.9): no effect on CPU" in caplog.text
    out = llm.generate("The lazy dog", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):
        LLM(tiny_loaded, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="unsupported keyword 'speculative_config'"):
        LLM(tiny_loaded, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'gguf', 'none'\], got 'awq'"):
        LLM(tiny_loaded, quantization="awq")


def test_offline_logprobs_are_vllm_logprob_objects(tiny_offline):
    from segserve import Logprob, SamplingParams

    out = tiny_offline.generate("The lazy dog", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                               prompt_logprobs=1), use_tqdm=False)[0]
    tok = tiny_offline.get_tokenizer()
    for t, pos in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        chosen = pos[t]
        assert isinstance(chosen, Logprob) and chosen.rank == 1  # greedy: the most likely
        assert chosen.decoded_token == tok.decode([t]) and chosen.logprob == float(chosen) < 0
        ranked = sorted(pos.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2] and ranked[0].logprob >= ranked[1].logprob
    prompt_pos = out.prompt_logprobs[1]
    actual = out.prompt_token_ids[1]
    assert prompt_pos[actual].rank >= 1 and prompt_pos[actual].decoded_token == tok.decode([actual])


def test_the_model_argument_as_given_is_a_served_name_too():
    """vLLM serves `serve ./dir` as "./dir"; a fresh user's request with the path got a 404. The file's
    name stays first (the name responses report), the argument as given follows."""
    from segserve.entrypoints.serve import default_served_names

    assert default_served_names("smol", "/models/smol") == ["smol", "/models/smol"]
    assert default_served_names("smol", "smol") == ["smol"]
    assert default_served_names("smol", None) == ["smol"]




def _boundary_stop(prefixes: list[str]) -> str:
    """Two characters across a token boundary, first seen there (``prefixes[k]``: the greedy text after
    k + 1 tokens): the stop string's first character ends a step's text, so it is held back for a step
    before the next token completes the stop string."""
    full = prefixes[-1]
    for a, b in zip(prefixes, prefixes[1:], strict=False):
        if a and len(b) > len(a) and b.startswith(a) and "\ufffd" not in a[-1] + b[len(a)]:
            stop = a[-1] + b[len(a)]
            if full.find(stop) == len(a) - 1:
                return stop
    raise AssertionError(f"no token boundary to cut in {prefixes!r}")


def test_streamed_text_equals_the_text_with_stop_strings(tiny_server):
    """A fresh user's trial: with stop " 6" a stream sent " 4, 5, " where the response said " 4, 5,"
    (the space, held back as a possible start of " 6", went out in the stream). A stop string across a
    token boundary of a greedy text: streamed and whole texts are equal, for completions and chat."""
    from tests.server.harness import sse_events

    handle, _ = tiny_server
    url = handle.base_url
    base = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    chat = {k: v for k, v in base.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "a"}]}

    def text_of(choice: dict) -> str:
        return choice["text"] if "text" in choice else choice["message"]["content"]

    for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
        prefixes = [text_of(httpx.post(f"{url}{path}", json=body | {"max_tokens": k}).json()["choices"][0])
                    for k in range(1, 17)]
        stop = _boundary_stop(prefixes)
        once = httpx.post(f"{url}{path}", json=body | {"stop": [stop]}).json()["choices"][0]
        with httpx.stream("POST", f"{url}{path}", json=body | {"stop": [stop], "stream": True}) as s:
            events = [e for e in sse_events(list(s.iter_lines())) if e != "[DONE]" and e["choices"]]
        streamed = "".join(e["choices"][0]["text"] if "text" in e["choices"][0]
                           else e["choices"][0]["delta"].get("content") or "" for e in events)
        assert text_of(once) == prefixes[-1][:prefixes[-1].find(stop)] and once["finish_reason"] == "stop"
        assert streamed == text_of(once), (path, stop)
        # The stop string is in the last chunk too, as in the whole response (chat streams lacked it:
        # a new user's trial, 2026-12-05).
        assert once["stop_reason"] == stop and events[-1]["choices"][0]["stop_reason"] == stop, path


def test_stream_sends_a_chunk_for_every_step_with_tokens(tiny_server):
    """vLLM 0.32 streams a chunk for each engine step that generated tokens, with empty text when the
    step's text is held back (a stop string's possible start, an incomplete UTF-8 character); segserve
    skipped those steps, so a client timing chunks merged two inter-token gaps into one and, when the
    first token's text was held, measured a later TTFT. Completions and chat: one chunk with choices per
    generated token (n = 1: one token a step), the held-back step's text empty."""
    from tests.server.harness import sse_events

    handle, _ = tiny_server
    url = handle.base_url
    base = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    chat = {k: v for k, v in base.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "a"}]}
    for path, body, field in (("/v1/completions", base, "text"), ("/v1/chat/completions", chat, "content")):
        def text_of(choice: dict) -> str:
            return choice["text"] if "text" in choice else choice["message"]["content"]

        prefixes = [text_of(httpx.post(f"{url}{path}", json=body | {"max_tokens": k}).json()["choices"][0])
                    for k in range(1, 17)]
        stop = _boundary_stop(prefixes)
        stream_body = body | {"stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}{path}", json=stream_body) as s:
            events = [e for e in sse_events(list(s.iter_lines())) if e != "[DONE]"]
        with_choices = [e["choices"][0] for e in events if e["choices"]]
        tokens = events[-1]["usage"]["completion_tokens"]
        assert len(with_choices) == tokens, (path, stop, len(with_choices), tokens)
        texts = [c["text"] if field == "text" else c["delta"].get("content") for c in with_choices]
        assert "" in texts, (path, texts)  # the step whose text waited for the stop string's check
        assert with_choices[-1]["finish_reason"] == "stop", path


def test_short_prompts_are_tokenized_on_the_event_loop_and_long_ones_off_it(tiny_server, monkeypatch):
    """A hop to a worker thread and back cost a median ~1.8 ms of TTFT under load (more than tokenizing a
    short prompt), so prompts of at most INLINE_PROMPT_CHARS characters (or ids) are tokenized on the
    loop; longer ones, and chat requests with tools, in a worker thread. Same result either way."""
    import threading

    from segserve.entrypoints.openai.serving import INLINE_PROMPT_CHARS

    handle, _ = tiny_server
    serving = handle.app.state.serving
    seen: list[str] = []
    real = serving.llm.tokenize

    def tokenize(prompt, **kw):
        seen.append(threading.current_thread().name)
        return real(prompt, **kw)

    monkeypatch.setattr(serving.llm, "tokenize", tokenize)
    body = {"model": SERVED_NAME, "max_tokens": 1, "temperature": 0}
    short, long = "a b " * (INLINE_PROMPT_CHARS // 4), "a b " * (INLINE_PROMPT_CHARS // 4) + "c"
    # Both are too long for the tiny model (128 tokens): refused alike, after tokenizing.
    outs = [httpx.post(f"{handle.base_url}/v1/completions", json=body | {"prompt": p}, timeout=60)
            for p in (short, long)]
    assert [o.status_code for o in outs] == [400, 400]
    assert all("maximum context length is 128 tokens" in o.json()["error"]["message"] for o in outs)
    assert len(short) == INLINE_PROMPT_CHARS and len(seen) == 2
    loop_thread = seen[0]
    assert seen[1] != loop_thread, seen
    # A list of token ids counts one per id; a short one is tokenized on the loop and served.
    ok = httpx.post(f"{handle.base_url}/v1/completions", json=body | {"prompt": [5] * 10}, timeout=60)
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    assert seen[2] == loop_thread, seen
