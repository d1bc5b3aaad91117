"""Fault injection for tests, benchmarks and the demo; never imported by the runtime itself."""

from mindio_ttp.testing.faults import Fault, FaultPlan, InjectedFault, Phase

__all__ = ["Fault", "FaultPlan", "InjectedFault", "Phase"]
