"""Kimi-VL: rows batch with nothing beyond the batch caches (the plain family); its
tower takes its images' grid shapes as host numbers (``host_merge``)."""

from __future__ import annotations

from . import host_merge
from .base import Family


class KimiVL(Family):
    name = "kimi-vl"

    def __init__(self, model, *cache_bounds, **kwargs):  # the vision cache's, as Family's
        super().__init__(model, *cache_bounds, **kwargs)
        # On the model, not the family: on CUDA a ``SerialFamily`` serves it (it has no
        # engine decode step), and the installed embedding stays with the model.
        host_merge.install(model)
