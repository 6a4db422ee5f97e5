"""loadtest: see docs/architecture.md."""
