"""Pure planning: the resource plan (and, later, the weight-transfer plan). No I/O here."""

from hpcrl.plan.resources import Component, MemoryEstimate, ResourcePlan, make_components, plan_resources

__all__ = ["Component", "MemoryEstimate", "ResourcePlan", "make_components", "plan_resources"]
