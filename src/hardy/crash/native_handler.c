/* hardy's native fatal-signal handler: the crashing thread's return addresses, as library + offset
 * (+ the exported symbol dladdr knows), written to the worker's crash record before faulthandler
 * writes the Python stack. Async-signal-safe: no malloc, fixed buffers, backtrace() warmed up at
 * install (its first call loads libgcc_s), an alternate stack. Not SA_RESETHAND: the threads of an
 * OpenMP team often fault together (one bad tensor, four threads reading it), and the second would
 * find the default action and end the process before the first had written anything. Instead the
 * first thread in writes; any other waits for the process to end. A fault inside this handler,
 * its signal blocked, is fatal at once (the kernel's rule), so it cannot loop.
 * Only in the process that installed it: a fork child of the worker (a node's helper process,
 * forked from Python or from C) inherits the handler, and must neither write into the worker's
 * record nor hand the signal to the worker's last words. There it puts back the disposition the
 * worker had before any of hardy's handlers (`hardy_native_remember`; a runtime's own handler,
 * or the default action) and lets the signal go to that, as it would without hardy: a fault by
 * returning (the instruction faults again, with its own address and code, which a runtime's
 * handler may read), a signal sent by raising it again. A handler writing to stderr (`hardy
 * replay`'s) writes to each process's own and stays.
 * The parent symbolises the offsets after the death (hardy/crash/symbols.py).
 * Built with -DHARDY_PRELOAD, it installs itself when loaded (LD_PRELOAD, for `hardy repeat`),
 * writing to stderr. A Python started with PYTHONFAULTHANDLER=1 then installs faulthandler over
 * it, whose handler calls this one from inside itself (raise()): the crash's frames are then those
 * after the outermost signal trampoline (sa_restorer; x86_64), not those after this call's pc. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

#define MAX_FRAMES 64
static int out_fd = -1;
static pid_t owner;  /* the process that installed the handler */
static struct sigaction previous[65];
static struct sigaction original[65];  /* before any of hardy's handlers (SIG_DFL if not remembered) */
static void *frames[MAX_FRAMES];
static char line[1200];
static char alt_stack[1 << 16];
static int entered;
#ifdef HARDY_PRELOAD
static uintptr_t restorer;  /* the signal trampoline a handler returns through (x86_64), or 0 */
#endif

static size_t put(size_t n, const char *s) {
    while (*s && n < sizeof line - 2) line[n++] = *s++;
    return n;
}

static size_t hex(size_t n, uintptr_t v) {
    char digits[2 + 2 * sizeof v];
    int k = 0;
    do { digits[k++] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v);
    n = put(n, "0x");
    while (k && n < sizeof line - 2) line[n++] = digits[--k];
    return n;
}

static uintptr_t crash_pc(void *context) {
#if defined(__x86_64__)
    return (uintptr_t)((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
    return (uintptr_t)((ucontext_t *)context)->uc_mcontext.pc;
#else
    (void)context;
    return 0;
#endif
}

static void frame(uintptr_t address) {
    Dl_info info;
    memset(&info, 0, sizeof info);
    int known = dladdr((void *)address, &info);
    size_t n = put(0, "hardy-native: ");
    n = hex(n, address);
    n = put(n, " ");
    n = hex(n, known ? (uintptr_t)info.dli_fbase : 0);
    n = put(n, " ");
    n = hex(n, known ? (uintptr_t)info.dli_saddr : 0);
    n = put(n, " ");
    n = put(n, known && info.dli_sname ? info.dli_sname : "?");
    n = put(n, " ");
    n = put(n, known && info.dli_fname && *info.dli_fname ? info.dli_fname : "?");
    line[n++] = '\n';
    (void)!write(out_fd, line, n);
}

static void on_signal(int sig, siginfo_t *info, void *context) {
    int saved = errno;
#ifndef HARDY_PRELOAD
    if (out_fd != 2 && getpid() != owner) {  /* a fork child: what was there before hardy */
        sigaction(sig, &original[sig], NULL);
        if (!info || info->si_code <= 0)  /* sent (kill, raise, abort): again, blocked until this returns */
            raise(sig);
        /* else a fault: the instruction runs again, and faults with its own address and code */
        errno = saved;
        return;
    }
#else
    (void)info;
#endif
    if (__atomic_exchange_n(&entered, 1, __ATOMIC_SEQ_CST))
        for (;;) pause();  /* another thread is writing its record; the process ends with it */
    if (out_fd >= 0) {
        uintptr_t pc = crash_pc(context);
        int count = backtrace(frames, MAX_FRAMES), start = count;
        for (int i = 0; i < count; i++)
            if ((uintptr_t)frames[i] == pc) { start = i; break; }
#ifdef HARDY_PRELOAD
        for (int i = count - 2; restorer && i >= 0; i--)
            if ((uintptr_t)frames[i] == restorer) { start = i + 1; break; }
#endif
        size_t n = put(0, "hardy-native: signal ");
        n = hex(n, (uintptr_t)sig);
        line[n++] = '\n';
        (void)!write(out_fd, line, n);
        if (start == count && pc) frame(pc);  /* no unwind info through the signal frame: the pc alone */
        for (int i = start; i < count; i++) frame((uintptr_t)frames[i]);
        (void)!write(out_fd, "hardy-native: end\n", 18);
    }
    sigaction(sig, &previous[sig], NULL);
    raise(sig);  /* blocked while this runs: the previous handler (faulthandler's) gets it next */
    errno = saved;
}

/* exit() called by native code in a worker (a library's error path): the frames that called it, then
 * the worker's callback (its last words: results not sent yet go to the parent). Registered with
 * on_exit, which gives the status. Only in the process that registered it: a fork child inherits
 * the registration, and its exit (after Py_Finalize, for a Python child) must not enter Python.
 * An alarm ends a callback that cannot get the interpreter's lock. */
static void (*exit_callback)(int);
static pid_t exit_pid;
static unsigned exit_limit;

static void on_exit_hook(int status, void *arg) {
    (void)arg;
    if (getpid() != exit_pid || !exit_callback) return;
    alarm(exit_limit);
    if (out_fd >= 0) {
        int count = backtrace(frames, MAX_FRAMES);
        size_t n = put(0, "hardy-native: exit ");
        n = hex(n, (uintptr_t)(unsigned)status);
        line[n++] = '\n';
        (void)!write(out_fd, line, n);
        for (int i = 1; i < count; i++) frame((uintptr_t)frames[i]);  /* from the exit machinery on */
        (void)!write(out_fd, "hardy-native: end\n", 18);
    }
    exit_callback(status);
    alarm(0);
}

int hardy_native_at_exit(void (*callback)(int), unsigned limit) {
    exit_callback = callback;
    exit_limit = limit;
    exit_pid = getpid();
    return on_exit(on_exit_hook, NULL);
}

/* The worker's last handler of the SIGUSR1 that comes before a kill: it waits for the kill, so that
 * a call the signal interrupted (a sleep() in C, which does not restart) never returns early. */
static void hold(int sig) {
    (void)sig;
    for (;;) pause();
}

int hardy_native_hold(int sig) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = hold;
    sigemptyset(&action.sa_mask);
    return sigaction(sig, &action, NULL);
}

int hardy_native_remember(const int *signals, int count) {
    for (int i = 0; i < count; i++)
        if (signals[i] > 0 && signals[i] < 65 && sigaction(signals[i], NULL, &original[signals[i]]) != 0)
            return -1;
    return 0;
}

int hardy_native_install(int fd, const int *signals, int count) {
    void *warm[4];
    backtrace(warm, 4);
    stack_t current;
    if (sigaltstack(NULL, &current) == 0 && (current.ss_flags & SS_DISABLE)) {
        stack_t mine = {.ss_sp = alt_stack, .ss_size = sizeof alt_stack, .ss_flags = 0};
        sigaltstack(&mine, NULL);
    }
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    out_fd = fd;
    owner = getpid();
    for (int i = 0; i < count; i++)
        if (signals[i] > 0 && signals[i] < 65 && sigaction(signals[i], &action, &previous[signals[i]]) != 0)
            return -1;
#if defined(HARDY_PRELOAD) && defined(__x86_64__)
    struct sigaction now;
    if (count && sigaction(signals[0], NULL, &now) == 0) restorer = (uintptr_t)now.sa_restorer;
#endif
    return 0;
}

#ifdef HARDY_PRELOAD
__attribute__((constructor)) static void install_when_preloaded(void) {
    static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    hardy_native_install(2, fatal, 5);
}
#endif
