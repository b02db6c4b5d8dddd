// CPU copy-with-cast-and-scale, and the scalar conversions it is built on.
// fp32 -> bf16/fp16 rounds to nearest, ties to even, like torch's .to().
#pragma once

#include <cstdint>
#include <vector>

#include "common/copy_desc.h"
#include "common/types.h"

namespace hvdz {

uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

// dst[i] = cast<dst_type>(scale * src[i]) for every descriptor, as Horovod's
// ScaleBuffer computes it: in double where either side is double or an integer
// (integers truncate toward zero), else in float with the factor rounded to float.
// src may equal dst (in place).
void CpuBatchedCopy(const std::vector<CopyDesc>& descs, DataType src_type, DataType dst_type,
                    double scale);

}  // namespace hvdz
