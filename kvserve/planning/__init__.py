"""Capacity planning: specs (models, accelerators) as data, memory and roofline arithmetic (pure), a
simulator that drives the engine's own scheduler and KV cache manager under a fake clock, the search
behind `kvserve plan`, and the calibration that fits this machine's step time from the real engine.
docs/PLANNING.md explains the model and its limits."""
