// AioFile: direct-I/O round trips through io_uring, transfers split into more
// requests than the queue holds, short reads, byte counters and refusals.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "offload/aio_file.h"

namespace hvdz {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char, FreeDeleter>;

Buffer Aligned(size_t n) { return Buffer(static_cast<char*>(std::aligned_alloc(4096, n))); }

void Fill(char* p, size_t n, unsigned seed) {
  std::mt19937 g(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>(g());
}

class AioFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base ? base : "/tmp") + "/hvdz-aio-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << strerror(errno);
    dir_ = tmpl;
    path_ = dir_ + "/f.swp";
  }
  void TearDown() override {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  std::unique_ptr<AioFile> Open(int64_t nbytes, int depth, int64_t request_bytes) {
    std::unique_ptr<AioFile> f;
    AioOptions o;
    o.queue_depth = depth;
    o.request_bytes = request_bytes;
    Status s = AioFile::Open(path_, nbytes, o, &f);
    EXPECT_TRUE(s.ok()) << s.reason();
    return f;
  }
  std::string dir_, path_;
};

TEST_F(AioFileTest, RoundTripsAtSeveralSizesAndOffsets) {
  // 8 KiB requests and a queue of 2: the larger transfers wait in the queue.
  const int64_t kFile = 6 << 20;
  auto f = Open(kFile - 100, /*depth=*/2, /*request_bytes=*/8192);
  ASSERT_TRUE(f);
  EXPECT_GE(f->alignment(), 4096);
  EXPECT_EQ(f->size() % f->alignment(), 0);
  EXPECT_GE(f->size(), kFile - 100);
  EXPECT_EQ(f->request_bytes() % f->alignment(), 0);
  const int64_t a = f->alignment();
  struct Piece {
    int64_t offset, len;
  };
  const std::vector<Piece> pieces = {{0, a}, {a, 3 * a}, {8 * a, 40 * a + a}, {kFile - (5 << 20), 5 << 20}};
  int64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    Buffer src = Aligned(p.len), dst = Aligned(p.len);
    Fill(src.get(), p.len, 7 + i);
    std::memset(dst.get(), 0, p.len);
    int64_t w, r;
    ASSERT_TRUE(f->Write(src.get(), p.len, p.offset, &w).ok());
    Status s = f->Wait(w);
    ASSERT_TRUE(s.ok()) << s.reason();
    ASSERT_TRUE(f->Read(dst.get(), p.len, p.offset, &r).ok());
    s = f->Wait(r);
    ASSERT_TRUE(s.ok()) << s.reason();
    EXPECT_EQ(std::memcmp(src.get(), dst.get(), p.len), 0) << "piece " << i;
    total += p.len;
  }
  EXPECT_EQ(f->bytes_written(), total);
  EXPECT_EQ(f->bytes_read(), total);
  EXPECT_EQ(f->transfers_in_flight(), 0);
}

TEST_F(AioFileTest, ManyTransfersInFlightAreWaitedInAnyOrder) {
  const int kN = 6;
  const int64_t kLen = 64 << 10;
  auto f = Open(kN * kLen, /*depth=*/3, /*request_bytes=*/4096);
  ASSERT_TRUE(f);
  std::vector<Buffer> src, dst;
  std::vector<int64_t> tickets(kN);
  for (int i = 0; i < kN; ++i) {
    src.push_back(Aligned(kLen));
    Fill(src.back().get(), kLen, 100 + i);
    ASSERT_TRUE(f->Write(src.back().get(), kLen, i * kLen, &tickets[i]).ok());
  }
  EXPECT_EQ(f->transfers_in_flight(), kN);
  for (int i = kN - 1; i >= 0; --i) ASSERT_TRUE(f->Wait(tickets[i]).ok());
  for (int i = 0; i < kN; ++i) {
    dst.push_back(Aligned(kLen));
    ASSERT_TRUE(f->Read(dst.back().get(), kLen, i * kLen, &tickets[i]).ok());
  }
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(f->Wait(tickets[i]).ok());
    EXPECT_EQ(std::memcmp(src[i].get(), dst[i].get(), kLen), 0) << "transfer " << i;
  }
  EXPECT_EQ(f->bytes_written(), kN * kLen);
  EXPECT_EQ(f->bytes_read(), kN * kLen);
}

TEST_F(AioFileTest, WaitUntilReturnsNotDoneThenDone) {
  const int64_t kLen = 4 << 20;
  auto f = Open(kLen, 1, 4096);
  ASSERT_TRUE(f);
  Buffer b = Aligned(kLen);
  Fill(b.get(), kLen, 3);
  int64_t t;
  ASSERT_TRUE(f->Write(b.get(), kLen, 0, &t).ok());
  bool done = true;
  // A deadline already past: the 1024 requests, one at a time, cannot be done.
  Status s = f->WaitUntil(t, std::chrono::steady_clock::now() - std::chrono::seconds(1), &done);
  EXPECT_TRUE(s.ok());
  EXPECT_FALSE(done);
  s = f->WaitUntil(t, std::chrono::steady_clock::now() + std::chrono::seconds(60), &done);
  EXPECT_TRUE(s.ok()) << s.reason();
  EXPECT_TRUE(done);
  s = f->Wait(t);  // forgotten once done
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("already waited"), std::string::npos) << s.reason();
}

TEST_F(AioFileTest, ContentsSurviveCloseAndReopen) {
  const int64_t kLen = 256 << 10;
  Buffer src = Aligned(kLen), dst = Aligned(kLen);
  Fill(src.get(), kLen, 11);
  {
    auto f = Open(kLen, 4, 1 << 20);
    ASSERT_TRUE(f);
    int64_t t;
    ASSERT_TRUE(f->Write(src.get(), kLen, 0, &t).ok());
    ASSERT_TRUE(f->Close().ok());  // waits for the write it was never asked to wait for
    EXPECT_EQ(f->bytes_written(), kLen);
    EXPECT_EQ(f->Write(src.get(), kLen, 0, &t).type(), StatusType::kPreconditionError);
  }
  auto f = Open(kLen, 4, 1 << 20);
  ASSERT_TRUE(f);
  int64_t t;
  ASSERT_TRUE(f->Read(dst.get(), kLen, 0, &t).ok());
  ASSERT_TRUE(f->Wait(t).ok());
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), kLen), 0);
}

TEST_F(AioFileTest, ShortReadContinuesThenReportsTheEndOfTheFile) {
  const int64_t kLen = 64 << 10, kKept = 40 << 10;
  auto f = Open(kLen, 2, 1 << 20);
  ASSERT_TRUE(f);
  Buffer src = Aligned(kLen), dst = Aligned(kLen);
  Fill(src.get(), kLen, 5);
  int64_t t;
  ASSERT_TRUE(f->Write(src.get(), kLen, 0, &t).ok());
  ASSERT_TRUE(f->Wait(t).ok());
  ASSERT_EQ(truncate(path_.c_str(), kKept), 0);  // someone else cuts the file short
  ASSERT_TRUE(f->Read(dst.get(), kLen, 0, &t).ok());
  Status s = f->Wait(t);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.reason().find("Reading " + std::to_string(kLen - kKept) + " bytes at offset " + std::to_string(kKept)),
            std::string::npos)
      << s.reason();
  EXPECT_NE(s.reason().find("the file ends there"), std::string::npos) << s.reason();
  EXPECT_NE(s.reason().find(path_), std::string::npos) << s.reason();
  EXPECT_EQ(f->bytes_read(), kKept);  // the short first answer, continued from there
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), kKept), 0);
}

TEST_F(AioFileTest, RefusesUnalignedBuffersOffsetsLengthsAndRangesPastTheEnd) {
  auto f = Open(1 << 20, 2, 1 << 20);
  ASSERT_TRUE(f);
  Buffer b = Aligned(2 << 20);
  int64_t t;
  auto expect = [&](const Status& s, const char* words) {
    EXPECT_EQ(s.type(), StatusType::kInvalidArgument) << s.reason();
    EXPECT_NE(s.reason().find(words), std::string::npos) << s.reason();
    EXPECT_NE(s.reason().find(path_), std::string::npos) << s.reason();
  };
  expect(f->Write(b.get() + 512, 4096, 0, &t), "buffer address is not a multiple of");
  expect(f->Read(b.get(), 4000, 0, &t), "length 4000 is not");
  expect(f->Read(b.get(), 4096, 100, &t), "offset 100 is not");
  expect(f->Write(b.get(), 4096, 1 << 20, &t), "end past the file");
  EXPECT_EQ(f->transfers_in_flight(), 0);
  EXPECT_EQ(f->bytes_written() + f->bytes_read(), 0);
}

TEST_F(AioFileTest, OpenErrorsNameTheFileAndTheReason) {
  std::unique_ptr<AioFile> f;
  Status s = AioFile::Open(dir_ + "/missing/f.swp", 4096, AioOptions(), &f);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.reason().find(dir_ + "/missing/f.swp"), std::string::npos) << s.reason();
  EXPECT_NE(s.reason().find("No such file or directory"), std::string::npos) << s.reason();
  AioOptions bad;
  bad.queue_depth = 0;
  s = AioFile::Open(path_, 4096, bad, &f);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("queue depth"), std::string::npos) << s.reason();
  AioOptions huge;
  huge.request_bytes = int64_t{1} << 40;
  s = AioFile::Open(path_, 4096, huge, &f);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("request size"), std::string::npos) << s.reason();
}

}  // namespace
}  // namespace hvdz
