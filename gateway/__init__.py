"""gateway: see docs/architecture.md."""
