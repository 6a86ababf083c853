"""``GET /openapi.json``: FastAPI's document of the real routes, fuzzed with schemathesis against
the live server (the test_serve module's tiny artifact): no request it generates from the
document gets a 5xx, and every response (status, content type, headers, body) is one the
document declares."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from test_serve import KEY, MODEL, artifact, serving  # noqa: E402,F401  (artifact: the module fixture)

# per operation: a generation route's examples are a few ms to ~1 s each (max_tokens is bounded
# by the artifact's 128 positions), the whole test well under a minute on two cores
EXAMPLES = {"POST /v1/completions": 40, "POST /v1/chat/completions": 40, "POST /tokenize": 20, "POST /detokenize": 20,
            "GET /tokenizer_info": 3, "POST /v1/responses": 10}
DEFAULT_EXAMPLES = 5


@pytest.fixture(scope="module")
def keyed(artifact):
    with serving(artifact, key=KEY, max_batch=4) as running:
        yield running


def test_document_describes_the_bodies_and_needs_the_key(keyed):
    assert httpx.get(keyed.url + "/openapi.json").status_code == 401
    doc = httpx.get(keyed.url + "/openapi.json", headers=keyed.headers).json()
    assert doc["openapi"].startswith("3.")
    for path, body in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/v1/responses", "ResponsesRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
        assert {"200", "400", "401", "413", "429", "500", "503"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["security"] == [{"bearer": []}]
        schema = doc["components"]["schemas"][body]
        assert schema["additionalProperties"] is False and schema["properties"]["model"]["enum"] == [MODEL]
    for path, body in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
        assert {"200", "400", "401"} <= set(op["responses"]) and op["security"] == [{"bearer": []}]
    for path, body in (("/v1/load_lora_adapter", "LoadLoraAdapterRequest"),
                       ("/v1/unload_lora_adapter", "UnloadLoraAdapterRequest")):  # vLLM's LoRA routes
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
        assert set(op["responses"]["200"]["content"]) == {"text/plain"} and op["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    # the request schemas are the ones the routes parse: one they refuse is refused by the route
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["temperature"]
    assert {"minimum": 0, "maximum": 2, "type": "number"} in prompt["anyOf"]
    r = httpx.post(keyed.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "temperature": 2.5},
                   headers=keyed.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_schemathesis_finds_no_server_error_and_no_undocumented_response(keyed):
    from schemathesis import checks

    schema = schemathesis.openapi.from_url(keyed.url + "/openapi.json", headers=keyed.headers)
    run = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
           checks.response_headers_conformance, checks.response_schema_conformance]
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)

        @settings(max_examples=EXAMPLES.get(operation.label, DEFAULT_EXAMPLES), deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case):
            case.call_and_validate(base_url=keyed.url, headers=keyed.headers, checks=run, timeout=60)

        fuzz()
    assert set(EXAMPLES) <= set(labels), labels
    keyed.wait_idle()
