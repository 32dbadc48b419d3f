"""Admission: pure policy (blocks needed, reservations, decisions) and the controller."""

from kvfold.admission.controller import AdmissionController
from kvfold.admission.policy import (
    AdmissionPolicy,
    AdmissionRequest,
    Decision,
    Outcome,
    Policy,
    blocks_needed,
)

__all__ = [
    "AdmissionController",
    "AdmissionPolicy",
    "AdmissionRequest",
    "Decision",
    "Outcome",
    "Policy",
    "blocks_needed",
]
