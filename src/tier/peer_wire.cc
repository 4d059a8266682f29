// The peer tier's sockets and frames (peer_wire.h).
#include "tier/peer_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "base/crc32c_combine.h"
#include "nonstop/crc32c.h"
#include "store/format.h"

namespace nonstop::peer::wire {

static_assert(std::endian::native == std::endian::little, "the peer wire is little endian");

int64_t FrameLimit(uint16_t t, bool authenticated) {
  constexpr int64_t kNo = -1;
  const auto after = [&](uint64_t limit) { return authenticated ? static_cast<int64_t>(limit) : kNo; };
  const auto before = [&](uint64_t limit) { return authenticated ? kNo : static_cast<int64_t>(limit); };
  switch (static_cast<Type>(t)) {
    case Type::kPush: return after(2 + kMaxJobBytes + kMaxTableFrame);
    case Type::kTable: return after(kMaxTableFrame);
    case Type::kData: return after(kMaxDataFrame);
    case Type::kEnd: return after(0);
    case Type::kList:
    case Type::kFetch:
    case Type::kListOwn:
    case Type::kFetchOwn:
    case Type::kListDisk:
    case Type::kFetchDisk: return after(kMaxSmallFrame);
    case Type::kReply: return authenticated ? static_cast<int64_t>(kMaxSmallFrame) : kMaxPreAuthFrame;
    case Type::kListing: return after(4 + kMaxListed * 32);
    case Type::kHello: return before(2 + kMaxJobBytes + kNonceBytes);
    case Type::kChallenge: return before(kNonceBytes + kMacBytes);
    case Type::kAuth: return before(kMacBytes);
    case Type::kReady: return before(0);
  }
  return kNo;
}

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

timeval Tv(double seconds) {
  if (!(seconds > 0)) seconds = 1e-3;
  if (seconds > 1e6) seconds = 1e6;
  timeval tv;
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - std::floor(seconds)) * 1e6);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  return tv;
}

Status Resolve(const std::string& host, uint16_t port, bool passive, addrinfo** out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  const std::string p = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), p.c_str(), &hints, out);
  if (rc != 0) {
    return Status::IOError("peer address " + host + ":" + p + ": " + ::gai_strerror(rc));
  }
  return Status::OK();
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    Close();
    fd_.store(o.fd_.exchange(-1));
    peer_ = std::move(o.peer_);
    session_ = std::move(o.session_);
  }
  return *this;
}

Status Socket::SetTimeout(double seconds) {
  const timeval tv = Tv(seconds);
  if (::setsockopt(fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return Status::FromErrno("peer socket timeout", errno);
  }
  return Status::OK();
}

Status Socket::SendAll(const void* p, size_t n, int flags) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd(), c, n, MSG_NOSIGNAL | flags);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return Status::IOError("peer " + peer_ + ": send timed out");
      }
      return Status::FromErrno("peer " + peer_ + ": send", errno);
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

Status Socket::SendAllV(::iovec* iov, int n) {
  while (n > 0 && iov[0].iov_len == 0) {
    ++iov;
    --n;
  }
  while (n > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(n);
    const ssize_t w = ::sendmsg(fd(), &m, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return Status::IOError("peer " + peer_ + ": send timed out");
      }
      return Status::FromErrno("peer " + peer_ + ": send", errno);
    }
    size_t left = static_cast<size_t>(w);
    while (n > 0 && left >= iov[0].iov_len) {
      left -= iov[0].iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov[0].iov_base = static_cast<char*>(iov[0].iov_base) + left;
      iov[0].iov_len -= left;
    }
  }
  return Status::OK();
}

Status Socket::RecvAll(void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd(), c, n, 0);
    if (r == 0) return Status::IOError("peer " + peer_ + " closed the connection");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return Status::IOError("peer " + peer_ + ": receive timed out");
      }
      return Status::FromErrno("peer " + peer_ + ": receive", errno);
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return Status::OK();
}

bool Socket::WaitReadable(double seconds) {
  pollfd pfd{fd(), POLLIN, 0};
  const int rc = ::poll(&pfd, 1, static_cast<int>(std::max(0.0, seconds) * 1000));
  return rc > 0;
}

void Socket::Shutdown() {
  const int f = fd_.load();
  if (f >= 0) ::shutdown(f, SHUT_RDWR);
}

void Socket::Close() {
  const int f = fd_.exchange(-1);
  if (f >= 0) ::close(f);
}

Result<Socket> Connect(const std::string& endpoint, double connect_timeout_s, double io_timeout_s) {
  NONSTOP_ASSIGN_OR_RETURN(Endpoint ep, ParseEndpoint(endpoint));
  addrinfo* ai = nullptr;
  NONSTOP_RETURN_IF_ERROR(Resolve(ep.host, ep.port, false, &ai));
  Status last = Status::IOError("peer " + endpoint + ": no address");
  const int64_t deadline = NowMs() + static_cast<int64_t>(std::max(0.001, connect_timeout_s) * 1000);
  for (addrinfo* a = ai; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last = Status::FromErrno("peer " + endpoint + ": socket", errno);
      continue;
    }
    Socket s(fd, endpoint);
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS) {
      last = Status::FromErrno("peer " + endpoint + ": connect", errno);
      continue;
    }
    if (rc != 0) {
      pollfd pfd{fd, POLLOUT, 0};
      const int64_t left = std::max<int64_t>(0, deadline - NowMs());
      rc = ::poll(&pfd, 1, static_cast<int>(left));
      if (rc == 0) {
        last = Status::IOError("peer " + endpoint + ": connect timed out after " +
                               std::to_string(connect_timeout_s) + " s");
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      if (rc < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
        last = Status::FromErrno("peer " + endpoint + ": connect", err != 0 ? err : errno);
        continue;
      }
    }
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
      last = Status::FromErrno("peer " + endpoint + ": fcntl", errno);
      continue;
    }
    const int one = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    last = s.SetTimeout(io_timeout_s);
    if (!last.ok()) continue;
    ::freeaddrinfo(ai);
    return s;
  }
  ::freeaddrinfo(ai);
  return last;
}

Result<Socket> Listen(const std::string& host, uint16_t port, uint16_t* bound) {
  addrinfo* ai = nullptr;
  NONSTOP_RETURN_IF_ERROR(Resolve(host, port, true, &ai));
  const std::string where = host + ":" + std::to_string(port);
  Status last = Status::IOError("peer listen " + where + ": no address");
  for (addrinfo* a = ai; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last = Status::FromErrno("peer listen " + where + ": socket", errno);
      continue;
    }
    Socket s(fd, where);
    const int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
      last = Status::FromErrno("peer listen " + where, errno);
      continue;
    }
    sockaddr_storage sa{};
    socklen_t len = sizeof(sa);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      last = Status::FromErrno("peer listen " + where + ": getsockname", errno);
      continue;
    }
    *bound = ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
    ::freeaddrinfo(ai);
    return s;
  }
  ::freeaddrinfo(ai);
  return last;
}

namespace {

void EncodeHeader(uint8_t h[kHeaderBytes], uint16_t type, uint64_t len, uint32_t pcrc) {
  const uint32_t magic = kMagic;
  const uint16_t version = kVersion;
  std::memcpy(h, &magic, 4);
  std::memcpy(h + 4, &version, 2);
  std::memcpy(h + 6, &type, 2);
  std::memcpy(h + 8, &len, 8);
  std::memcpy(h + 16, &pcrc, 4);
  const uint32_t hcrc = Crc32c(h, 20);
  std::memcpy(h + 20, &hcrc, 4);
}

// The MAC of frame number `seq` of one direction: over the sequence number,
// the header and the payload.
crypto::Digest FrameMac(const crypto::HmacSha256& key, uint64_t seq, const uint8_t* h,
                        std::string_view a, std::string_view b) {
  crypto::HmacSha256::Run r = key.Begin();
  r.Update(&seq, 8);
  r.Update(h, kHeaderBytes);
  r.Update(a);
  r.Update(b);
  return r.Final();
}

// The tag of DATA frame number `seq` of one direction (Carter-Wegman):
// GHASH_H(header, payload) XOR the first 16 bytes of HMAC(session key,
// "pad" | seq). The pad is a fresh pseudo-random value per frame (seq never
// repeats within a direction); the hash key H is a secret of the session
// and direction (MakeSession). docs/TIERS.md "Trust" has the bound.
crypto::Block DataTag(const crypto::HmacSha256& key, uint64_t seq, const crypto::Block& hash) {
  crypto::HmacSha256::Run r = key.Begin();
  r.Update("pad", 3);
  r.Update(&seq, 8);
  const crypto::Digest pad = r.Final();
  crypto::Block tag = hash;
  for (size_t i = 0; i < tag.size(); ++i) tag[i] ^= pad[i];
  return tag;
}

crypto::Block HashData(const crypto::Ghash& hash, const uint8_t* h, std::string_view payload) {
  return hash.Hash(std::string_view(reinterpret_cast<const char*>(h), kHeaderBytes), payload);
}

}  // namespace

namespace {

// One frame, its payload crc32c given; a DATA frame's hash too when the
// caller computed it ahead (DataFrameHash).
Status SendFrameCrc(Socket& s, Type type, std::string_view a, std::string_view b, uint32_t pcrc,
                    const crypto::Block* data_hash = nullptr) {
  const uint64_t len = a.size() + b.size();
  const uint16_t t = static_cast<uint16_t>(type);
  const int64_t limit = FrameLimit(t, s.authenticated());
  if (limit < 0 || len > static_cast<uint64_t>(limit)) {
    return Status::InvalidArgument("peer frame of type " + std::to_string(t) + " and " +
                                   std::to_string(len) + " bytes is over its limit");
  }
  uint8_t h[kHeaderBytes];
  EncodeHeader(h, t, len, pcrc);
  Session* ss = s.session();
  // The MAC or tag first (it needs only the bytes at hand), then the whole
  // frame with one sendmsg from where its parts lie: the payload is not
  // copied into a frame buffer, and header, payload and tag leave together
  // (TCP_NODELAY would send separate sends alone).
  crypto::Digest mac{};
  size_t mac_len = 0;
  if (ss != nullptr && type == Type::kData) {
    const std::string joined = b.empty() ? std::string() : std::string(a) + std::string(b);
    const crypto::Block hash =
        data_hash != nullptr ? *data_hash : HashData(ss->send_hash, h, b.empty() ? a : joined);
    const crypto::Block tag = DataTag(ss->send_key, ss->send_seq++, hash);
    std::memcpy(mac.data(), tag.data(), tag.size());
    mac_len = tag.size();
  } else if (ss != nullptr) {
    mac = FrameMac(ss->send_key, ss->send_seq++, h, a, b);
    mac_len = mac.size();
  }
  ::iovec iov[4] = {{h, sizeof(h)},
                  {const_cast<char*>(a.data()), a.size()},
                  {const_cast<char*>(b.data()), b.size()},
                  {mac.data(), mac_len}};
  return s.SendAllV(iov, 4);
}

}  // namespace

Status SendFrame(Socket& s, Type type, std::string_view a, std::string_view b) {
  return SendFrameCrc(s, type, a, b, Crc32c(b.data(), b.size(), Crc32c(a.data(), a.size())));
}

Status SendDataFrame(Socket& s, std::string_view payload, uint32_t payload_crc,
                     const crypto::Block* hash) {
  return SendFrameCrc(s, Type::kData, payload, {}, payload_crc, hash);
}

crypto::Block DataFrameHash(Socket& s, std::string_view payload, uint32_t payload_crc) {
  const Session* ss = s.session();
  if (ss == nullptr) return {};
  uint8_t h[kHeaderBytes];
  EncodeHeader(h, static_cast<uint16_t>(Type::kData), payload.size(), payload_crc);
  return HashData(ss->send_hash, h, payload);
}

void DataHashRun::Update(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t fill = bytes_ % crypto::kGhashBytes;
  bytes_ += n;
  if (fill != 0) {
    const size_t take = std::min(n, crypto::kGhashBytes - fill);
    std::memcpy(part_ + fill, p, take);
    p += take;
    n -= take;
    fill += take;
    if (fill < crypto::kGhashBytes) return;
    h_.Blocks(&y_, part_, 1);
    ++blocks_;
  }
  const size_t whole = n / crypto::kGhashBytes;
  h_.Blocks(&y_, p, whole);
  blocks_ += whole;
  std::memcpy(part_, p + whole * crypto::kGhashBytes, n % crypto::kGhashBytes);
}

crypto::Block DataHashRun::Final(const uint8_t* h) const {
  // Hash(A = header, C = payload): the header's blocks from zero, moved
  // past the payload's blocks (times H^m), plus the payload's own GHASH
  // from zero; then the lengths block.
  uint8_t a[2 * crypto::kGhashBytes] = {};
  static_assert(kHeaderBytes <= sizeof(a));
  std::memcpy(a, h, kHeaderBytes);
  crypto::Gf128 y;
  h_.Blocks(&y, a, 2);
  crypto::Gf128 c = y_;
  uint64_t m = blocks_;
  if (const size_t rest = bytes_ % crypto::kGhashBytes; rest != 0) {
    uint8_t last[crypto::kGhashBytes] = {};
    std::memcpy(last, part_, rest);
    h_.Blocks(&c, last, 1);
    ++m;
  }
  y = h_.MulPow(y, m);
  y.hi ^= c.hi;
  y.lo ^= c.lo;
  uint8_t lens[crypto::kGhashBytes];
  const uint64_t abits = kHeaderBytes * 8, cbits = bytes_ * 8;
  for (int i = 0; i < 8; ++i) {
    lens[i] = static_cast<uint8_t>(abits >> (56 - 8 * i));
    lens[8 + i] = static_cast<uint8_t>(cbits >> (56 - 8 * i));
  }
  h_.Blocks(&y, lens, 1);
  crypto::Block out;
  y.Store(out.data());
  return out;
}

Status DataFrameChecks(Socket& s, std::string_view payload, const BlockCheck& check, uint32_t* crc,
                       crypto::Block* hash) {
  const Session* ss = s.session();
  uint32_t all = 0;
  std::optional<DataHashRun> run;
  if (ss != nullptr) run.emplace(ss->send_hash);
  for (size_t off = 0; off < payload.size();) {
    const size_t n = std::min(kFuseBytes, payload.size() - off);
    const std::string_view block = payload.substr(off, n);
    uint32_t c = 0;
    NONSTOP_RETURN_IF_ERROR(check(block, &c));
    all = Crc32cCombine(all, c, n);
    if (run) run->Update(block.data(), n);
    off += n;
  }
  *crc = all;
  if (!run) {
    *hash = {};
  } else {
    uint8_t h[kHeaderBytes];
    EncodeHeader(h, static_cast<uint16_t>(Type::kData), payload.size(), all);
    *hash = run->Final(h);
  }
  return Status::OK();
}

Status RecvFrame(Socket& s, Frame* f, const BlockCheck& check) {
  uint8_t h[kHeaderBytes];
  NONSTOP_RETURN_IF_ERROR(s.RecvAll(h, sizeof(h)));
  uint32_t magic, pcrc, hcrc;
  uint16_t version, type;
  uint64_t len;
  std::memcpy(&magic, h, 4);
  std::memcpy(&version, h + 4, 2);
  std::memcpy(&type, h + 6, 2);
  std::memcpy(&len, h + 8, 8);
  std::memcpy(&pcrc, h + 16, 4);
  std::memcpy(&hcrc, h + 20, 4);
  const std::string from = "peer " + s.peer() + ": ";
  if (magic != kMagic) return Status::Corruption(from + "not a nonstop peer frame (bad magic)");
  if (version != kVersion) {
    return Status::Corruption(from + "peer wire version " + std::to_string(version) +
                              ", this build speaks " + std::to_string(kVersion));
  }
  if (Crc32c(h, 20) != hcrc) return Status::Corruption(from + "frame header checksum mismatch");
  const int64_t max = FrameLimit(type, s.authenticated());
  if (max < 0) {
    return Status::Corruption(from + "frame type " + std::to_string(type) +
                              (s.authenticated() ? " after" : " before") + " the handshake");
  }
  if (len > static_cast<uint64_t>(max)) {
    return Status::Corruption(from + "frame of type " + std::to_string(type) + " claims " +
                              std::to_string(len) + " bytes, over its limit of " +
                              std::to_string(max) +
                              (s.authenticated() ? "" : " before the handshake"));
  }
  f->type = type;
  f->payload.resize(len);
  Session* const ss = s.session();
  if (ss != nullptr && check && type == static_cast<uint16_t>(Type::kData)) {
    // The fused pass (peer_wire.h): each block received, checked and hashed
    // while it is in cache; check's verdict waits for the MAC's.
    DataHashRun run(ss->recv_hash);
    Status checked;
    uint32_t all = 0;
    for (uint64_t off = 0; off < len;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kFuseBytes, len - off));
      char* p = f->payload.data() + off;
      NONSTOP_RETURN_IF_ERROR(s.RecvAll(p, n));
      if (checked.ok()) {
        uint32_t c = 0;
        checked = check(std::string_view(p, n), &c);
        all = Crc32cCombine(all, c, n);
      }
      run.Update(p, n);
      off += n;
    }
    uint8_t got[kDataTagBytes];
    NONSTOP_RETURN_IF_ERROR(s.RecvAll(got, sizeof(got)));
    const crypto::Block want = DataTag(ss->recv_key, ss->recv_seq++, run.Final(h));
    if (!crypto::ConstantTimeEqual(got, want.data(), sizeof(got))) {
      ss->mac_failed = true;
      return Status::Corruption(from + "frame MAC mismatch (forged, replayed, reordered or "
                                "damaged in transit)");
    }
    NONSTOP_RETURN_IF_ERROR(checked);
    if (all != pcrc) return Status::Corruption(from + "frame payload checksum mismatch");
    return Status::OK();
  }
  if (len > 0) NONSTOP_RETURN_IF_ERROR(s.RecvAll(f->payload.data(), len));
  if (ss != nullptr) {
    uint8_t got[kMacBytes];
    const size_t n = TagBytes(type);
    NONSTOP_RETURN_IF_ERROR(s.RecvAll(got, n));
    const uint64_t seq = ss->recv_seq++;
    bool held;
    if (type == static_cast<uint16_t>(Type::kData)) {
      const crypto::Block want = DataTag(ss->recv_key, seq, HashData(ss->recv_hash, h, f->payload));
      held = crypto::ConstantTimeEqual(got, want.data(), n);
    } else {
      const crypto::Digest want = FrameMac(ss->recv_key, seq, h, f->payload, {});
      held = crypto::ConstantTimeEqual(got, want.data(), n);
    }
    if (!held) {
      ss->mac_failed = true;
      return Status::Corruption(from + "frame MAC mismatch (forged, replayed, reordered or "
                                "damaged in transit)");
    }
  }
  if (Crc32c(f->payload.data(), f->payload.size()) != pcrc) {
    return Status::Corruption(from + "frame payload checksum mismatch");
  }
  return Status::OK();
}

namespace {

std::string_view AsView(const crypto::Digest& d) {
  return {reinterpret_cast<const char*>(d.data()), d.size()};
}

// What a proof or a session key is the MAC of: a label (which proof, which
// direction), the protocol version, the job and both nonces.
crypto::Digest Derive(const crypto::HmacSha256& secret, std::string_view label,
                      const std::string& job, std::string_view nc, std::string_view ns) {
  Out o;
  o.Str16("nonstop-peer").Str16(label).U16(kVersion).Str16(job).Bytes(nc).Bytes(ns);
  return secret.Mac(o.str());
}


std::unique_ptr<Session> MakeSession(const crypto::HmacSha256& secret, const std::string& job,
                                     std::string_view nc, std::string_view ns, bool client) {
  const crypto::Digest c2s = Derive(secret, "key client to server", job, nc, ns);
  const crypto::Digest s2c = Derive(secret, "key server to client", job, nc, ns);
  auto ss = std::make_unique<Session>();
  ss->send_key = crypto::HmacSha256(AsView(client ? c2s : s2c));
  ss->recv_key = crypto::HmacSha256(AsView(client ? s2c : c2s));
  // The DATA hash key of a direction: the first 16 bytes of its session
  // key's MAC of a label. The HMAC inputs of one key stay apart by length:
  // this label 22 bytes, a pad's 11, a frame MAC's at least 32.
  ss->send_hash = crypto::Ghash(ss->send_key.Mac("nonstop-peer data hash").data());
  ss->recv_hash = crypto::Ghash(ss->recv_key.Mac("nonstop-peer data hash").data());
  return ss;
}

// A REPLY received where a handshake frame was expected: the refusal it carries.
Status Refusal(const Frame& f, const std::string& from) {
  uint32_t unused = 0;
  Status st = DecodeReply(f.payload, &unused, from);
  if (st.ok()) return Status::Corruption("peer " + from + ": an OK reply in the handshake");
  return st;
}

}  // namespace

Status CheckSecret(const std::string& secret) {
  if (secret.size() < kMinSecretBytes || secret.size() > kMaxSecretBytes) {
    return Status::InvalidArgument("peer tier: the job's peer secret must have " +
                                   std::to_string(kMinSecretBytes) + " to " +
                                   std::to_string(kMaxSecretBytes) + " bytes, got " +
                                   std::to_string(secret.size()));
  }
  return Status::OK();
}

Status ClientHandshake(Socket& s, const std::string& job, const std::string& secret) {
  NONSTOP_RETURN_IF_ERROR(CheckSecret(secret));
  if (s.authenticated()) return Status::OK();
  const crypto::HmacSha256 key(secret);
  std::string nc(kNonceBytes, '\0');
  if (!crypto::RandomBytes(nc.data(), nc.size())) return Status::FromErrno("peer nonce", errno);
  Out hello;
  hello.Str16(job).Bytes(nc);
  NONSTOP_RETURN_IF_ERROR(SendFrame(s, Type::kHello, hello.str()));
  Frame f;
  NONSTOP_RETURN_IF_ERROR(RecvFrame(s, &f));
  if (f.type == static_cast<uint16_t>(Type::kReply)) return Refusal(f, s.peer());
  if (f.type != static_cast<uint16_t>(Type::kChallenge) || f.payload.size() != kNonceBytes + kMacBytes) {
    return Status::Corruption("peer " + s.peer() + ": expected a handshake challenge, got frame type " +
                              std::to_string(f.type));
  }
  const std::string ns = f.payload.substr(0, kNonceBytes);
  const crypto::Digest server_proof = Derive(key, "server proof", job, nc, ns);
  if (!crypto::ConstantTimeEqual(reinterpret_cast<const uint8_t*>(f.payload.data()) + kNonceBytes,
                                 server_proof.data(), kMacBytes)) {
    return Status::FailedPrecondition("peer " + s.peer() +
                                      " failed authentication: it does not prove this job's peer "
                                      "secret (another job's or an impostor's server)");
  }
  const crypto::Digest client_proof = Derive(key, "client proof", job, nc, ns);
  NONSTOP_RETURN_IF_ERROR(SendFrame(s, Type::kAuth, AsView(client_proof)));
  NONSTOP_RETURN_IF_ERROR(RecvFrame(s, &f));
  if (f.type == static_cast<uint16_t>(Type::kReply)) return Refusal(f, s.peer());
  if (f.type != static_cast<uint16_t>(Type::kReady)) {
    return Status::Corruption("peer " + s.peer() + ": expected the end of the handshake, got frame type " +
                              std::to_string(f.type));
  }
  s.SetSession(MakeSession(key, job, nc, ns, /*client=*/true));
  return Status::OK();
}

Status ServerHandshake(Socket& s, const std::string& job, const std::string& secret) {
  NONSTOP_RETURN_IF_ERROR(CheckSecret(secret));
  const auto refuse = [&](const Status& st) {
    (void)SendFrame(s, Type::kReply, EncodeReply(st, 0));
    return st;
  };
  Frame f;
  NONSTOP_RETURN_IF_ERROR(RecvFrame(s, &f));
  if (f.type != static_cast<uint16_t>(Type::kHello)) {
    return refuse(Status::Corruption("peer " + s.peer() + ": frame type " + std::to_string(f.type) +
                                     " before the handshake"));
  }
  In in(f.payload);
  const std::string their_job = in.Str16(kMaxJobBytes);
  const std::string_view rest = in.Rest();
  if (!in.ok() || rest.size() != kNonceBytes) {
    return refuse(Status::Corruption("peer " + s.peer() + ": malformed HELLO"));
  }
  if (their_job != job) {
    return refuse(Status::FailedPrecondition("peer " + s.peer() + " asks for job '" +
                                             their_job.substr(0, 64) +
                                             "': this server holds replicas of another job"));
  }
  const std::string nc(rest);
  const crypto::HmacSha256 key(secret);
  std::string ns(kNonceBytes, '\0');
  if (!crypto::RandomBytes(ns.data(), ns.size())) return refuse(Status::FromErrno("peer nonce", errno));
  const crypto::Digest server_proof = Derive(key, "server proof", job, nc, ns);
  NONSTOP_RETURN_IF_ERROR(SendFrame(s, Type::kChallenge, ns, AsView(server_proof)));
  Status got = RecvFrame(s, &f);
  if (got.code() == StatusCode::kIOError) {
    return got.Annotate("after this server's challenge (a client without this job's peer secret "
                        "leaves there)");
  }
  NONSTOP_RETURN_IF_ERROR(got);
  const crypto::Digest client_proof = Derive(key, "client proof", job, nc, ns);
  if (f.type != static_cast<uint16_t>(Type::kAuth) || f.payload.size() != kMacBytes ||
      !crypto::ConstantTimeEqual(reinterpret_cast<const uint8_t*>(f.payload.data()),
                                 client_proof.data(), kMacBytes)) {
    return refuse(Status::FailedPrecondition(
        "peer " + s.peer() + " failed authentication: it does not prove this job's peer secret"));
  }
  NONSTOP_RETURN_IF_ERROR(SendFrame(s, Type::kReady, {}));
  s.SetSession(MakeSession(key, job, nc, ns, /*client=*/false));
  return Status::OK();
}

Out& Out::Raw(const void* p, size_t n) {
  s_.append(static_cast<const char*>(p), n);
  return *this;
}

Out& Out::Str16(std::string_view v) {
  U16(static_cast<uint16_t>(v.size()));
  return Bytes(v.substr(0, 0xffff));
}

std::string In::Str16(size_t max) {
  const uint16_t n = U16();
  if (!ok_ || n > max || s_.size() - pos_ < n) {
    ok_ = false;
    return {};
  }
  std::string v(s_.substr(pos_, n));
  pos_ += n;
  return v;
}

std::vector<uint8_t> EncodeCheckpointTable(const CheckpointInfo& info) {
  format::Table t;
  t.counter = info.counter;
  t.step = info.step;
  t.rank = info.rank;
  t.world_size = info.world_size;
  t.crc_chunk_bytes = info.crc_chunk_bytes;
  t.data_bytes = info.data_bytes;
  t.tensors = info.tensors;
  t.chunk_crcs = info.chunk_crcs;
  t.meta_json = info.meta_json;
  return format::EncodeTable(t);
}

std::string EncodeReply(const Status& s, uint32_t outcome) {
  Out o;
  o.U32(static_cast<uint32_t>(s.code())).U32(outcome);
  o.Bytes(std::string_view(s.message()).substr(0, 4000));
  return o.str();
}

Status DecodeReply(std::string_view payload, uint32_t* outcome, const std::string& from) {
  In in(payload);
  const uint32_t code = in.U32();
  *outcome = in.U32();
  std::string_view msg = in.Rest();
  if (!in.ok() || code > static_cast<uint32_t>(StatusCode::kInternal)) {
    return Status::Corruption("peer " + from + ": malformed reply");
  }
  if (code == 0) return Status::OK();
  std::string line(msg);
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return Status(static_cast<StatusCode>(code), "peer " + from + ": " + line);
}

}  // namespace nonstop::peer::wire
