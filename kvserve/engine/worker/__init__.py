"""The torch half of the engine: the assembly (llm_engine: load, plan, build), the ModelRunner that executes a
SchedulerOutput, the sampler, and the grammar masks over logits. Everything in engine/ that imports torch is here."""
