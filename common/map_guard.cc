#include "common/map_guard.h"

#include <setjmp.h>
#include <signal.h>

#include <mutex>

namespace stoke {
namespace {

struct Guard {
  sigjmp_buf env;
  volatile sig_atomic_t active = 0;
};
thread_local Guard t_guard;
struct sigaction g_old_bus, g_old_segv;
std::once_flag g_installed;

void OnFault(int sig, siginfo_t* info, void* context) {
  Guard& g = t_guard;
  if (g.active) {
    g.active = 0;
    siglongjmp(g.env, 1);  // the signal stays blocked; RunGuarded unblocks it
  }
  // Not a guarded read: whoever handled the signal before gets it.
  const struct sigaction& old = sig == SIGBUS ? g_old_bus : g_old_segv;
  if ((old.sa_flags & SA_SIGINFO) != 0 && old.sa_sigaction != nullptr) {
    old.sa_sigaction(sig, info, context);
    return;
  }
  if ((old.sa_flags & SA_SIGINFO) == 0 && old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
    old.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

void Install() {
  struct sigaction sa = {};
  sa.sa_sigaction = OnFault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGSEGV, &sa, &g_old_segv);
}

}  // namespace

void LeaveGuarded() {
  Guard& g = t_guard;
  if (!g.active) return;
  g.active = 0;
  siglongjmp(g.env, 1);
}

bool RunGuarded(void (*fn)(void*), void* arg) {
  std::call_once(g_installed, Install);
  Guard& g = t_guard;
  if (g.active) {
    fn(arg);
    return true;
  }
  // No signal mask saved here: that would be a system call on every guarded read (every record
  // the loader reads). The rare fault path unblocks the signal its handler left blocked.
  if (sigsetjmp(g.env, 0) != 0) {
    sigset_t faults;
    sigemptyset(&faults);
    sigaddset(&faults, SIGBUS);
    sigaddset(&faults, SIGSEGV);
    pthread_sigmask(SIG_UNBLOCK, &faults, nullptr);
    return false;
  }
  g.active = 1;
  fn(arg);
  g.active = 0;
  return true;
}

}  // namespace stoke
