"""The engine: requests in, token streams out (scheduler, KV cache manager, runner, AsyncLLM, EngineClient).

It imports config, kernels and models only: nothing of HTTP, the service, money, Ray, files or the planner
(tests/unit/test_layering.py holds it to that).
"""
