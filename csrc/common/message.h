// Request: what one rank submits for a named tensor. Response: what every rank
// executes, identical on all ranks and in the same order.
#pragma once

#include <string>
#include <vector>

#include "common/types.h"

namespace hvdz {

struct Request {
  std::string name;
  int32_t rank = 0;
  OpType op = OpType::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;
  DataType dtype = DataType::kFloat32;      // input dtype
  DataType out_dtype = DataType::kFloat32;  // wire and output dtype (allgather may cast)
  int32_t device = kCpuDevice;              // ranks must agree on the kind, not the index
  int32_t root = 0;                         // broadcast only
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;

  bool on_cuda() const { return device != kCpuDevice; }
};

struct Response {
  std::string name;
  OpType op = OpType::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;
  DataType dtype = DataType::kFloat32;
  DataType out_dtype = DataType::kFloat32;
  bool on_cuda = false;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;       // rank 0's shape
  std::vector<int64_t> first_dims;  // allgather: dim 0 of every rank, in rank order
  std::string error;                // non-empty: every rank holding this tensor fails it

  bool ok() const { return error.empty(); }
  // Whether `req` (submitted by req.rank) is the tensor this response was made for,
  // so that a cached response can serve it without negotiation.
  bool Matches(const Request& req) const;
};

// Ranks' requests for one tensor -> its response (an error response when they disagree).
Response MakeResponse(const std::vector<Request>& per_rank);

void SerializeRequests(const std::vector<Request>& reqs, std::vector<uint8_t>* out);
bool ParseRequests(const uint8_t* data, size_t size, std::vector<Request>* out);
void SerializeResponses(const std::vector<Response>& resps, std::vector<uint8_t>* out);
bool ParseResponses(const uint8_t* data, size_t size, std::vector<Response>* out);

}  // namespace hvdz
