"""HTTP only: the OpenAI-compatible FastAPI app over the completion service (parse, auth, SSE, error mapping).

    app.py          create_app(config) (lifespan: store, engines) and the draining uvicorn server
    state.py        ServerState: the completion service, the store, the metering and batch wiring
    serving.py      a completion over HTTP: body -> auth -> validate -> idempotency -> service -> JSON/SSE
    errors.py       typed errors -> HTTP (OpenAI's error schema), in one place
    auth.py         bearer tokens, the dev tenant;  idempotency.py: Idempotency-Key replay/attach
    streaming.py    SSE;  openapi.py: the OpenAPI document
    routes/         /v1/* (v1.py, batches.py), admin, the dashboard and /health, /ready, /metrics (ops.py)
"""
