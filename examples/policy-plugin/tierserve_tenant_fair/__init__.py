"""A tierserve policy plugin: ``ordering.tenant-fair`` (see :mod:`tierserve_tenant_fair.ordering`)."""

from tierserve_tenant_fair.ordering import TenantFair, TenantFairParams

__all__ = ["TenantFair", "TenantFairParams"]
