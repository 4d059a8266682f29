// The optimizer kernels compiled for generic (flags set in CMakeLists.txt).
#define NONSTOP_OPTIM_ISA_NS generic
#define NONSTOP_OPTIM_ISA_NAME "generic"
#define NONSTOP_OPTIM_TABLE_FN GenericKernelTable
#include "optim/kernels_impl.h"
