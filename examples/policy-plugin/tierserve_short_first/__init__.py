"""A tierserve policy plugin: ``ordering.short-first`` (see :mod:`tierserve_short_first.ordering`)."""

from tierserve_short_first.ordering import ShortFirst, ShortFirstParams

__all__ = ["ShortFirst", "ShortFirstParams"]
