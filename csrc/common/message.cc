#include "common/message.h"

#include <algorithm>
#include <sstream>

#include "common/wire_format.h"

namespace hvdz {
namespace {

std::string DeviceKind(const Request& r) { return r.on_cuda() ? "cuda" : "cpu"; }

// Formats "rank 0 has A, rank k has B" for the first rank whose value differs.
template <typename Get>
std::string FirstMismatch(const std::vector<Request>& reqs, const char* what, Get get) {
  auto ref = get(reqs[0]);
  for (size_t r = 1; r < reqs.size(); ++r) {
    auto v = get(reqs[r]);
    if (v != ref) {
      std::ostringstream os;
      os << "Mismatched " << what << " for tensor '" << reqs[0].name << "': rank 0 has " << ref
         << ", rank " << r << " has " << v << ". Every rank must submit this tensor with the same "
         << what << ".";
      return os.str();
    }
  }
  return {};
}

std::string CheckAgreement(const std::vector<Request>& reqs) {
  std::string e;
  if (!(e = FirstMismatch(reqs, "op", [](const Request& r) { return std::string(OpTypeName(r.op)); })).empty()) return e;
  if (!(e = FirstMismatch(reqs, "dtype", [](const Request& r) { return std::string(DataTypeName(r.dtype)); })).empty()) return e;
  if (!(e = FirstMismatch(reqs, "output dtype", [](const Request& r) { return std::string(DataTypeName(r.out_dtype)); })).empty()) return e;
  if (!(e = FirstMismatch(reqs, "device kind", DeviceKind)).empty()) return e;
  const OpType op = reqs[0].op;
  if (op == OpType::kAllreduce || op == OpType::kReducescatter) {
    if (!(e = FirstMismatch(reqs, "reduce op", [](const Request& r) { return std::string(ReduceOpName(r.reduce_op)); })).empty()) return e;
    if (!(e = FirstMismatch(reqs, "prescale factor", [](const Request& r) { return r.prescale; })).empty()) return e;
    if (!(e = FirstMismatch(reqs, "postscale factor", [](const Request& r) { return r.postscale; })).empty()) return e;
  }
  if (op == OpType::kBroadcast) {
    if (!(e = FirstMismatch(reqs, "root rank", [](const Request& r) { return r.root; })).empty()) return e;
  }
  if (op == OpType::kAllgather) {
    // Dim 0 may differ between ranks; the rest must not.
    return FirstMismatch(reqs, "shape past dim 0", [](const Request& r) {
      if (r.shape.empty()) return std::string("a scalar");
      return ShapeString(std::vector<int64_t>(r.shape.begin() + 1, r.shape.end()));
    });
  }
  return FirstMismatch(reqs, "shape", [](const Request& r) { return ShapeString(r.shape); });
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
  return r;
}

void PutResponse(ByteWriter& w, const Response& r) {
  w.PutString(r.name);
  w.Put<uint8_t>(static_cast<uint8_t>(r.op));
  w.Put<uint8_t>(static_cast<uint8_t>(r.reduce_op));
  w.Put<uint8_t>(static_cast<uint8_t>(r.dtype));
  w.Put<uint8_t>(static_cast<uint8_t>(r.out_dtype));
  w.Put<uint8_t>(r.on_cuda ? 1 : 0);
  w.Put<int32_t>(r.root);
  w.Put<double>(r.prescale);
  w.Put<double>(r.postscale);
  w.PutInts(r.shape);
  w.PutInts(r.first_dims);
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
  r.root = rd.Get<int32_t>();
  r.prescale = rd.Get<double>();
  r.postscale = rd.Get<double>();
  r.shape = rd.GetInts();
  r.first_dims = rd.GetInts();
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

}  // namespace

bool Response::Matches(const Request& q) const {
  if (!ok() || q.name != name || q.op != op || q.dtype != dtype || q.out_dtype != out_dtype ||
      q.on_cuda() != on_cuda) {
    return false;
  }
  switch (op) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
      return q.reduce_op == reduce_op && q.prescale == prescale && q.postscale == postscale &&
             q.shape == shape;
    case OpType::kBroadcast:
      return q.root == root && q.shape == shape;
    case OpType::kAllgather:
      return !q.shape.empty() && q.shape.size() == shape.size() &&
             std::equal(q.shape.begin() + 1, q.shape.end(), shape.begin() + 1) &&
             q.rank < static_cast<int32_t>(first_dims.size()) && first_dims[q.rank] == q.shape[0];
  }
  return false;
}

Response MakeResponse(const std::vector<Request>& reqs) {
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
  resp.error = CheckAgreement(reqs);
  if (resp.ok() && r0.op == OpType::kAllgather) {
    for (const auto& r : reqs) resp.first_dims.push_back(r.shape.empty() ? 1 : r.shape[0]);
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
