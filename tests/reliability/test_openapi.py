"""The OpenAPI document describes what the server takes (issue 21, schema fuzzing): a request body schema for
every operation that reads one (the routes that parse their own bodies included), the bearer scheme, OpenAI's
error schema for the errors, the served models' values filled in; and bodies generated from it pass the
server's own validation (no server: the app is built, not started)."""
from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from kvserve.config import ServerConfig
from kvserve.server.app import create_app
from kvserve.server.errors import error_body
from kvserve.service import protocol as p
from tests.live_server import tiny_model_toml

NO_BODY = {("post", "/v1/batches/{batch_id}/cancel"),  # OpenAI's cancel takes no body; neither does ours
           ("post", "/v1/admin/models/{model_id}/load"), ("post", "/v1/admin/models/{model_id}/unload"),
           ("post", "/v1/admin/models/{model_id}/sleep"), ("post", "/v1/admin/models/{model_id}/wake")}
BODIES = {("post", "/v1/chat/completions"): ("application/json", p.ChatCompletionRequest),
          ("post", "/v1/completions"): ("application/json", p.CompletionRequest),
          ("post", "/v1/files"): ("multipart/form-data", p.FileUpload),
          ("post", "/v1/batches"): ("application/json", p.BatchCreateRequest),
          ("put", "/v1/admin/tenants/{name}/budget"): ("application/json", p.BudgetRequest),
          ("post", "/v1/region/escrow/lease"): ("application/json", p.EscrowLease),
          ("post", "/v1/region/escrow/release"): ("application/json", p.EscrowRelease),
          ("put", "/v1/admin/tenants/{name}/limits"): ("application/json", p.LimitsRequest),
          ("post", "/v1/load_lora_adapter"): ("application/json", p.LoadLoRAAdapterRequest),
          ("post", "/v1/unload_lora_adapter"): ("application/json", p.UnloadLoRAAdapterRequest),
          ("post", "/v1/admin/models/{model_id}/pin"): ("application/json", p.PinRequest)}


@pytest.fixture(scope="module")
def app(tiny_llama_gguf, tmp_path_factory):
    home = tmp_path_factory.mktemp("openapi")
    config = home / "models.toml"
    config.write_text(f'[server]\nhome = "{home}"\n' + tiny_model_toml(tiny_llama_gguf, max_model_len=256))
    return create_app(ServerConfig.from_toml(str(config)))


@pytest.fixture(scope="module")
def doc(app) -> dict:
    return app.openapi()


def resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_every_post_and_put_has_a_request_body_schema(doc):
    seen = set()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method not in ("post", "put", "patch"):
                continue
            seen.add((method, path))
            if (method, path) in NO_BODY:
                assert "requestBody" not in op, (method, path)
                continue
            assert op.get("requestBody", {}).get("required") is True, (method, path)
            (media, content), = op["requestBody"]["content"].items()
            expected_media, model = BODIES[(method, path)]
            assert media == expected_media, (method, path, media)
            schema = resolve(doc, content["schema"])
            assert schema["title"] == model.__name__ and schema["properties"], (method, path)
            assert set(schema.get("required", ())) == {n for n, f in model.model_fields.items() if f.is_required()}
    assert seen == set(BODIES) | NO_BODY, seen ^ (set(BODIES) | NO_BODY)


def test_every_ref_resolves_and_fastapis_422_is_gone(doc):
    text = json.dumps(doc)
    for ref in {part.split('"', 1)[0] for part in text.split('"$ref": "')[1:]}:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], ref
    assert "HTTPValidationError" not in text and '"422"' not in text


def test_bearer_auth_and_the_error_schema(doc):
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {**doc["components"]["securitySchemes"][
        "bearerAuth"], "type": "http", "scheme": "bearer"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if path.startswith("/v1/"):
                assert op["security"] == [{"bearerAuth": []}], (method, path)
                for status in ("4XX", "5XX"):
                    schema = op["responses"][status]["content"]["application/json"]["schema"]
                    assert resolve(doc, schema)["title"] == "ErrorResponse"
            else:  # /health, /ready, /metrics, /fleet/status: no auth
                assert "security" not in op, (method, path)
    # what the server sends is what the document says
    p.ErrorResponse.model_validate(error_body("bad", code="invalid_value", param="n"))
    p.ErrorResponse.model_validate(error_body("bad"))


def test_served_values_fill_the_marks(doc):
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == ["tiny", "auto"]
    for key in ("max_tokens", "max_completion_tokens"):
        count = chat[key]["anyOf"][0]  # or null
        assert count["maximum"] == 255 and count["minimum"] == 1
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == ["tiny", "auto"]
    # the vocabulary is known once the model is loaded: not in a server that never started (made afresh)
    assert '"x-kvserve": "vocabulary"' in json.dumps(completion["prompt"])


def test_streams_and_responses_are_described(doc):
    for path in ("/v1/chat/completions", "/v1/completions"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert resolve(doc, models)["title"] == "ModelList"


@pytest.mark.parametrize("path,model", [("/v1/chat/completions", p.ChatCompletionRequest),
                                        ("/v1/completions", p.CompletionRequest),
                                        ("/v1/batches", p.BatchCreateRequest)])
def test_generated_bodies_pass_the_servers_validation(doc, path, model):
    """The document is no looser than the validation: every body Schemathesis makes from it validates (the
    rules across fields included), but for the few rules JSON Schema cannot state (listed)."""
    schema = schemathesis.openapi.from_dict(doc)
    op = schema[path]["POST"]
    rejected = []

    @given(op.as_strategy())
    @settings(max_examples=60, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        try:  # through JSON, as the server reads it
            req = model.model_validate(p.parse_json(json.dumps(case.body).encode()))
            if isinstance(req, p.BatchCreateRequest):
                return
            req.sampling_params()
        except Exception as e:
            if "min_tokens" in str(e) or "number of prompts x n" in str(e):
                return  # min_tokens <= max_tokens, prompts x n <= 128: across fields, by value
            if "one output constraint" in str(e) or "exactly one of" in str(e):
                return  # one structured-output constraint in all of response_format, structured_outputs, guided_*
            if "not among the tools" in str(e) or "tool names must be unique" in str(e):
                return  # a named tool_choice names one of the tools; the tools' names differ
            if "the JSON schema is not JSON" in str(e):
                return  # a schema given as a string must hold JSON (the document says contentMediaType only)
            rejected.append((case.body, str(e)[:300]))

    check()
    assert not rejected, [m for _, m in rejected[:3]]


def test_the_document_loads_in_schemathesis(doc):
    schema = schemathesis.openapi.from_dict(doc)
    ops = list(schema.get_all_operations())
    assert ops and all(r.ok() is not None for r in ops)
    assert len(ops) == sum(len(item) for item in doc["paths"].values())

