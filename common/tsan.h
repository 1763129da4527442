// Happens-before annotations for ThreadSanitizer. Debian's oneTBB library is not instrumented,
// so TSan cannot see the ordering TBB itself guarantees (a pipeline token passing from one stage
// to the next, work started and joined by task_arena::execute) and reports those hand-offs as
// races. STOKE_TSAN_RELEASE(p) / STOKE_TSAN_ACQUIRE(p) restate that ordering on an address;
// they compile to nothing outside TSan builds.
#pragma once

// An address for annotating hand-offs into code that TBB runs. It must not be reached through a
// lambda's captures: reading the closure is itself one of the accesses being ordered.
inline int stoke_tsan_sync_anchor = 0;

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define STOKE_TSAN_ACQUIRE(p) __tsan_acquire(const_cast<void*>(static_cast<const void*>(p)))
#define STOKE_TSAN_RELEASE(p) __tsan_release(const_cast<void*>(static_cast<const void*>(p)))
#else
#define STOKE_TSAN_ACQUIRE(p) ((void)(p))
#define STOKE_TSAN_RELEASE(p) ((void)(p))
#endif
