"""The ``segserve`` command line: errors are one clear line, before any model loads."""

from __future__ import annotations

from segserve.entrypoints.cli import build_parser, main


def test_missing_document_is_a_clear_error_not_a_traceback(capsys):
    assert main(["generate", "--document", "/nonexistent/doc.txt", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "/nonexistent/doc.txt" in err


def test_generate_help_shows_defaults():
    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "(default: 96)" in text and "(default: 512)" in text
    # Once each, and none where there is none (a new user's trial: "(default: Apache-2.0) (default: None)").
    assert "(default: None)" not in text and "(default: 16)" in text


def test_serve_help_shows_the_engine_defaults_too():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    flat = " ".join(text.split())
    assert "tokens per KV block (default: 16)" in flat and "running requests at once (default: 64)" in flat
    assert "(default: None)" not in flat and flat.count("(default: 8000)") == 1


def test_auto_tool_choice_flags_go_together(capsys):
    assert main(["serve", "--enable-auto-tool-choice", "--max-num-batched-tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--enable-auto-tool-choice and --tool-call-parser go together" in err
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")


def test_generate_refuses_bad_sampling_flags_before_the_model_loads(capsys, monkeypatch):
    """A fresh user's trial: `--max-tokens 0` was refused only after a 5-15 s model load."""
    from segserve import LLMEngine

    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(LLMEngine, "from_engine_args", no_load)
    assert main(["generate", "--prompt", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens must be an int >= 1, got 0" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0, got -1.0" in capsys.readouterr().err


def test_vllm_only_flags_are_refused_with_the_reason(capsys):
    """A fresh user's trial: `serve --gpu-memory-utilization 0.9` said only "unrecognized arguments"."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--gpu-memory-utilization", "0.9", "--enable-chunked-prefill", "--max-num-seqs", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "unrecognized arguments: --gpu-memory-utilization --enable-chunked-prefill" in err
    assert "--gpu-memory-utilization is a vLLM GPU setting (on the CPU the KV cache is sized by " \
           "--kv-cache-memory-bytes)" in err
    assert "--enable-chunked-prefill: segserve always chunks prefills" in err
    with pytest.raises(SystemExit):
        main(["serve", "--bogus"])
    assert capsys.readouterr().err.rstrip().endswith("error: unrecognized arguments: --bogus")


def test_each_vllm_only_flag_gets_its_own_reason_under_the_subcommands_usage(capsys):
    """A new user's trial (2026-12-05): `--enforce-eager` and `--tensor-parallel-size` were told the KV
    cache is sized by --kv-cache-memory-bytes (that fits only --gpu-memory-utilization), under the
    top-level usage line."""
    import pytest

    for flag, reason in (("--enforce-eager", "CUDA graphs"), ("--tensor-parallel-size", "--num-replicas"),
                         ("--swap-space", "already in CPU memory")):
        with pytest.raises(SystemExit):
            main(["serve", flag, "1"] if flag != "--enforce-eager" else ["serve", flag])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert reason in last and "--kv-cache-memory-bytes" not in last, err
        assert err.startswith("usage: segserve serve"), err


def test_bad_engine_flags_fail_before_any_model_work_naming_the_flag(capsys, monkeypatch):
    """A new user's trial (2026-12-05): `serve --block-size 7` first built the step profile and logged an
    automatic budget, then failed naming the field `block_size`; a missing model file was found after
    "no model here to fingerprint this machine by"."""
    from segserve.entrypoints import serve

    def no_profile(*_a, **_k):
        raise AssertionError("the step profile was built before the engine flags were checked")

    monkeypatch.setattr(serve, "_step_profile", no_profile)
    monkeypatch.setattr(serve, "listening_socket", no_profile)
    assert main(["serve", "--block-size", "7"]) == 2
    assert "error: --block-size must be a power of two in [1, 4096], got 7" in capsys.readouterr().err
    assert main(["serve", "--kv-segment-size", "512", "--block-size", "1024"]) == 2
    assert "--kv-segment-size=512 must be a multiple of --block-size=1024" in capsys.readouterr().err
    assert main(["serve", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/model.gguf" in err and "expected a .gguf file or a local Hugging Face" in err
    from segserve import LLMEngine

    monkeypatch.setattr(LLMEngine, "from_engine_args", no_profile)
    assert main(["generate", "--prompt", "hi", "--max-num-seqs", "0"]) == 2
    assert "error: --max-num-seqs must be >= 1, got 0" in capsys.readouterr().err
