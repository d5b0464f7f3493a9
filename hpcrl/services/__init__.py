"""Services: the head's view of a group's replicas (route / fanout / session / call_all)."""

from hpcrl.services.service import Service

__all__ = ["Service"]
