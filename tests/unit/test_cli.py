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
