"""Build FlashMLA's SM90 sparse-prefill forward on a GPU machine (needs nvcc and torch).

    python scripts/build_flashmla.py --src FLASHMLA_DIR --out SITE_DIR

FLASHMLA_DIR is a FlashMLA checkout (deepseek-ai/FlashMLA, branch nv_dev) whose csrc/cutlass
holds the CUTLASS headers (scripts/cudnn_carry.sh packs both). The result is a `flash_mla`
package in SITE_DIR: FlashMLA's own Python files over HyScale's binding
(scripts/flashmla/binding.cpp), which compiles only the SM90 sparse-prefill kernels that
megatron-core's cudnn backend calls, one instantiation a file so they compile in parallel.
Needs nvcc and a CUDA build of torch (no visible GPU): without them it exits with status 2
before writing anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "flashmla"
NVCC_FLAGS = [
    "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "-gencode", "arch=compute_90a,code=sm_90a", "--threads", "4",
]


def cuda_toolchain_missing() -> str | None:
    """What the CUDA extension build lacks here (None: torch is a CUDA build and nvcc is found
    where torch's cpp_extension looks: $CUDA_HOME, $CUDA_PATH, PATH, /usr/local/cuda)."""
    import torch

    if torch.version.cuda is None:
        return f"this torch, {torch.__version__}, is a CPU-only build"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        nvcc = Path(home) / "bin" / "nvcc"
        return None if nvcc.is_file() else f"no {nvcc}"
    if shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").is_file():
        return None
    return "no nvcc on PATH or in /usr/local/cuda; set CUDA_HOME"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Needs nvcc and a CUDA build of torch: without them "
                                            "it exits with status 2 before writing anything.")
    parser.add_argument("--src", type=Path, required=True,
                        help="FlashMLA checkout (csrc/, flash_mla/, csrc/cutlass/include)")
    parser.add_argument("--out", type=Path, required=True,
                        help="folder that receives the flash_mla package (put it on PYTHONPATH)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4,
                        help="parallel compile jobs (default: all cores)")
    args = parser.parse_args()
    missing = cuda_toolchain_missing()
    if missing:
        print(f"build_flashmla.py needs nvcc and a CUDA build of torch ({missing}); run it on "
              "the GPU machine", file=sys.stderr)
        return 2
    csrc = (args.src / "csrc").resolve()
    for need in (csrc / "sm90/prefill/sparse/phase1.cuh", csrc / "cutlass/include/cute/tensor.hpp",
                 args.src / "flash_mla/flash_mla_interface.py"):
        if not need.exists():
            sys.exit(f"build_flashmla.py: --src lacks {need}")

    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    args.out = args.out.resolve()
    build = args.out / "_flashmla_build"
    build.mkdir(parents=True, exist_ok=True)
    sources = [str(HERE / "binding.cpp")] + sorted(str(p) for p in HERE.glob("instantiate_*.cu"))
    include_dirs = [str(csrc), str(csrc / "kerutils/include"), str(csrc / "sm90"),
                    str(csrc / "cutlass/include"), str(csrc / "cutlass/tools/util/include")]
    ext = CUDAExtension(
        name="flash_mla.cuda",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG"], "nvcc": NVCC_FLAGS},
    )
    os.environ["MAX_JOBS"] = str(args.jobs)
    start = time.time()
    print(f"[flashmla] compiling {len(sources)} files with {args.jobs} jobs", flush=True)
    setup(
        name="flash_mla_sm90",
        ext_modules=[ext],
        cmdclass={"build_ext": BuildExtension},
        script_args=["build_ext", "--build-lib", str(args.out), "--build-temp", str(build)],
    )
    package = args.out / "flash_mla"
    for py in (args.src / "flash_mla").glob("*.py"):
        shutil.copy(py, package / py.name)
    built = sorted(package.glob("cuda*.so"))
    if not built:
        sys.exit(f"build_flashmla.py: no flash_mla/cuda*.so in {args.out}")
    print(f"[flashmla] built {built[0]} in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
