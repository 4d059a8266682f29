// Thread-safety annotations: which mutex guards which field, and which lock a
// function needs, said in a way clang checks (-Wthread-safety; `make
// test-tsa`). With other compilers they expand to nothing.
//
//   Mutex mu_;
//   int n_ GUARDED_BY(mu_);
//   void Add() EXCLUDES(mu_) { MutexLock l(&mu_); ++n_; }
//   void AddLocked() REQUIRES(mu_) { ++n_; }
//
// The names follow clang's documentation of the analysis
// (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html).
#pragma once

#if defined(__clang__)
#define NONSTOP_TSA_(x) __attribute__((x))
#else
#define NONSTOP_TSA_(x)
#endif

// On a class: it is a lock ("mutex").
#define CAPABILITY(x) NONSTOP_TSA_(capability(x))
// On an RAII class that holds a lock while it lives.
#define SCOPED_CAPABILITY NONSTOP_TSA_(scoped_lockable)
// On a field: read and written only with `x` held.
#define GUARDED_BY(x) NONSTOP_TSA_(guarded_by(x))
// On a pointer field: what it points to is read and written only with `x` held.
#define PT_GUARDED_BY(x) NONSTOP_TSA_(pt_guarded_by(x))
// On a mutex field: taken only after (before) the listed ones.
#define ACQUIRED_AFTER(...) NONSTOP_TSA_(acquired_after(__VA_ARGS__))
#define ACQUIRED_BEFORE(...) NONSTOP_TSA_(acquired_before(__VA_ARGS__))
// On a function: the caller holds (must not hold) the listed locks.
#define REQUIRES(...) NONSTOP_TSA_(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) NONSTOP_TSA_(requires_shared_capability(__VA_ARGS__))
#define EXCLUDES(...) NONSTOP_TSA_(locks_excluded(__VA_ARGS__))
// On a function: it takes (releases) the listed locks, or `this`.
#define ACQUIRE(...) NONSTOP_TSA_(acquire_capability(__VA_ARGS__))
#define RELEASE(...) NONSTOP_TSA_(release_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) NONSTOP_TSA_(acquire_shared_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) NONSTOP_TSA_(release_shared_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) NONSTOP_TSA_(try_acquire_capability(__VA_ARGS__))
// On a function: it checks at run time that the lock is held.
#define ASSERT_CAPABILITY(x) NONSTOP_TSA_(assert_capability(x))
// On a function: it returns a reference to the lock `x`.
#define RETURN_CAPABILITY(x) NONSTOP_TSA_(lock_returned(x))
// On a function the analysis cannot follow (say why beside it).
#define NO_THREAD_SAFETY_ANALYSIS NONSTOP_TSA_(no_thread_safety_analysis)
