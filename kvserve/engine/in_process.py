"""The in-process EngineClient: an AsyncLLM over an LLMEngine in this process, for the service and a fleet
replica alike. The model's source is resolved (maybe assembled) in the engine thread; the step-time prior
is data the caller obtained (planning's calibration), so the engine imports nothing above it."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from kvserve.config import EngineConfig, ServedModel
from kvserve.engine.async_engine import AsyncLLM
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.step_time import StepTimePrior


def in_process_client(spec: ServedModel, config: EngineConfig, on_step: Callable | None,
                      on_finish: Callable[[RequestOutput], None] | None,
                      step_time_prior: StepTimePrior | None = None) -> AsyncLLM:
    """An AsyncLLM for `spec`; its scheduler starts from `step_time_prior` when that was measured at the
    engine's dtype (admission estimates right from the first request)."""

    def factory(cfg: EngineConfig):
        from kvserve.engine.worker.llm_engine import LLMEngine
        from kvserve.models.catalog import resolve_source

        path = resolve_source(spec.source, spec.engine_args.get("install", ""))
        return LLMEngine(replace(cfg, model=str(path)), model_id=spec.id, step_time_prior=step_time_prior)

    return AsyncLLM(config, model_id=spec.id, on_step=on_step, on_finish=on_finish, engine_factory=factory)
