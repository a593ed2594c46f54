"""Shape-annotated array types for public signatures (jaxtyping), checked in tests only.

jaxtyping is a declared dependency, but the GPU image the device probe runs on (the
checkout on PYTHONPATH, nothing installed) lacks it. There the annotations fall back to
their base types, so the model and the engine import and run unchanged; nothing checks
shapes at run time in serving anyway.
"""

try:
    from jaxtyping import Array, Bool, Float, Int, Shaped
except ImportError:  # pragma: no cover - exercised by tests/unit/test_layers.py in a subprocess
    from jax import Array

    class _Dims:
        """`Float[T, "dims"]` is `T`: without jaxtyping the dims are documentation."""

        def __class_getitem__(cls, params):
            return params[0]

    Float = Int = Bool = Shaped = _Dims  # type: ignore[misc,assignment]

__all__ = ["Array", "Bool", "Float", "Int", "Shaped"]
