"""The node agent (``torpor agent``): checkpoints, reclaims idle jobs and evacuates by itself (docs/agent.md)."""
