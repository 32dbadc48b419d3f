"""Workloads: trace loaders, generated workloads, the simple engine model, replay."""
