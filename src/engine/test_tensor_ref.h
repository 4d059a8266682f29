// Tests only: a TensorRef over a byte vector (a host tensor of dtype uint8),
// as the staging and prepared-slot-file tests register it.
#ifndef NONSTOP_ENGINE_TEST_TENSOR_REF_H_
#define NONSTOP_ENGINE_TEST_TENSOR_REF_H_

#include <cstdint>
#include <string>
#include <vector>

#include "nonstop/engine.h"

namespace nonstop {

inline TensorRef ByteTensorRef(const std::string& name, std::vector<uint8_t>& data) {
  TensorRef r;
  r.spec.name = name;
  r.spec.dtype = DType::kUInt8;
  r.spec.shape = {static_cast<int64_t>(data.size())};
  r.spec.nbytes = data.size();
  r.data = data.data();
  return r;
}

}  // namespace nonstop

#endif  // NONSTOP_ENGINE_TEST_TENSOR_REF_H_
