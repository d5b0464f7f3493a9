"""Pure planning: the resource plan and the weight-transfer plan. No I/O here."""

from hpcrl.plan.resources import Component, MemoryEstimate, ResourcePlan, make_components, plan_resources
from hpcrl.plan.transfer.check import check_plan, verify_elements
from hpcrl.plan.transfer.layout import InferenceLayout, TrainerLayout
from hpcrl.plan.transfer.plan import TransferPlan, TransferStats
from hpcrl.plan.transfer.planner import plan as plan_transfer

__all__ = ["Component", "InferenceLayout", "MemoryEstimate", "ResourcePlan", "TrainerLayout", "TransferPlan",
           "TransferStats", "check_plan", "make_components", "plan_resources", "plan_transfer",
           "verify_elements"]
