"""Simulated serving: the engine's own Scheduler and BlockPool, a cost model for the runner."""
