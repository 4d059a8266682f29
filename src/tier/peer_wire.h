// The peer tier's wire (docs/FORMAT.md "Peer wire format"): TCP sockets with
// timeouts on every blocking call, and frames whose header is checked (magic,
// version, type, a length bounded per type and per connection state, the
// header's own crc32c) before a byte of payload is allocated or read; the
// payload's crc32c is checked before it is used. Little endian throughout.
//
//   frame   = header(24) payload(length) [mac(32), DATA: tag(16): after the handshake]
//   header  = magic u32 "NSPW" | version u16 | type u16 | length u64 |
//             payload crc32c u32 | header crc32c u32 (of the 20 bytes before)
//
// Every connection starts with a mutual challenge-response (ClientHandshake /
// ServerHandshake) over the job's peer secret: both sides send a random
// nonce and prove the secret with HMAC-SHA256 over both nonces, the
// direction, the job and the protocol version. Before it completes only the
// handshake's tiny frames are accepted (kMaxPreAuthFrame); afterwards every
// frame carries HMAC-SHA256(session key of its direction, sequence number |
// header | payload) -- DATA frames (the bulk bytes) a 16-byte Carter-Wegman
// tag instead: GHASH over (header, payload) under a hash key of the session
// and direction, XOR a one-time pad HMAC(session key, "pad" | sequence
// number) --, so a frame can be neither forged, nor replayed, nor moved to
// another connection or direction (docs/TIERS.md "Trust").
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"
#include "tier/ghash.h"
#include "tier/peer.h"
#include "tier/sha256.h"

namespace nonstop::peer::wire {

inline constexpr uint32_t kMagic = 0x5750534E;  // "NSPW"
// 2: the handshake and the per-frame MAC; 3: DATA frames' Carter-Wegman tag;
// 4: FETCH and FETCH_OWN carry the world size, LIST_DISK and FETCH_DISK.
inline constexpr uint16_t kVersion = 4;
inline constexpr size_t kHeaderBytes = 24;
inline constexpr size_t kMacBytes = crypto::kSha256Bytes;  // HMAC-SHA256: every frame but DATA
inline constexpr size_t kDataTagBytes = crypto::kGhashBytes;  // DATA frames' tag
inline constexpr size_t kNonceBytes = 32;
inline constexpr uint64_t kMaxDataFrame = 16ull << 20;
// What a sender puts in one DATA frame: small enough that the sender's
// read, checksum passes and send of a piece, and the receiver's checks and
// write of a frame, overlap finely across the two stages of each side
// (docs/BENCHMARKS.md "Peer tier: receiving into the destination's mapping").
inline constexpr uint64_t kDataPiece = 256ull << 10;
inline constexpr uint64_t kMaxSmallFrame = 64ull << 10;
inline constexpr uint64_t kMaxListed = 1 << 16;
// A tensor table: its metadata (at most 64 MiB) plus the entries and crcs.
inline constexpr uint64_t kMaxTableFrame = (64ull << 20) + (32ull << 20);
// The most payload bytes of any frame before the handshake completed.
inline constexpr uint64_t kMaxPreAuthFrame = 4096 + 8;

// The frame types. A new type: a value here and its row in FrameLimit
// (peer_wire.cc), both states.
enum class Type : uint16_t {
  kPush = 1,     // c->s: job, tensor table; a reply, then DATA..., END, a reply
  kData = 2,     // either way: the next bytes of the data region
  kEnd = 3,      // either way: the data region is complete
  kList = 4,     // c->s: job; answered by LISTING
  kFetch = 5,    // c->s: job, world size, source rank, step (or newest); TABLE, DATA..., END
  kReply = 6,    // s->c: status code, outcome, one-line message (also before auth: a refusal)
  kListing = 7,  // s->c: the replicas held
  kTable = 8,    // s->c: the tensor table of the replica fetched
  // The handshake (before auth, no MAC):
  kHello = 9,       // c->s: job, client nonce
  kChallenge = 10,  // s->c: server nonce, server proof
  kAuth = 11,       // c->s: client proof
  kReady = 12,      // s->c: empty; the client's proof holds: MACs from the next frame on
  // The server's host's own memory segments (reshard from peers' memory),
  // read-only; authenticated like every request. Numbered apart.
  kListOwn = 32,   // c->s: job; answered by LISTING (of the segments served)
  kFetchOwn = 33,  // c->s: job, world size, source rank, step (or newest); TABLE, DATA..., END
  // The server's host's job directory's rank files (reshard after a
  // graceful close), read-only, likewise.
  kListDisk = 34,   // c->s: job; answered by LISTING (of the rank files served)
  kFetchDisk = 35,  // c->s: job, world size, source rank, step (or newest); TABLE, DATA..., END
};
// The most payload bytes of a frame of type `t` on a connection that has
// (`authenticated`) or has not completed the handshake; -1: no such type in
// that state (the frame is refused).
int64_t FrameLimit(uint16_t t, bool authenticated);

// The keys of one authenticated connection, per direction, and the
// sequence numbers of the next frame each way.
struct Session {
  crypto::HmacSha256 send_key, recv_key;
  // DATA frames' hash, keyed per direction from the session key (never sent).
  crypto::Ghash send_hash, recv_hash;
  uint64_t send_seq = 0, recv_seq = 0;
  bool mac_failed = false;  // a received frame's MAC did not hold (the connection is done)
};

// The bytes of the MAC or tag that follow a frame of type `t` after the
// handshake.
inline size_t TagBytes(uint16_t t) {
  return t == static_cast<uint16_t>(Type::kData) ? kDataTagBytes : kMacBytes;
}

// A connected TCP socket (owned). Every send and receive has the timeout
// given at connect/accept; a timeout or a closed peer is an IOError.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  Socket(Socket&& o) noexcept
      : fd_(o.fd_.exchange(-1)), peer_(std::move(o.peer_)), session_(std::move(o.session_)) {}
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { Close(); }

  bool valid() const { return fd_.load() >= 0; }
  // Whether the handshake completed: frames carry MACs.
  bool authenticated() const { return session_ != nullptr; }
  Session* session() { return session_.get(); }
  void SetSession(std::unique_ptr<Session> s) { session_ = std::move(s); }
  int fd() const { return fd_.load(); }
  const std::string& peer() const { return peer_; }
  Status SetTimeout(double seconds);
  // flags: MSG_MORE for a part that more follows at once (a frame header).
  Status SendAll(const void* p, size_t n, int flags = 0);
  // Sends the `n` parts in order with sendmsg (one call for all of them
  // where the socket takes them at once); `iov` is consumed.
  Status SendAllV(::iovec* iov, int n);
  Status RecvAll(void* p, size_t n);
  // Waits up to `seconds` for bytes (or the peer's close) to read: false when none came.
  bool WaitReadable(double seconds);
  // Ends both directions: a blocked call in another thread returns.
  void Shutdown();
  void Close();

 private:
  std::atomic<int> fd_{-1};
  std::string peer_;
  std::unique_ptr<Session> session_;  // set by the handshake
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

// Sends one frame whose payload is `a` then `b` (either may be empty); on an
// authenticated socket with its MAC.
Status SendFrame(Socket& s, Type type, std::string_view a, std::string_view b = {});
// Sends one DATA frame whose payload's crc32c the caller already has (the
// Crc32cCombine of the chunk crcs it checked while reading it), so the
// payload is not read once more for the header.
// `hash`: DataFrameHash of the same payload and crc on this socket, computed
// ahead (off the sending thread), or null to compute it here.
Status SendDataFrame(Socket& s, std::string_view payload, uint32_t payload_crc,
                     const crypto::Block* hash = nullptr);
// The GHASH part of the tag of a DATA frame of `payload` and `payload_crc`
// on `s` (zero before the handshake): the per-byte part, which needs no
// sequence number. Safe beside a send on another thread.
crypto::Block DataFrameHash(Socket& s, std::string_view payload, uint32_t payload_crc);
// One pass over a DATA payload for both of its checks: the payload is
// taken in blocks of kFuseBytes (the last one shorter), and each block's
// crc32c (the caller's, e.g. its chunk checks) and its GHASH run one after
// the other while the block is in the L1 cache, instead of one whole pass
// over the frame for each (the frame leaves L1 and L2 between them).
inline constexpr size_t kFuseBytes = 32 << 10;
static_assert(kFuseBytes % crypto::kGhashBytes == 0);
// The caller's part of the pass: checks the next block (in order) and sets
// *crc to its crc32c; an error ends the pass.
using BlockCheck = std::function<Status(std::string_view block, uint32_t* crc)>;

// GHASH of a DATA frame's payload as it arrives (from zero, the payload
// zero-padded to whole blocks), joined afterwards with the header (which
// holds the payload's crc32c, known only after the pass): the same value
// as the one-piece hash (GHASH is linear in its running value:
// Ghash::MulPow).
class DataHashRun {
 public:
  explicit DataHashRun(const crypto::Ghash& h) : h_(h) {}
  // The next n bytes of the payload (any n, any alignment).
  void Update(const void* p, size_t n);
  // The hash of the frame whose header is `h` (kHeaderBytes) and whose
  // payload was every byte given to Update.
  crypto::Block Final(const uint8_t* h) const;
  uint64_t bytes() const { return bytes_; }

 private:
  const crypto::Ghash& h_;
  crypto::Gf128 y_;
  uint64_t bytes_ = 0, blocks_ = 0;  // payload bytes so far; whole 16-byte blocks hashed
  uint8_t part_[crypto::kGhashBytes] = {};  // a block begun (bytes_ % 16 of them)
};

// The sender's pass over a DATA payload (one pass, kFuseBytes at a time):
// `check` on each block, then its GHASH. *crc: the payload's crc32c (the
// blocks' combined); *hash: DataFrameHash(s, payload, *crc), with no second
// pass over the bytes. check's first error is returned.
Status DataFrameChecks(Socket& s, std::string_view payload, const BlockCheck& check, uint32_t* crc,
                       crypto::Block* hash);

// Receives one frame into *f (its payload buffer reused). Corruption for a
// header that is not one (magic, version, a type or a length over
// FrameLimit for the socket's state, header crc) -- before the payload is
// read or allocated --, for a MAC that does not hold (authenticated
// sockets) and for a payload crc mismatch; IOError for a cut or a timeout.
// With `check` (the receiver of a data region: its chunk checks), a DATA
// frame's payload is received kFuseBytes at a time, and each block goes
// through `check` (in order) and the tag's GHASH while it is in cache --
// one pass for both checks --; the blocks' combined crc32c is compared with
// the header's. check's error is returned only once the frame's MAC held
// (a damaged frame is a MAC mismatch, with or without `check`). Other
// types are received as without it.
Status RecvFrame(Socket& s, Frame* f, const BlockCheck& check = nullptr);

// InvalidArgument unless `secret` has kMinSecretBytes..kMaxSecretBytes bytes.
Status CheckSecret(const std::string& secret);

// The handshake, client side: HELLO, CHALLENGE (the server's proof checked),
// AUTH, READY. Afterwards every frame on `s` carries a MAC. `secret`: the
// job's peer secret (kMinSecretBytes..kMaxSecretBytes). FailedPrecondition
// when the server does not prove the secret or refuses this side's proof or
// job (its REPLY's status otherwise); IOError for a cut or a timeout.
Status ClientHandshake(Socket& s, const std::string& job, const std::string& secret);
// The server side: HELLO (the job must be `job`), CHALLENGE, AUTH (checked),
// READY; a refusal is answered with a REPLY saying why and returned (the
// caller closes the connection). Frames before it completes are at most
// kMaxPreAuthFrame bytes.
Status ServerHandshake(Socket& s, const std::string& job, const std::string& secret);

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
