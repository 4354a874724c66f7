// One FlashMLA SM90 sparse-prefill instantiation a file, so the build compiles them in parallel.
#include "sm90/prefill/sparse/phase1.h"
#include "sm90/prefill/sparse/phase1.cuh"

template void sm90::fwd::run_fwd_phase1_kernel<576, false>(const SparseAttnFwdParams& params);
