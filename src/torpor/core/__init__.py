"""Core: checkpoint/restore orchestration (engine), job supervision (launcher), records and image store."""
