"""Requests through kvfold onto real engines (DESIGN §11, docs/serving.md).

    kvfold.serving.front_door      the OpenAI-compatible front door on Ray Serve
    kvfold.serving.request_router  kvfold's RequestRouter, for engines deployed as Serve replicas
    kvfold.serving.door_actor      the one place commitments are kept and requests placed
    kvfold.serving.door_admission  its pure core: commitments per engine, FIFO queue, routing

Importing this package imports neither Ray Serve nor transformers; the modules above do.
"""

from kvfold.serving.door_admission import LEAST_LOADED, POLICIES, PRECISE_PREFIX
from kvfold.serving.settings import FrontDoorSettings

__all__ = ["LEAST_LOADED", "POLICIES", "PRECISE_PREFIX", "FrontDoorSettings"]
