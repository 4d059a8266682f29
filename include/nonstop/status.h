// Status and Result<T>: how every fallible nonstop call reports failure.
//
// A Status is OK or carries a code and a one-line, human-readable message that
// says what failed and, where possible, what to do about it. Errors that happen
// on background threads are stored as a Status and handed to the caller on its
// next call into the engine; they are never dropped.
#pragma once

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace nonstop {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input from the caller (shapes, names, options)
  kNotFound = 2,         // no such checkpoint, tensor or directory
  kCorruption = 3,       // a checksum or a structural check failed on stored bytes
  kIOError = 4,          // the medium failed (EIO, ENOSPC, short write, ...)
  kFailedPrecondition = 5,  // e.g. directory written by another world size
  kAborted = 6,          // a checkpoint was abandoned (superseded, engine closing)
  kUnavailable = 7,      // a feature not compiled in or not supported here
  kInternal = 8,         // a broken invariant inside nonstop: a bug
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  // An I/O error from errno: "<what>: <strerror(err)>".
  static Status FromErrno(const std::string& what, int err) {
    return {StatusCode::kIOError, what + ": " + std::strerror(err)};
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "IOError: write /x/rank-00000.nsck at 4096: No space left on device"
  std::string ToString() const;

  // Adds context in front of the message: "context: message". OK stays OK.
  Status Annotate(const std::string& context) const {
    if (ok()) return *this;
    return {code_, context + ": " + message_};
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace nonstop

#define NONSTOP_CONCAT_INNER_(a, b) a##b
#define NONSTOP_CONCAT_(a, b) NONSTOP_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function when it is not OK.
#define NONSTOP_RETURN_IF_ERROR(expr)              \
  do {                                             \
    ::nonstop::Status _nonstop_st = (expr);        \
    if (!_nonstop_st.ok()) return _nonstop_st;     \
  } while (0)

// `NONSTOP_ASSIGN_OR_RETURN(auto x, MakeX());`
#define NONSTOP_ASSIGN_OR_RETURN(lhs, expr)                                          \
  auto NONSTOP_CONCAT_(_nonstop_r, __LINE__) = (expr);                               \
  if (!NONSTOP_CONCAT_(_nonstop_r, __LINE__).ok())                                   \
    return NONSTOP_CONCAT_(_nonstop_r, __LINE__).status();                           \
  lhs = std::move(NONSTOP_CONCAT_(_nonstop_r, __LINE__)).value()
