"""Worker-side activities (load, advance, encode, store, dispose).

Empty until the Temporal plugin lands; the package exists so the distribution's layout is fixed.
"""

__all__: list[str] = []
