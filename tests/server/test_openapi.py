"""The OpenAPI document is the API (issue 17, item 6): real response models, the status codes the
server actually sends, and schemathesis run against it with zero server errors, status-code and
response-schema failures."""

from __future__ import annotations

import httpx
import pytest

from tests.server.harness import running_server

# 401 only with --api-key.
GENERATION_CODES = {"200", "400", "401", "404", "413", "499", "500", "503"}


def test_openapi_declares_real_models_and_the_codes_sent(tiny_server):
    handle, _ = tiny_server
    doc = httpx.get(handle.base_url + "/openapi.json").json()
    paths = doc["paths"]
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    for path, model in (("/v1/completions", "CompletionResponse"),
                        ("/v1/chat/completions", "ChatCompletionResponse")):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == GENERATION_CODES, path  # no 422: validation errors are 400
        ok = responses["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "text/event-stream" in ok
        for code in GENERATION_CODES - {"200"}:
            assert responses[code]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert "Retry-After" in responses["503"]["headers"]
    assert paths["/health"]["get"]["responses"]["200"].get("content", {}) == {}
    assert set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"}
    for name in ("ChatCompletionChunk", "ErrorResponse", "UsageInfo", "ModelCard"):
        assert name in schemas
    # Fields whose null means the default say so.
    props = schemas["CompletionRequest"]["properties"]
    assert {"type": "null"} in props["n"]["anyOf"] and props["n"]["default"] == 1
    assert {"type": "null"} in props["stream"]["anyOf"]
    # What /health sends is what it declares: an empty 200.
    health = httpx.get(handle.base_url + "/health")
    assert health.status_code == 200 and health.content == b""


@pytest.fixture(scope="module")
def fuzz_server(tiny_loaded):
    """A server whose waiting queue holds 8 requests, so generated bodies with a large ``n`` are
    refused (400) rather than generating for minutes, and whose context is 48 tokens, so a case
    without ``max_tokens`` generates a few dozen tokens, not a hundred (the cases stay the same
    requests; more of the long ones are 400s)."""
    from segserve import LLMEngine
    from tests.server.conftest import TINY_ENGINE

    engine = LLMEngine(tiny_loaded, **TINY_ENGINE, max_model_len=48)
    with running_server(engine, max_waiting_requests=8) as hs:
        yield hs


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_nor_schema_violation(fuzz_server):
    """Seeded (``derandomize``), bounded: 415 generated cases over the two generation routes (half
    positive, half negative data) plus the three GET routes; every failure of the selected checks
    is collected and reported, none may occur."""
    import requests
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    handle, _ = fuzz_server
    schema = schemathesis.openapi.from_url(handle.base_url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance,
              content_type_conformance, response_headers_conformance]
    session = requests.Session()
    counts: dict[str, int] = {}
    failures: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()
        has_body = operation.method.lower() == "post"
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,)
        for mode in modes:
            _fuzz(operation, mode, 100 if has_body else 5, handle.base_url, session, checks, counts, failures)
    total = sum(counts.values())
    assert total >= 400, counts
    assert failures == [], f"{len(failures)} of {total} cases failed:\n" + "\n".join(failures[:10])
    handle.assert_idle_and_clean()


def _fuzz(operation, mode, max_examples: int, base_url: str, session, checks, counts: dict[str, int],
          failures: list[str]) -> None:
    """Run ``max_examples`` seeded cases of one operation; count them and collect failures (no
    shrinking: the first failing input is reported as generated)."""
    from hypothesis import HealthCheck, Phase, given, settings

    label = f"{operation.method.upper()} {operation.path} {mode.value}"

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        counts[label] = counts.get(label, 0) + 1
        try:
            case.call_and_validate(base_url=base_url, session=session, checks=checks, timeout=60)
        except Exception as exc:  # noqa: BLE001 - collected: the report lists every failure
            failures.append(f"{label}: {str(exc)[:600]}")

    run()
