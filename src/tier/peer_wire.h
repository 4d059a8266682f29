// The peer tier's wire (docs/FORMAT.md "Peer wire format"): TCP sockets with
// timeouts on every blocking call, and frames whose header is checked (magic,
// version, type, a length bounded per type, the header's own crc32c) before a
// byte of payload is allocated or read; the payload's crc32c is checked
// before it is used. Little endian throughout.
//
//   frame   = header(24) payload(length)
//   header  = magic u32 "NSPW" | version u16 | type u16 | length u64 |
//             payload crc32c u32 | header crc32c u32 (of the 20 bytes before)
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"
#include "tier/peer.h"

namespace nonstop::peer::wire {

inline constexpr uint32_t kMagic = 0x5750534E;  // "NSPW"
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 24;
inline constexpr uint64_t kMaxDataFrame = 16ull << 20;
inline constexpr uint64_t kDataPiece = 4ull << 20;  // what a sender puts in one DATA frame
inline constexpr uint64_t kMaxSmallFrame = 64ull << 10;
inline constexpr uint64_t kMaxListed = 1 << 16;
// A tensor table: its metadata (at most 64 MiB) plus the entries and crcs.
inline constexpr uint64_t kMaxTableFrame = (64ull << 20) + (32ull << 20);

enum class Type : uint16_t {
  kPush = 1,     // c->s: job, tensor table; a reply, then DATA..., END, a reply
  kData = 2,     // either way: the next bytes of the data region
  kEnd = 3,      // either way: the data region is complete
  kList = 4,     // c->s: job; answered by LISTING
  kFetch = 5,    // c->s: job, source rank, step (or newest); TABLE, DATA..., END
  kReply = 6,    // s->c: status code, outcome, one-line message
  kListing = 7,  // s->c: the replicas held
  kTable = 8,    // s->c: the tensor table of the replica fetched
};
// The most payload bytes of a frame of type `t` (0: no such type).
uint64_t MaxPayload(uint16_t t);

// A connected TCP socket (owned). Every send and receive has the timeout
// given at connect/accept; a timeout or a closed peer is an IOError.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_.exchange(-1)), peer_(std::move(o.peer_)) {}
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { Close(); }

  bool valid() const { return fd_.load() >= 0; }
  int fd() const { return fd_.load(); }
  const std::string& peer() const { return peer_; }
  Status SetTimeout(double seconds);
  Status SendAll(const void* p, size_t n);
  Status RecvAll(void* p, size_t n);
  // Waits up to `seconds` for bytes (or the peer's close) to read: false when none came.
  bool WaitReadable(double seconds);
  // Ends both directions: a blocked call in another thread returns.
  void Shutdown();
  void Close();

 private:
  std::atomic<int> fd_{-1};
  std::string peer_;
};

// A connection to `endpoint` within connect_timeout_s, with io_timeout_s on
// every later call. IOError when it cannot be reached.
Result<Socket> Connect(const std::string& endpoint, double connect_timeout_s, double io_timeout_s);

// A listening socket on host:port (port 0: an ephemeral one, in *bound).
Result<Socket> Listen(const std::string& host, uint16_t port, uint16_t* bound);

struct Frame {
  uint16_t type = 0;
  std::string payload;
};

// Sends one frame whose payload is `a` then `b` (either may be empty).
Status SendFrame(Socket& s, Type type, std::string_view a, std::string_view b = {});
// Receives one frame into *f (its payload buffer reused). Corruption for a
// header that is not one (magic, version, type, length over MaxPayload,
// header crc) -- before the payload is read -- and for a payload crc
// mismatch; IOError for a cut or a timeout.
Status RecvFrame(Socket& s, Frame* f);

// Payload encoding.
class Out {
 public:
  Out& U8(uint8_t v) { return Raw(&v, 1); }
  Out& U16(uint16_t v) { return Raw(&v, 2); }
  Out& U32(uint32_t v) { return Raw(&v, 4); }
  Out& U64(uint64_t v) { return Raw(&v, 8); }
  Out& I64(int64_t v) { return Raw(&v, 8); }
  Out& Str16(std::string_view v);  // u16 length, bytes
  Out& Bytes(std::string_view v) { return Raw(v.data(), v.size()); }
  const std::string& str() const { return s_; }

 private:
  Out& Raw(const void* p, size_t n);  // little endian hosts only (static_assert in .cc)
  std::string s_;
};

class In {
 public:
  explicit In(std::string_view s) : s_(s) {}
  uint8_t U8() { return Get<uint8_t>(); }
  uint16_t U16() { return Get<uint16_t>(); }
  uint32_t U32() { return Get<uint32_t>(); }
  uint64_t U64() { return Get<uint64_t>(); }
  int64_t I64() { return Get<int64_t>(); }
  std::string Str16(size_t max);
  std::string_view Rest() {
    std::string_view r = s_.substr(pos_);
    pos_ = s_.size();
    return r;
  }
  bool ok() const { return ok_; }
  bool done() const { return ok_ && pos_ == s_.size(); }

 private:
  template <typename T>
  T Get() {
    T v{};
    if (!ok_ || s_.size() - pos_ < sizeof(T)) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view s_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// The tensor table of `info` as PUSH and TABLE frames carry it (the slot
// file's own table encoding, store/format.h).
std::vector<uint8_t> EncodeCheckpointTable(const CheckpointInfo& info);

// A REPLY payload: `s` (OK or an error) and, when OK, an outcome.
std::string EncodeReply(const Status& s, uint32_t outcome);
// A REPLY payload back: the error it carries, or OK and *outcome.
Status DecodeReply(std::string_view payload, uint32_t* outcome, const std::string& from);

}  // namespace nonstop::peer::wire
