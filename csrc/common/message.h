// Request: what one rank submits for a named tensor. Response: what every rank
// executes, identical on all ranks and in the same order.
#pragma once

#include <string>
#include <vector>

#include "common/set_scope.h"
#include "common/types.h"

namespace hvdz {

// join() waits under this name (op kJoin) until every rank has joined. It is never
// negotiated, but the stall inspector reports it, and the name reads well in
// messages that list what a rank was waiting for.
constexpr char kJoinName[] = "hvd.join()";

struct Request {
  std::string name;
  int32_t rank = 0;                         // in the request's process set
  // Which process set the tensor belongs to: it names the tensor together with
  // `name`. Not on the wire: a set's requests travel on its own control plane.
  int32_t process_set = 0;
  OpType op = OpType::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;
  DataType dtype = DataType::kFloat32;      // input dtype
  DataType out_dtype = DataType::kFloat32;  // wire and output dtype (allgather may cast)
  int32_t device = kCpuDevice;              // ranks must agree on the kind; the index is each rank's own
  int32_t root = 0;                         // broadcast only; a rank of the process set
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // alltoall: rows of dim 0 this rank sends to each rank

  bool on_cuda() const { return device != kCpuDevice; }
};

struct Response {
  std::string name;
  OpType op = OpType::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;
  DataType dtype = DataType::kFloat32;
  DataType out_dtype = DataType::kFloat32;
  bool on_cuda = false;
  // CUDA: every rank's device, in rank order; -1 for a joined rank that did not
  // submit the tensor. See [Note: model parallelism] in runtime/device_maps.h.
  std::vector<int32_t> devices;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;       // rank 0's shape
  std::vector<int64_t> first_dims;  // allgather, alltoall: dim 0 of every rank, in rank order
  // alltoall: size x size rows, sender-major: splits[q * size + r] rows go from rank q to rank r.
  std::vector<int64_t> splits;
  std::string error;                // non-empty: every rank holding this tensor fails it

  bool ok() const { return error.empty(); }
  // Whether `req` (submitted by req.rank) is the tensor this response was made for,
  // so that a cached response can serve it without negotiation.
  bool Matches(const Request& req) const;
};

// Ranks' requests for one tensor -> its response (an error response when they
// disagree). `reqs`: every rank's request in rank order, or, while ranks have
// joined, those of the ranks that submitted it; `missing_joined`: the joined ranks
// that did not, which only an allreduce can do without (they add zeros). Errors
// name world ranks and the process set `scope`.
Response MakeResponse(const std::vector<Request>& reqs, const std::vector<int>& missing_joined = {},
                      const SetScope& scope = SetScope());

// The error of a ready tensor that joined ranks `missing` did not submit, for
// every op but allreduce (see [Note: join] in negotiation/join_tracker.h).
std::string MissingJoinedError(const std::string& name, OpType op, const std::vector<int>& missing);

// "[0, 2]"
std::string RankList(const std::vector<int>& ranks);

void SerializeRequests(const std::vector<Request>& reqs, std::vector<uint8_t>* out);
bool ParseRequests(const uint8_t* data, size_t size, std::vector<Request>* out);
void SerializeResponses(const std::vector<Response>& resps, std::vector<uint8_t>* out);
bool ParseResponses(const uint8_t* data, size_t size, std::vector<Response>* out);

}  // namespace hvdz
