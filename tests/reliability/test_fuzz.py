"""Schema fuzzing (issue 21): Schemathesis over the server's own /openapi.json, against a real server (a
subprocess serving the tiny random model), every operation, as an authenticated tenant, and the admin
operations once more as an admin (on another tenant, so that a budget or a rate limit never stops the fuzzing
tenant). The token is Schemathesis's credential for the document's bearer scheme, so the negative cases that
drop or spoil it really do. Two sources of cases for each operation:

- Schemathesis's coverage cases: boundary values and schema violations, derived from the document one
  property at a time (quick: the negative ones, which cost milliseconds each; full: all);
- Hypothesis fuzzing with data that fits the document (positive) and data that breaks it (negative).

Checks on every response: no status of 500 or more; every 4xx/5xx body in OpenAI's error schema; a streamed
200 read to its end (`data: [DONE]`, no in-band error event); and Schemathesis's conformance checks (status
code, content type, response schema where the document declares one, the Allow header of a 405, and data the
document rules out refused). The share of valid completion bodies that got a 2xx shows the bodies were
reached, not turned away at validation (bodies with an output constraint left out of it: a random regex,
grammar or schema is mostly one the compiler refuses, a 400 the document cannot rule out).

Generation on this CPU costs ~30 ms a token, so the cases ask for few: the server's default max_tokens is 4,
and a generated max_tokens (or max_completion_tokens) above 4 is lowered to 4, min_tokens with it when the
pair was valid (a min_tokens above max_tokens stays invalid: that 400 is still tested). Few generated bodies
ask to stream, so every other valid completion case is made to.
"""
from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.auths import set_on_generated_case
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance,
                                               unsupported_method)

from tests.live_server import LiveServer, tiny_model_toml
from tests.reliability.conftest import FULL, scale

pytestmark = pytest.mark.slow

POSITIVE = scale(15, 100)  # Hypothesis cases per operation with data that fits the document
NEGATIVE = scale(10, 60)  # ... with data that breaks it
COMPLETION_POSITIVE = scale(60, 300)  # the completion operations: where the bodies matter most
COVERAGE_MODES = scale([GenerationMode.NEGATIVE], [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
MAX_TOKENS = 4
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
ADMIN_TARGET = "beta"  # the tenant whose budget and limits the admin pass sets
# Schemathesis's; negative_data_rejection: data the document rules out is refused (it is no looser than the server)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          unsupported_method, negative_data_rejection]


def error_schema(ctx, response, case) -> None:
    """A check: a 4xx or 5xx body is OpenAI's error schema, {"error": {message, type, param, code}}."""
    if response.status_code < 400 or case.operation.path == "/health" or case.operation.path == "/ready":
        return  # /health and /ready answer 503 with their own status bodies (not reached here: all is well)
    problem = error_schema_problem(response.content)
    if problem:
        raise AssertionError(f"{response.status_code} body is not OpenAI's error schema ({problem}): "
                             f"{response.content[:300]!r}")


def error_schema_problem(content: bytes) -> str | None:
    try:
        body = json.loads(content)
    except ValueError:
        return "not JSON"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not an object with one key, error"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return "message or type not a non-empty string"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return "param or code neither a string nor null"
    return None


def whole_stream(ctx, response, case) -> None:
    """A check: a 200 event stream was read to its end: JSON chunks, then `data: [DONE]`, no error event."""
    if response.status_code != 200 or "text/event-stream" not in response.headers.get("content-type", [""])[0]:
        return
    assert not response.stream_cut_short, "the stream was cut short"
    events = [e for e in response.content.decode().split("\n\n") if e.strip()]
    assert events and events[-1] == "data: [DONE]", f"the stream does not end with [DONE]: {events[-2:]}"
    for e in events[:-1]:
        if e.startswith("id: "):  # a resume token (service/resume.py) before the data
            e = e.split("\n", 1)[1]
        assert e.startswith("data: "), e[:200]
        chunk = json.loads(e[len("data: "):])
        assert "error" not in chunk, f"an error event in a 200 stream: {e[:300]}"



# Output constraints whose validity JSON Schema cannot state (a regex's syntax, a grammar's, a schema's $refs, a
# tool's parameter schema): generated ones are mostly refused (400), so the 2xx share leaves such cases out.
CONSTRAINT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "tools")


def constrained(body) -> bool:
    if not isinstance(body, dict):
        return False
    rf = body.get("response_format")
    return any(body.get(k) is not None for k in CONSTRAINT_FIELDS) or (
        isinstance(rf, dict) and rf.get("type") in ("json_schema", "json_object"))

@dataclass
class Tally:
    """What the fuzzing saw: cases, statuses, and failed checks, by operation and by how cases were made."""

    cases: collections.Counter = field(default_factory=collections.Counter)  # (operation, source) -> n
    statuses: collections.Counter = field(default_factory=collections.Counter)  # (operation, status) -> n
    valid_2xx: collections.Counter = field(default_factory=collections.Counter)  # operation -> 2xx of valid cases
    valid: collections.Counter = field(default_factory=collections.Counter)  # operation -> valid (positive) cases
    streams: int = 0  # 200 event streams read to the end
    server_errors: list[str] = field(default_factory=list)
    outside_error_schema: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # every failed check, with a curl command to repeat it
    transport_errors: list[str] = field(default_factory=list)  # timeouts, dropped connections

    @property
    def total(self) -> int:
        return sum(self.cases.values())


class Fuzzer:
    def __init__(self, server: LiveServer, tally: Tally):
        self.server, self.tally = server, tally
        self.session = requests.Session()
        self.file_id = self.upload_batch_file()

    def upload_batch_file(self) -> str:
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
        r = httpx.post(self.server.base + "/v1/files", headers=self.server.headers(), data={"purpose": "batch"},
                       files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def shape(self, case, source: str) -> None:
        """Keep generation short (see the module docstring); stream every other valid completion case (few
        generated ones do); point every other valid batch at a real input file. Invalid data stays as made."""
        body = case.body
        if not isinstance(body, dict) or not source.endswith("positive"):
            return
        if case.operation.path in COMPLETIONS:
            if source == "fuzz positive" and self.tally.valid[f"POST {case.operation.path}"] % 2:
                body["stream"] = True
            for key in ("max_tokens", "max_completion_tokens"):
                v = body.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
                    body[key] = MAX_TOKENS
                    m = body.get("min_tokens")
                    if isinstance(m, int) and not isinstance(m, bool) and MAX_TOKENS < m <= v:
                        body["min_tokens"] = MAX_TOKENS
        if case.operation.path == "/v1/batches" and "input_file_id" in body and self.tally.total % 2:
            body["input_file_id"] = self.file_id

    def run(self, case, source: str) -> None:
        op = case.operation
        label = f"{op.method.upper()} {op.path}"
        self.shape(case, source)
        self.tally.cases[(label, source)] += 1
        try:
            response = case.call(base_url=self.server.base, session=self.session, timeout=120)
        except (requests.RequestException, TimeoutError) as e:
            self.tally.transport_errors.append(f"{label} [{source}]: {e!r}\n{case.as_curl_command()}")
            return
        status = response.status_code
        self.tally.statuses[(label, status)] += 1
        if source.endswith("positive") and not constrained(case.body):
            self.tally.valid[label] += 1
            self.tally.valid_2xx[label] += 200 <= status < 300
        if status == 200 and "text/event-stream" in response.headers.get("content-type", [""])[0]:
            self.tally.streams += 1
        where = f"{label} [{source}] -> {status}: {response.content[:300]!r}\n{case.as_curl_command()}"
        if status >= 500:
            self.tally.server_errors.append(where)
        if status >= 400 and error_schema_problem(response.content) and op.path not in ("/health", "/ready"):
            self.tally.outside_error_schema.append(where)
        try:
            case.validate_response(response, checks=CHECKS, additional_checks=[error_schema, whole_stream],
                                   transport_kwargs={"base_url": self.server.base})
        except FailureGroup as group:
            for failure in group.exceptions:
                self.tally.failures.append(f"{failure.title}: {failure.message[:400]}\n  {where}")

    def coverage(self, op, **fixed) -> None:
        """Schemathesis's coverage cases; `fixed` path parameters replace those of the valid ones."""
        schema = op.schema
        config = schema.config.generation_for(operation=op)
        auth = schemathesis.AuthContext(operation=op, app=None)
        for case in schema.iter_coverage_cases(op, generation_modes=COVERAGE_MODES, generation_config=config):
            set_on_generated_case(case, auth, None)  # the credential, unless the case drops it (as the engine)
            mode = case.meta.generation.mode.value if case.meta is not None else "negative"
            if mode == "positive" and fixed.get("path_parameters") and case.path_parameters:
                case.path_parameters.update(fixed["path_parameters"])
            self.run(case, f"coverage {mode}")

    def fuzz(self, op, mode: GenerationMode, examples: int, **fixed) -> None:
        try:
            strategy = op.as_strategy(generation_mode=mode, **fixed)
        except Exception:  # nothing to break (an operation with no parameters has no negative cases)
            return

        @given(strategy)
        @settings(max_examples=examples, deadline=None, database=None, derandomize=not FULL,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def one(case) -> None:
            self.run(case, f"fuzz {mode.value}")

        try:
            one()
        except Unsatisfiable:  # no negative data for an operation with nothing to break (GET /health)
            pass


@pytest.fixture(scope="module")
def server(tiny_llama_gguf, tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz")
    s = LiveServer(home, tiny_model_toml(tiny_llama_gguf), f"default_max_tokens = {MAX_TOKENS}\n")
    with s.store() as store:
        s.admin_token = store.create_tenant("root", admin=True)[1]
        store.create_tenant(ADMIN_TARGET)
    s.start()
    yield s
    s.stop()


def load_schema(server: LiveServer, token: str):
    """The server's document, with `token` as the credential of its bearer scheme."""
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"bearerAuth": {"bearer": token}}}})
    schema = schemathesis.openapi.from_url(server.base + "/openapi.json", config=config)
    schema.config.max_stream_events = 1_000_000  # read every stream whole
    return schema


def test_schemathesis_over_every_operation(server, figures):
    started = time.monotonic()
    tally = Tally()
    fuzzer = Fuzzer(server, tally)
    operations = [r.ok() for r in load_schema(server, server.token).get_all_operations()]
    for op in operations:  # as the tenant (the admin operations answer 403 to it)
        fuzzer.coverage(op)
        positive = COMPLETION_POSITIVE if op.path in COMPLETIONS else POSITIVE
        fuzzer.fuzz(op, GenerationMode.POSITIVE, positive)
        fuzzer.fuzz(op, GenerationMode.NEGATIVE, NEGATIVE)
    target = {"path_parameters": {"name": ADMIN_TARGET}}
    for r in load_schema(server, server.admin_token).get_all_operations():
        op = r.ok()
        if op.path.startswith("/v1/admin/"):  # as an admin, on the other tenant: the bodies are reached
            fuzzer.coverage(op, **target)
            fuzzer.fuzz(op, GenerationMode.POSITIVE, POSITIVE, **target)
            fuzzer.fuzz(op, GenerationMode.NEGATIVE, NEGATIVE, **target)
    elapsed = time.monotonic() - started

    covered = {label for label, _ in tally.cases}
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    statuses = collections.Counter()
    for (_, status), n in tally.statuses.items():
        statuses[status] += n
    detail = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
    figures.record("fuzz", "cases generated", tally.total, "", None,
                   f"{len(operations)} operations, {elapsed:.0f} s; statuses {detail}")
    figures.record("fuzz", "operations covered", len(covered & labels), f"all {len(labels)}",
                   labels <= covered)
    figures.record("fuzz", "responses >= 500", len(tally.server_errors), "0", not tally.server_errors,
                   "; ".join(e.splitlines()[0] for e in tally.server_errors[:3]))
    figures.record("fuzz", "4xx/5xx outside the error schema", len(tally.outside_error_schema), "0",
                   not tally.outside_error_schema, "; ".join(e.splitlines()[0] for e in tally.outside_error_schema[:3]))
    figures.record("fuzz", "failed checks (conformance, streams)", len(tally.failures), "0", not tally.failures,
                   "; ".join(f.splitlines()[0][:200] for f in tally.failures[:3]))
    figures.record("fuzz", "streams read whole", tally.streams, "> 0", tally.streams > 0)
    shares = {}
    for path in COMPLETIONS:
        label = f"POST {path}"
        shares[label] = tally.valid_2xx[label] / max(1, tally.valid[label])
        figures.record("fuzz", f"2xx share of valid {path} cases", round(shares[label], 3), "> 0.5",
                       shares[label] > 0.5, f"{tally.valid_2xx[label]} of {tally.valid[label]}")

    for label in sorted(labels):  # shown when the test fails (pytest prints what it captured)
        by_source = {src: n for (lbl, src), n in tally.cases.items() if lbl == label}
        seen = {st: n for (lbl, st), n in sorted(tally.statuses.items()) if lbl == label}
        print(f"{label}: {by_source} -> {seen}")
    report = "\n\n".join(tally.server_errors + tally.outside_error_schema + tally.failures + tally.transport_errors)
    assert not tally.server_errors and not tally.outside_error_schema and not tally.failures, report[:20000]
    assert not tally.transport_errors, report[:20000]
    assert labels <= covered, labels - covered
    assert tally.streams > 0
    assert all(share > 0.5 for share in shares.values()), (shares, dict(tally.statuses))
    # the server is still well, and still serves
    assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(server.base + "/v1/completions", headers=server.headers(), timeout=60,
                   json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
