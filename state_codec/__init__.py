"""The state record: schema of a stream's recurrent state.

This half of the package imports only the standard library and pydantic, so workflows may use it
inside Temporal's sandbox. The checkpoint codec (msgpack, AES-GCM) lands in
`state_codec.codec`, imported only on the worker side.
"""

from state_codec._schema import SCHEMA_VERSION, Discretization, StateSchema, TensorSpec

__all__ = [
    "SCHEMA_VERSION",
    "Discretization",
    "StateSchema",
    "TensorSpec",
]
