"""Workflow definitions (sandbox-safe: standard library, temporalio and pydantic only).

Empty until the Temporal plugin lands; the package exists so the distribution's layout is fixed.
"""

__all__: list[str] = []
