"""Integrations with rollout engines (import each submodule explicitly)."""
