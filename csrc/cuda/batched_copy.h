// One kernel launch copies many (src, dst, count) ranges, casting between
// floating-point dtypes and scaling on the way (copy-in and copy-out of fusion).
#pragma once

#include <cuda_runtime.h>

#include "common/copy_desc.h"
#include "common/types.h"

namespace hvdz {

// Supported: any pair of float16/bfloat16/float32/float64, and copies of every
// integer dtype to itself (a scale other than 1 truncates toward zero).
bool BatchedCopySupported(DataType src, DataType dst);

cudaError_t LaunchBatchedCopy(const CopyDesc* descs, int n, DataType src, DataType dst,
                              double scale, cudaStream_t stream);

}  // namespace hvdz
