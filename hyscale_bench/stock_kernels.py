"""Whether megatron-core's optional stock DSA kernels can run here (benchmarks' stock rows)."""

from __future__ import annotations


def tilelang_unavailable() -> str | None:
    """None when megatron-core's TileLang DSA kernels can run here, else why not."""
    try:
        import tilelang  # noqa: F401
    except Exception as err:  # any import failure (missing wheel, ABI, CUDA) means "absent"
        return f"tilelang does not import ({type(err).__name__}: {err})"
    from megatron.core.utils import _missing_tilelang_dsa_kernel_dependencies

    missing = _missing_tilelang_dsa_kernel_dependencies()
    if missing:
        return f"megatron-core's TileLang kernels do not import: {', '.join(missing)}"
    return None
