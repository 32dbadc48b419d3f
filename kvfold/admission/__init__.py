"""Admission: pure policy (blocks needed, reservations, decisions) and the controller."""

from kvfold.admission.controller import AdmissionController
from kvfold.admission.policy import (
    AdmissionPolicy,
    AdmissionRequest,
    Decision,
    Outcome,
    Policy,
    blocks_needed,
    new_controller_id,
)
from kvfold.admission.queue import FifoAdmissionQueue
from kvfold.admission.routing import Router, RoutingWeights

__all__ = [
    "AdmissionController",
    "AdmissionPolicy",
    "AdmissionRequest",
    "Decision",
    "FifoAdmissionQueue",
    "Outcome",
    "Policy",
    "Router",
    "RoutingWeights",
    "blocks_needed",
    "new_controller_id",
]
