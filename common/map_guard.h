// Reads of a memory-mapped file that may be damaged. LMDB follows the page numbers it finds in
// its data file; a corrupted one can point past the end of the file (the read raises SIGBUS) or
// outside the map (SIGSEGV). RunGuarded turns such a fault into a return value, so a damaged
// dataset is an error naming it rather than a dead process.
#pragma once

namespace stoke {

// Calls fn(arg) and returns true; returns false, abandoning fn mid-way, when it raised SIGBUS or
// SIGSEGV on this thread. fn must therefore only read (no locks taken, nothing allocated, no
// objects with destructors). Faults outside a guarded call go to the handlers installed before
// (a sanitizer's, or the default action). Thread-safe; nested calls run unguarded inside the
// outer one.
bool RunGuarded(void (*fn)(void*), void* arg);

// Leaves the guarded call running on this thread as a fault would (its RunGuarded returns false).
// Returns, doing nothing, when this thread is not inside one. For a library's failure callback
// that would otherwise abort the process on damaged data (LMDB's assertion handler).
void LeaveGuarded();

template <typename F>
bool RunGuarded(F& fn) {
  return RunGuarded([](void* f) { (*static_cast<F*>(f))(); }, &fn);
}

}  // namespace stoke
