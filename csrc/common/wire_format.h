// Minimal little-endian byte writer/reader for control-plane messages. All ranks
// run the same binary, so PODs are copied as they are.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace hvdz {

class ByteWriter {
 public:
  template <typename T>
  void Put(T v) {
    static_assert(std::is_trivially_copyable<T>::value, "POD only");
    auto n = buf_.size();
    buf_.resize(n + sizeof(T));
    std::memcpy(buf_.data() + n, &v, sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  void PutInts(const std::vector<int64_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (auto x : v) Put<int64_t>(x);
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

// Reading past the end sets ok() to false instead of reading garbage.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  template <typename T>
  T Get() {
    T v{};
    if (static_cast<size_t>(end_ - p_) < sizeof(T)) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string GetString() {
    auto n = Get<uint32_t>();
    if (!ok_ || static_cast<size_t>(end_ - p_) < n) {
      ok_ = false;
      return {};
    }
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  std::vector<int64_t> GetInts() {
    auto n = Get<uint32_t>();
    std::vector<int64_t> v;
    for (uint32_t i = 0; i < n && ok_; ++i) v.push_back(Get<int64_t>());
    return v;
  }
  bool ok() const { return ok_; }
  bool done() const { return p_ == end_; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

}  // namespace hvdz
