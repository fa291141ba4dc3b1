"""Give one model instance's vision tower a replacement ``__call__``."""

from __future__ import annotations


def mix_in(tower, mixin: type, modules: tuple[str, ...]) -> bool:
    """Put ``mixin`` in front of ``tower``'s class, on this instance only, where the
    class comes from one of ``modules`` (the mlx-vlm towers the mixin was written
    against); returns whether the tower has it."""
    cls = type(tower)
    if issubclass(cls, mixin):
        return True
    if cls.__module__ not in modules:
        return False
    tower.__class__ = type(cls.__name__, (mixin, cls), {})
    return True
