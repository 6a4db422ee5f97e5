"""policies: see docs/architecture.md."""
