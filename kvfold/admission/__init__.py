"""Admission: pure policy (blocks needed, reservations, decisions) and the controller."""

from kvfold.admission.controller import AdmissionController
from kvfold.admission.decision import (
    AdmissionRequest,
    Decision,
    Outcome,
    Policy,
    blocks_needed,
)
from kvfold.admission.policy import AdmissionPolicy, new_controller_id
from kvfold.admission.queue import FifoAdmissionQueue
from kvfold.admission.routing import Router, RoutingWeights
from kvfold.admission.settings import ControllerSettings

__all__ = [
    "AdmissionController",
    "AdmissionPolicy",
    "AdmissionRequest",
    "ControllerSettings",
    "Decision",
    "FifoAdmissionQueue",
    "Outcome",
    "Policy",
    "Router",
    "RoutingWeights",
    "blocks_needed",
    "new_controller_id",
]
