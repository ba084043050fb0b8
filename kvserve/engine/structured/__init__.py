"""Structured outputs: the request's constraint (params), its compiled grammar and matcher (grammar), and the
number-precision scanner for JSON (number_precision). Pure: no torch; the masks are applied by the worker."""
