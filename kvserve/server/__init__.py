"""The HTTP serving layer: an OpenAI-compatible FastAPI app over one AsyncLLM per model.

    app.py          create_app(config) (lifespan: store, engines) and the draining uvicorn server
    state.py        ServerState / ModelHandle: engines, live numbers, ledger writes, routing
    serving.py      the completion path: auth -> validate -> idempotency -> route -> engine -> JSON/SSE
    protocol.py     request/response schemas;  errors.py: typed errors -> HTTP (OpenAI error schema)
    auth.py         bearer tokens, the dev tenant;  idempotency.py: Idempotency-Key replay/attach
    router.py       pure policy: model="auto" and the x-kvserve-load signal
    metrics.py      Prometheus (kvserve:*) and the 60 s sliding window;  streaming.py: SSE
    routes/         /v1/* (v1.py) and /health, /ready, /metrics (ops.py)
"""
