// A diagnostic for crashes inside native code: on SIGSEGV / SIGBUS / SIGILL / SIGFPE, print the native
// (C / C++) frames of the crashing thread to stderr, then hand the signal to the handler installed before
// (Python's faulthandler prints the Python frames), else to the default action.
//
// Why: on the first H100 lease (2026-11-26) two csrc tests crashed the interpreter (SIGSEGV) only under
// pytest, and that machine has no debugger; faulthandler shows Python frames only. Installed by
// megatron_vlm/_ext.py when MEGATRON_VLM_SEGV_BACKTRACE=1 (the GPU lease's csrc step sets it).
#include "ops.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>

namespace megatron_vlm {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
struct sigaction g_previous[4];

void write_str(const char* s) {
  ssize_t unused = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)unused;
}

void on_fatal_signal(int sig, siginfo_t*, void*) {
  write_str("\nmegatron_vlm._C: fatal signal ");
  write_str(sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGILL ? "SIGILL" : "SIGFPE");
  write_str(", native frames of this thread (most recent first):\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  for (int i = 0; i < 4; ++i) {
    if (kSignals[i] == sig) {
      ::sigaction(sig, &g_previous[i], nullptr);  // the previous handler (or the default) takes it from here
      break;
    }
  }
  ::raise(sig);
}

}  // namespace

bool install_segv_backtrace() {
  static bool installed = false;  // a second install would save our own handler as the "previous" one (a loop)
  if (installed) return true;
  installed = true;
  void* warm[1];
  ::backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  bool ok = true;
  for (int i = 0; i < 4; ++i) ok = ::sigaction(kSignals[i], &action, &g_previous[i]) == 0 && ok;
  return ok;
}

}  // namespace megatron_vlm
