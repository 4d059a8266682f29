// The optimizer kernels compiled for avx512 (flags set in CMakeLists.txt).
#define NONSTOP_OPTIM_ISA_NS avx512
#define NONSTOP_OPTIM_ISA_NAME "avx512"
#define NONSTOP_OPTIM_TABLE_FN Avx512KernelTable
#include "optim/kernels_impl.h"
