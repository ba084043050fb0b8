"""The completion service: a parsed request in, typed deltas and a result with usage out (no HTTP).

Every transport calls it: the HTTP server, the batch runner, the fleet gateway, tests.
"""
