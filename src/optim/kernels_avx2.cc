// The optimizer kernels compiled for avx2 (flags set in CMakeLists.txt).
#define NONSTOP_OPTIM_ISA_NS avx2
#define NONSTOP_OPTIM_ISA_NAME "avx2"
#define NONSTOP_OPTIM_TABLE_FN Avx2KernelTable
#include "optim/kernels_impl.h"
