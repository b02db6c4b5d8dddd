#include "common/message.h"

#include <algorithm>
#include <sstream>

#include "common/wire_format.h"

namespace hvdz {
namespace {

std::string DeviceKind(const Request& r) { return r.on_cuda() ? "cuda" : "cpu"; }

// Formats "rank p has A, rank q has B" (world ranks) for the first rank whose
// value differs from the first request's.
template <typename Get>
std::string FirstMismatch(const std::vector<Request>& reqs, const SetScope& scope, const char* what, Get get) {
  auto ref = get(reqs[0]);
  for (size_t r = 1; r < reqs.size(); ++r) {
    auto v = get(reqs[r]);
    if (v != ref) {
      std::ostringstream os;
      os << "Mismatched " << what << " for tensor '" << reqs[0].name << "'" << scope.Where() << ": rank "
         << scope.World(reqs[0].rank) << " has " << ref << ", rank " << scope.World(reqs[r].rank) << " has " << v
         << ". Every rank must submit this tensor with the same " << what << ".";
      return os.str();
    }
  }
  return {};
}

std::string TrailingShape(const Request& r) {
  if (r.shape.empty()) return "a scalar";
  return ShapeString(std::vector<int64_t>(r.shape.begin() + 1, r.shape.end()));
}

// Each rank's splits: one count per rank, none negative, summing to its dim 0
// (checked at the call too; a request from another build could still differ).
std::string CheckSplits(const std::vector<Request>& reqs, const SetScope& scope) {
  const size_t size = reqs.size();
  for (const auto& r : reqs) {
    int64_t sum = 0;
    bool negative = false;
    for (auto s : r.splits) {
      sum += s;
      negative |= s < 0;
    }
    if (r.splits.size() != size || negative || r.shape.empty() || sum != r.shape[0]) {
      return "Invalid alltoall splits for tensor '" + r.name + "'" + scope.Where() + " on rank " +
             std::to_string(scope.World(r.rank)) + ": " +
             ShapeString(r.splits) + " for a tensor of shape " + ShapeString(r.shape) + ". Pass one non-negative "
             "count of rows per rank (" + std::to_string(size) + " in all), summing to dim 0.";
    }
  }
  return {};
}

std::string CheckAgreement(const std::vector<Request>& reqs, const SetScope& scope) {
  std::string e;
  if (!(e = FirstMismatch(reqs, scope, "op", [](const Request& r) { return std::string(OpTypeName(r.op)); })).empty()) return e;
  if (!(e = FirstMismatch(reqs, scope, "dtype", [](const Request& r) { return std::string(DataTypeName(r.dtype)); })).empty()) return e;
  if (!(e = FirstMismatch(reqs, scope, "output dtype", [](const Request& r) { return std::string(DataTypeName(r.out_dtype)); })).empty()) return e;
  if (!(e = FirstMismatch(reqs, scope, "device kind", DeviceKind)).empty()) return e;
  const OpType op = reqs[0].op;
  if (op == OpType::kAllreduce || op == OpType::kReducescatter) {
    if (!(e = FirstMismatch(reqs, scope, "reduce op", [](const Request& r) { return std::string(ReduceOpName(r.reduce_op)); })).empty()) return e;
    if (!(e = FirstMismatch(reqs, scope, "prescale factor", [](const Request& r) { return r.prescale; })).empty()) return e;
    if (!(e = FirstMismatch(reqs, scope, "postscale factor", [](const Request& r) { return r.postscale; })).empty()) return e;
  }
  if (op == OpType::kBroadcast) {
    if (!(e = FirstMismatch(reqs, scope, "root rank", [&](const Request& r) { return scope.World(r.root); })).empty()) return e;
  }
  if (op == OpType::kAllgather || op == OpType::kAlltoall) {
    // Dim 0 may differ between ranks; the rest must not.
    if (!(e = FirstMismatch(reqs, scope, "shape past dim 0", TrailingShape)).empty()) return e;
    return op == OpType::kAlltoall ? CheckSplits(reqs, scope) : std::string();
  }
  return FirstMismatch(reqs, scope, "shape", [](const Request& r) { return ShapeString(r.shape); });
}

void PutRequest(ByteWriter& w, const Request& r) {
  w.PutString(r.name);
  w.Put<int32_t>(r.rank);
  w.Put<uint8_t>(static_cast<uint8_t>(r.op));
  w.Put<uint8_t>(static_cast<uint8_t>(r.reduce_op));
  w.Put<uint8_t>(static_cast<uint8_t>(r.dtype));
  w.Put<uint8_t>(static_cast<uint8_t>(r.out_dtype));
  w.Put<int32_t>(r.device);
  w.Put<int32_t>(r.root);
  w.Put<double>(r.prescale);
  w.Put<double>(r.postscale);
  w.PutInts(r.shape);
  w.PutInts(r.splits);
}

Request GetRequest(ByteReader& rd) {
  Request r;
  r.name = rd.GetString();
  r.rank = rd.Get<int32_t>();
  r.op = static_cast<OpType>(rd.Get<uint8_t>());
  r.reduce_op = static_cast<ReduceOp>(rd.Get<uint8_t>());
  r.dtype = static_cast<DataType>(rd.Get<uint8_t>());
  r.out_dtype = static_cast<DataType>(rd.Get<uint8_t>());
  r.device = rd.Get<int32_t>();
  r.root = rd.Get<int32_t>();
  r.prescale = rd.Get<double>();
  r.postscale = rd.Get<double>();
  r.shape = rd.GetInts();
  r.splits = rd.GetInts();
  return r;
}

void PutResponse(ByteWriter& w, const Response& r) {
  w.PutString(r.name);
  w.Put<uint8_t>(static_cast<uint8_t>(r.op));
  w.Put<uint8_t>(static_cast<uint8_t>(r.reduce_op));
  w.Put<uint8_t>(static_cast<uint8_t>(r.dtype));
  w.Put<uint8_t>(static_cast<uint8_t>(r.out_dtype));
  w.Put<uint8_t>(r.on_cuda ? 1 : 0);
  w.PutInts(std::vector<int64_t>(r.devices.begin(), r.devices.end()));
  w.Put<int32_t>(r.root);
  w.Put<double>(r.prescale);
  w.Put<double>(r.postscale);
  w.PutInts(r.shape);
  w.PutInts(r.first_dims);
  w.PutInts(r.splits);
  w.PutString(r.error);
}

Response GetResponse(ByteReader& rd) {
  Response r;
  r.name = rd.GetString();
  r.op = static_cast<OpType>(rd.Get<uint8_t>());
  r.reduce_op = static_cast<ReduceOp>(rd.Get<uint8_t>());
  r.dtype = static_cast<DataType>(rd.Get<uint8_t>());
  r.out_dtype = static_cast<DataType>(rd.Get<uint8_t>());
  r.on_cuda = rd.Get<uint8_t>() != 0;
  const auto devices = rd.GetInts();
  r.devices.assign(devices.begin(), devices.end());
  r.root = rd.Get<int32_t>();
  r.prescale = rd.Get<double>();
  r.postscale = rd.Get<double>();
  r.shape = rd.GetInts();
  r.first_dims = rd.GetInts();
  r.splits = rd.GetInts();
  r.error = rd.GetString();
  return r;
}

template <typename T, typename Get>
bool ParseList(const uint8_t* data, size_t size, std::vector<T>* out, Get get) {
  ByteReader rd(data, size);
  auto n = rd.Get<uint32_t>();
  for (uint32_t i = 0; i < n && rd.ok(); ++i) out->push_back(get(rd));
  return rd.ok();
}

// Allgather and alltoall: dims past 0 as negotiated, and dim 0 as this rank's.
bool SameTrailingShape(const Request& q, const Response& r) {
  return !q.shape.empty() && q.shape.size() == r.shape.size() &&
         std::equal(q.shape.begin() + 1, q.shape.end(), r.shape.begin() + 1) &&
         q.rank < static_cast<int32_t>(r.first_dims.size()) && r.first_dims[q.rank] == q.shape[0];
}

}  // namespace

std::string RankList(const std::vector<int>& ranks) {
  return ShapeString(std::vector<int64_t>(ranks.begin(), ranks.end()));
}

std::string MissingJoinedError(const std::string& name, OpType op, const std::vector<int>& missing) {
  return "The " + std::string(OpTypeName(op)) + " of tensor '" + name + "' cannot run: ranks " + RankList(missing) +
         " have called hvd.join() without submitting it. While ranks have joined, only allreduce works without "
         "them (they contribute zeros); submit other collectives on every rank before it joins.";
}

bool Response::Matches(const Request& q) const {
  if (!ok() || q.name != name || q.op != op || q.dtype != dtype || q.out_dtype != out_dtype ||
      q.on_cuda() != on_cuda) {
    return false;
  }
  // A tensor moved to another device pairs devices anew: negotiate it again.
  if (on_cuda && (q.rank >= static_cast<int32_t>(devices.size()) || devices[q.rank] != q.device)) return false;
  switch (op) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
      return q.reduce_op == reduce_op && q.prescale == prescale && q.postscale == postscale &&
             q.shape == shape;
    case OpType::kBroadcast:
      return q.root == root && q.shape == shape;
    case OpType::kAllgather:
      return SameTrailingShape(q, *this);
    case OpType::kAlltoall: {
      // A hit needs this rank's splits unchanged: they are this rank's row.
      const size_t n = first_dims.size();
      return SameTrailingShape(q, *this) && q.splits.size() == n &&
             std::equal(q.splits.begin(), q.splits.end(), splits.begin() + q.rank * n);
    }
    case OpType::kJoin:
      return false;
  }
  return false;
}

Response MakeResponse(const std::vector<Request>& reqs, const std::vector<int>& missing_joined,
                      const SetScope& scope) {
  const Request& r0 = reqs[0];
  Response resp;
  resp.name = r0.name;
  resp.op = r0.op;
  resp.reduce_op = r0.reduce_op;
  resp.dtype = r0.dtype;
  resp.out_dtype = r0.out_dtype;
  resp.on_cuda = r0.on_cuda();
  resp.root = r0.root;
  resp.prescale = r0.prescale;
  resp.postscale = r0.postscale;
  resp.shape = r0.shape;
  // Only an allreduce can go without ranks (see [Note: join]); the others are
  // checked as every rank's, so the splits check counts them all.
  resp.error = !missing_joined.empty() && r0.op != OpType::kAllreduce
                   ? MissingJoinedError(r0.name, r0.op, missing_joined)
                   : CheckAgreement(reqs, scope);
  if (!resp.ok()) return resp;
  if (resp.on_cuda) {
    resp.devices.assign(reqs.size() + missing_joined.size(), -1);
    for (const auto& r : reqs)
      if (r.rank >= 0 && r.rank < static_cast<int32_t>(resp.devices.size())) resp.devices[r.rank] = r.device;
  }
  if (r0.op == OpType::kAllgather || r0.op == OpType::kAlltoall) {
    for (const auto& r : reqs) resp.first_dims.push_back(r.shape.empty() ? 1 : r.shape[0]);
  }
  if (r0.op == OpType::kAlltoall) {
    for (const auto& r : reqs) resp.splits.insert(resp.splits.end(), r.splits.begin(), r.splits.end());
  }
  return resp;
}

void SerializeRequests(const std::vector<Request>& reqs, std::vector<uint8_t>* out) {
  ByteWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(reqs.size()));
  for (const auto& r : reqs) PutRequest(w, r);
  *out = std::move(w.bytes());
}

bool ParseRequests(const uint8_t* data, size_t size, std::vector<Request>* out) {
  return ParseList(data, size, out, GetRequest);
}

void SerializeResponses(const std::vector<Response>& resps, std::vector<uint8_t>* out) {
  ByteWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(resps.size()));
  for (const auto& r : resps) PutResponse(w, r);
  *out = std::move(w.bytes());
}

bool ParseResponses(const uint8_t* data, size_t size, std::vector<Response>* out) {
  return ParseList(data, size, out, GetResponse);
}

}  // namespace hvdz
