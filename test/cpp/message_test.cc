#include <gtest/gtest.h>

#include "common/message.h"

namespace hvdz {
namespace {

TEST(Message, RequestsAndResponsesRoundTrip) {
  Request q;
  q.name = "layer.0.weight";
  q.rank = 2;
  q.op = OpType::kReducescatter;
  q.reduce_op = ReduceOp::kMax;
  q.dtype = DataType::kBFloat16;
  q.out_dtype = DataType::kBFloat16;
  q.device = 1;
  q.prescale = 0.5;
  q.shape = {7, 3};
  std::vector<uint8_t> bytes;
  SerializeRequests({q, q}, &bytes);
  std::vector<Request> back;
  ASSERT_TRUE(ParseRequests(bytes.data(), bytes.size(), &back));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].name, q.name);
  EXPECT_EQ(back[1].shape, q.shape);
  EXPECT_EQ(back[1].prescale, 0.5);
  EXPECT_EQ(back[1].reduce_op, ReduceOp::kMax);

  Response r = MakeResponse({q, q});
  r.error = "x";
  SerializeResponses({r}, &bytes);
  std::vector<Response> rb;
  ASSERT_TRUE(ParseResponses(bytes.data(), bytes.size(), &rb));
  EXPECT_EQ(rb[0].error, "x");
  EXPECT_TRUE(rb[0].on_cuda);
}

TEST(Message, ACudaResponseNamesEveryRanksDevice) {
  Request a;
  a.name = "fc2.weight";
  a.op = OpType::kAllreduce;
  a.device = 1;
  a.shape = {4};
  Request b = a;
  b.rank = 1;
  b.device = 3;
  Response r = MakeResponse({a, b});
  EXPECT_EQ(r.devices, (std::vector<int32_t>{1, 3}));
  std::vector<uint8_t> bytes;
  SerializeResponses({r}, &bytes);
  std::vector<Response> back;
  ASSERT_TRUE(ParseResponses(bytes.data(), bytes.size(), &back));
  EXPECT_EQ(back[0].devices, r.devices);
  EXPECT_TRUE(r.Matches(b));
  b.device = 2;  // moved to another GPU: negotiated again
  EXPECT_FALSE(r.Matches(b));
  // A joined rank that did not submit it has no device.
  Response j = MakeResponse({b}, {0});
  EXPECT_EQ(j.devices, (std::vector<int32_t>{-1, 2}));
}

TEST(Message, TruncatedBytesAreRejected) {
  Request q;
  q.name = "abc";
  std::vector<uint8_t> bytes;
  SerializeRequests({q}, &bytes);
  std::vector<Request> back;
  EXPECT_FALSE(ParseRequests(bytes.data(), bytes.size() - 3, &back));
}

}  // namespace
}  // namespace hvdz
