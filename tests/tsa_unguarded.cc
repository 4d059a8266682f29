// Must NOT compile under `clang++ -Wthread-safety -Werror` (make test-tsa
// checks that it fails): proof that base/thread_annotations.h does not expand
// to nothing under clang, so a clean test-tsa build means something.
#include "base/mutex.h"

namespace {

class Counter {
 public:
  void Add() {
    nonstop::MutexLock lock(&mu_);
    ++n_;
  }
  int Unguarded() const { return n_; }  // reads n_ without mu_: an error

 private:
  mutable nonstop::Mutex mu_;
  int n_ GUARDED_BY(mu_) = 0;
};

}  // namespace

int main() {
  Counter c;
  c.Add();
  return c.Unguarded();
}
