// The peer wire's socket (tier/peer_wire.h): SendAllV's partial sends. A
// blocking sendmsg returns fewer bytes than asked when a signal arrives
// after some were queued (or a send timeout expires then); SendAllV must go
// on from the exact byte where the kernel stopped, across the parts of the
// iovec, so that the receiver gets every byte once and in order.
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/crc32c.h"
#include "tier/peer_wire.h"

namespace nonstop::peer::wire {
namespace {

std::atomic<int> g_signals{0};
void OnSignal(int) { g_signals.fetch_add(1, std::memory_order_relaxed); }

// Parts of odd sizes (a header, a payload, a tag, an empty part, a tail),
// every byte a function of its position in the whole, so that a byte lost,
// sent twice or out of order shows.
std::vector<std::string> Parts() {
  const size_t sizes[] = {24, (1u << 20) + 4093, 16, 0, 70001};
  std::vector<std::string> parts;
  uint64_t at = 0;
  for (size_t n : sizes) {
    std::string p(n, '\0');
    for (size_t i = 0; i < n; ++i, ++at) p[i] = static_cast<char>((at * 2654435761u) >> 13);
    parts.push_back(std::move(p));
  }
  return parts;
}

TEST(PeerWireSocket, SendAllVResumesPartialSendsAcrossParts) {
  // A handler without SA_RESTART: a blocked sendmsg that already queued
  // bytes returns that count (a partial send), one that queued none EINTR.
  struct sigaction sa {}, old {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);

  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const int small = 4096;  // the kernel's minimum: the sender blocks at once
  ASSERT_EQ(::setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)), 0);
  ASSERT_EQ(::setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
  Socket sender(sv[0], "pair"), receiver(sv[1], "pair");
  ASSERT_TRUE(sender.SetTimeout(20).ok());  // a hung test ends; no timeout on a live reader
  ASSERT_TRUE(receiver.SetTimeout(20).ok());

  const std::vector<std::string> parts = Parts();
  std::string want;
  for (const std::string& p : parts) want += p;

  // The reader: small pieces, slowly, so the sender sits blocked in sendmsg.
  std::string got;
  std::thread reader([&] {
    char piece[1500];
    for (;;) {  // up to the sender's end (a byte too many shows too)
      const ssize_t r = ::recv(receiver.fd(), piece, sizeof(piece), 0);
      if (r <= 0) return;
      got.append(piece, static_cast<size_t>(r));
      if (got.size() > want.size()) {  // bytes sent twice: end the sender's loop too
        ::shutdown(receiver.fd(), SHUT_RDWR);
        return;
      }
      if (got.size() % 7 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });

  std::atomic<bool> sending{true};
  Status st;
  std::thread send_thread([&] {
    std::vector<::iovec> iov;
    for (const std::string& p : parts) iov.push_back({const_cast<char*>(p.data()), p.size()});
    st = sender.SendAllV(iov.data(), static_cast<int>(iov.size()));
    sending = false;
    ::shutdown(sender.fd(), SHUT_WR);
  });
  // Interrupt the blocked sender over and over.
  const pthread_t target = send_thread.native_handle();
  while (sending.load()) {
    (void)pthread_kill(target, SIGUSR1);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  send_thread.join();
  reader.join();
  ASSERT_EQ(sigaction(SIGUSR1, &old, nullptr), 0);

  EXPECT_EQ(got.size(), want.size());
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_GT(g_signals.load(), 10) << "the sender was hardly interrupted: no partial sends tested";
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want) << "bytes lost, repeated or reordered at a partial send";
}

// The fused pass over a DATA payload (crc32c and GHASH block by block)
// gives exactly the separate passes' values: the payload's crc32c and the
// one-piece hash of (header, payload), on sizes around the block and the
// GHASH block, and at every alignment of the bytes.
std::unique_ptr<Session> TestSession(std::mt19937_64& rng) {
  auto ss = std::make_unique<Session>();
  crypto::Block key;
  for (auto& b : key) b = static_cast<uint8_t>(rng());
  ss->send_hash = crypto::Ghash(key.data());
  ss->recv_hash = crypto::Ghash(key.data());
  ss->send_key = crypto::HmacSha256("a test key of this direction");
  ss->recv_key = crypto::HmacSha256("a test key of this direction");
  return ss;
}

std::vector<size_t> FusedSizes(std::mt19937_64& rng) {
  std::vector<size_t> sizes = {0, 1, 15, 16, 17, 31, 33, kFuseBytes - 1, kFuseBytes, kFuseBytes + 1,
                               kFuseBytes + 16, 2 * kFuseBytes - 15, 3 * kFuseBytes + 7};
  for (int i = 0; i < 24; ++i) sizes.push_back(rng() % (4 * kFuseBytes));
  return sizes;
}

TEST(PeerWireFused, ChecksEqualSeparateCrcAndHash) {
  std::mt19937_64 rng(27);
  Socket s;
  s.SetSession(TestSession(rng));
  std::string buf(5 * kFuseBytes, '\0');
  for (char& c : buf) c = static_cast<char>(rng());
  for (size_t n : FusedSizes(rng)) {
    const size_t align = rng() % 64;
    const std::string_view payload = std::string_view(buf).substr(align, n);
    size_t covered = 0, calls = 0;
    const BlockCheck check = [&](std::string_view b, uint32_t* crc) {
      EXPECT_EQ(b.data(), payload.data() + covered) << "blocks out of order";
      EXPECT_LE(b.size(), kFuseBytes);
      covered += b.size();
      ++calls;
      *crc = Crc32c(b.data(), b.size());
      return Status::OK();
    };
    uint32_t crc = 0;
    crypto::Block hash{};
    ASSERT_TRUE(DataFrameChecks(s, payload, check, &crc, &hash).ok());
    EXPECT_EQ(covered, n);
    EXPECT_EQ(calls, (n + kFuseBytes - 1) / kFuseBytes);
    EXPECT_EQ(crc, Crc32c(payload.data(), n)) << "n=" << n << " align=" << align;
    EXPECT_TRUE(hash == DataFrameHash(s, payload, crc)) << "n=" << n << " align=" << align;

    // The running hash fed in pieces of any size equals the one-piece hash.
    DataHashRun run(s.session()->send_hash);
    for (size_t at = 0; at < n;) {
      const size_t take = std::min<size_t>(n - at, rng() % 70);
      run.Update(payload.data() + at, take);
      at += take;
    }
    uint8_t header[kHeaderBytes];
    for (auto& b : header) b = static_cast<uint8_t>(rng());
    EXPECT_TRUE(run.Final(header) ==
                s.session()->send_hash.Hash(
                    std::string_view(reinterpret_cast<const char*>(header), kHeaderBytes), payload))
        << "n=" << n << " align=" << align;
  }
  // The caller's error ends the pass.
  uint32_t crc = 0;
  crypto::Block hash{};
  const Status st = DataFrameChecks(
      s, std::string_view(buf).substr(0, 2 * kFuseBytes),
      [](std::string_view, uint32_t*) { return Status::Corruption("chunk 3 is damaged"); }, &crc, &hash);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
}

// A DATA frame sent as ever (SendDataFrame: one-piece hash) is received by
// the fused receive (RecvFrame with a check), every block checked once in
// order; a damaged payload is a MAC mismatch there, not the check's error.
TEST(PeerWireFused, ReceiveChecksEachBlockAndTheTag) {
  std::mt19937_64 rng(2716);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Socket sender(sv[0], "pair"), receiver(sv[1], "pair");
  ASSERT_TRUE(sender.SetTimeout(20).ok());
  ASSERT_TRUE(receiver.SetTimeout(20).ok());
  std::mt19937_64 same(rng());
  std::mt19937_64 copy = same;
  sender.SetSession(TestSession(same));
  receiver.SetSession(TestSession(copy));
  std::string buf(3 * kFuseBytes + 9, '\0');
  for (char& c : buf) c = static_cast<char>(rng());
  for (size_t n : {size_t{1}, kFuseBytes, 2 * kFuseBytes + 5, buf.size()}) {
    const std::string_view payload = std::string_view(buf).substr(buf.size() - n);
    std::thread send([&] {
      EXPECT_TRUE(SendDataFrame(sender, payload, Crc32c(payload.data(), n)).ok());
    });
    std::string seen;
    Frame f;
    const Status st = RecvFrame(receiver, &f, [&](std::string_view b, uint32_t* crc) {
      seen.append(b);
      *crc = Crc32c(b.data(), b.size());
      return Status::OK();
    });
    send.join();
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(f.type, static_cast<uint16_t>(Type::kData));
    EXPECT_TRUE(f.payload == payload);
    EXPECT_TRUE(seen == payload) << "a block checked twice, skipped or out of order";
  }
  // The header's crc of other bytes: the MAC holds (the sender's tag is over
  // what it sent), the blocks' crc does not.
  {
    const std::string_view payload(buf);
    std::thread send([&] { EXPECT_TRUE(SendDataFrame(sender, payload, 12345).ok()); });
    Frame f;
    const Status st = RecvFrame(receiver, &f, [&](std::string_view b, uint32_t* crc) {
      *crc = Crc32c(b.data(), b.size());
      return Status::OK();
    });
    send.join();
    EXPECT_EQ(st.code(), StatusCode::kCorruption);
    EXPECT_NE(st.message().find("payload checksum mismatch"), std::string::npos) << st.ToString();
  }
  // Bytes damaged in transit: the MAC, checked first, fails.
  {
    std::string frame;
    std::thread capture([&] {
      char piece[65536];
      for (;;) {
        const ssize_t r = ::recv(receiver.fd(), piece, sizeof(piece), 0);
        if (r <= 0) return;
        frame.append(piece, static_cast<size_t>(r));
        if (frame.size() >= kHeaderBytes + buf.size() + kDataTagBytes) return;
      }
    });
    ASSERT_TRUE(SendDataFrame(sender, buf, Crc32c(buf.data(), buf.size())).ok());
    capture.join();
    frame[kHeaderBytes + kFuseBytes + 3] ^= 0x10;  // one bit of the second block
    std::thread replay([&] {
      EXPECT_TRUE(sender.SendAll(frame.data(), frame.size()).ok());
    });
    // The captured frame is the receiver's next in sequence (the one frame
    // it did not read): undamaged, its MAC would hold.
    Frame f;
    replay.join();
    bool checked = false;
    const Status st = RecvFrame(receiver, &f, [&](std::string_view blk, uint32_t* crc) {
      checked = true;
      *crc = Crc32c(blk.data(), blk.size());
      return Status::Corruption("the check's own verdict");
    });
    EXPECT_EQ(st.code(), StatusCode::kCorruption);
    EXPECT_NE(st.message().find("MAC mismatch"), std::string::npos) << st.ToString();
    EXPECT_TRUE(checked);
  }
}

}  // namespace
}  // namespace nonstop::peer::wire
