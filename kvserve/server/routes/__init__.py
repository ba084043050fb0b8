"""HTTP routes: the OpenAI-compatible /v1 API and the operational endpoints."""
