// runtime.cpp — the emulator's scheduler: every CUDA thread of a block is a fiber with its own stack; blocks
// run one after another. A warp's lanes run in turn, each until it blocks (at a warp collective, a
// __syncthreads, or its exit), handing over directly to the next lane of its warp; the last lane to reach a
// warp collective completes it for all (shuffles, reductions, ldmatrix, mma.sync) and runs on. A warp runs
// until every lane is blocked at a barrier, then the next warp runs (forward, reverse or shuffled order), so
// shuffles never act as a block barrier. Warpgroup collectives (wgmma) complete when all 128 threads arrive.
// A barrier opens once every thread of the block waits at it; anything else (a thread that exited, another
// barrier, a collective some lane never reaches) is a deadlock, reported as an error, never a hang.
//
// Hazards are made visible: shared memory is 0xFF (NaN) at every block start; a cp.async destination is 0xFF
// from its issue until the wait_group that retires it (the copy happens then); wgmma operands are
// snapshotted at issue and must be unchanged at the wait_group that retires them, its accumulator registers
// read NaN in between (and must not be written), and its shared operands must have been fenced to the async
// proxy after their cp.async landed. The wgmma.fence rule (PTX ISA, wgmma.fence): one before a warpgroup's
// first wgmma.mma_async, and one between any thread's write of accumulator registers and a wgmma.mma_async
// that uses them; wgmma.mma_asyncs of one shape on the same accumulators need none between them. Each fence
// keeps a copy of every thread's live stack (where its registers are) and each write the emulator itself
// makes to the registers goes into that copy: an accumulator that differs from it at the next
// wgmma.mma_async was written by its thread since, unfenced. (A read, or a write of the value it held, is
// not seen; nor a register outside the copy, one whose frame came after the fence.)
//
// Errors (and stray memory accesses, as SIGSEGV / SIGBUS, and misaligned typed ones, through the
// -fsanitize=alignment handler below) end the launch with a one-line message naming the kernel, block, thread
// and source line. ld.global.nc / __ldg loads mark the bytes they read (emu_launch's spans), which launch.py
// checks against the launch's writes.
//
// Built once per process by cullama/runtime/emu/build.py into a shared library loaded with RTLD_GLOBAL; each kernel
// library calls into it (emu_abi.h).

#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#if !defined(__x86_64__) || defined(EMU_PORTABLE_CONTEXT)
#include <ucontext.h>
#endif

#include "emu_abi.h"

emu_dim3 emu_thread_idx, emu_block_idx, emu_block_dim, emu_grid_dim;

namespace {

constexpr int WARP = 32, WARPGROUP = 128, MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 64 * 1024;  // per fiber, over a guard page; the deepest (a thread completing a
                                            // wgmma) needs 16 to 32 KB
constexpr unsigned MAX_SHARED = 232448;       // an H100 / H200 block's shared memory, static + dynamic (227 KB)
constexpr unsigned CANARY = 1024;             // bytes past the dynamic window that must stay 0xFF

enum State : unsigned char { RUNNABLE, AT_BARRIER, AT_WARP, AT_WARPGROUP, EXITED };

// -- contexts: a hand-written switch on x86-64; makecontext + _setjmp / _longjmp elsewhere (or with
// EMU_PORTABLE_CONTEXT, which the tests use to run that path on x86-64 too) -------------------------------------
#if defined(__x86_64__) && !defined(EMU_PORTABLE_CONTEXT)
extern "C" void emu_switch_ctx(void** save_sp, void* to_sp);
asm(R"(
    .text
    .p2align 4
    .type emu_switch_ctx, @function
emu_switch_ctx:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_ctx, .-emu_switch_ctx
)");

struct Context {
    void* sp = nullptr;
};
void fiber_entry();
// A fresh frame: six callee-saved registers, then fiber_entry as the return address (entered as if called).
void context_start(Context& c, unsigned char* stack_top) {
    void** top = (void**)((unsigned long)stack_top & ~15ul);
    top[-1] = nullptr;
    top[-2] = (void*)&fiber_entry;
    for (int i = 3; i <= 8; ++i) top[-i] = nullptr;
    c.sp = top - 8;
}
inline void context_switch(Context& from, Context& to) { emu_switch_ctx(&from.sp, to.sp); }
void context_main(Context&) {}
#else
struct Context {
    jmp_buf jb, home;
    ucontext_t uc;
    bool made = false, entered = false, restart = false;
};
void fiber_entry();
void context_start(Context& c, unsigned char* stack_top) {
    if (!c.made) {
        getcontext(&c.uc);
        c.uc.uc_stack.ss_sp = stack_top - (STACK_BYTES - 64);
        c.uc.uc_stack.ss_size = STACK_BYTES - 64;
        c.uc.uc_link = nullptr;
        makecontext(&c.uc, fiber_entry, 0);
        c.made = true;
    } else if (c.entered) {
        c.restart = true;  // back to fiber_entry's loop, whatever the fiber was doing
    }
}
void context_switch(Context& from, Context& to) {
    if (_setjmp(from.jb)) return;
    if (!to.entered) {
        to.entered = true;
        ucontext_t unused;
        swapcontext(&unused, &to.uc);  // once per fiber in the process: later switches are _longjmp
    } else if (to.restart) {
        to.restart = false;
        _longjmp(to.home, 1);
    }
    _longjmp(to.jb, 1);
}
void context_main(Context& c) { c.entered = true; }  // the thread's own context: switched to by _longjmp only
#endif

struct Copy {
    unsigned dst;
    const unsigned char* src;
    unsigned src_size;
};

struct Warp;

struct Fiber {
    Context ctx;
    unsigned char* stack_top;
    State state = EXITED;
    unsigned tid = 0, lane = 0, pos = 0;  // linear thread index; lane; position in its warp's run order
    Warp* warp = nullptr;
    emu_dim3 idx{};
    const char* file = nullptr;  // where it waits
    int line = 0;
    std::vector<Copy> copies;        // issued cp.async not yet retired, oldest first
    std::vector<size_t> group_ends;  // committed groups: copies[0 .. group_ends[i]) for group i
    std::vector<unsigned> unfenced;  // shared 16-byte chunks its retired cp.async wrote, not yet proxy-fenced
    float** wg_acc = nullptr;        // a wgmma.mma_async's operands while it waits for its warpgroup
    unsigned char* fence_lo = nullptr;   // at its warpgroup's last wgmma.fence: its live stack [fence_lo,
    std::vector<unsigned char> fenced;   // stack_top), and a copy of it (updated by the emulator's writes)
    int wg_n = 0, wg_scale = 0;
    unsigned long long wg_desc[2]{};
};

// Threads of a warp (or warpgroup) meeting at one collective.
struct Meeting {
    int arrived = 0;
    unsigned arrived_mask = 0, mask = 0;
    int op = -1;
    const char* file = nullptr;
    int line = 0;
};

// A warp of the running block: its lanes, the order in which they run, which of them may run, and the slots
// through which its collectives exchange values (a lane's slot is rewritten only by a collective it joined,
// after it read its last output).
struct Warp {
    Fiber* lanes[WARP];
    unsigned char order[WARP];  // the lane at each position of the run order
    unsigned runnable = 0;      // bit k: the lane at position k may run
    unsigned present = 0;       // bit k: position k holds a thread (a block's last warp may be partial)
    Meeting meeting;
    unsigned long long in[WARP], out[WARP];
    int arg[WARP];
    unsigned frag_in[WARP][10], frag_out[WARP][4];  // ldmatrix addresses, mma fragments
};

// One wgmma.mma_async of a warpgroup: the shared bytes it read (to check at retire) and its accumulators.
struct Chain {
    std::vector<float*> regs;   // [128 threads][n / 2] register addresses
    std::vector<float> shadow;  // their value once every pending op is done
    size_t last_seq = 0;
    unsigned first = 0;  // the warpgroup's first thread
};
struct WgOp {
    std::vector<unsigned> addrs;  // shared addresses of the FP16 operand elements read
    std::vector<unsigned short> values;
    Chain* chain;
    size_t seq;
    const char* file;
    int line;
};
struct Warpgroup {
    Meeting meeting;
    bool fenced = false;
    std::vector<WgOp> uncommitted;
    std::deque<std::vector<WgOp>> groups;
    std::vector<std::unique_ptr<Chain>> chains;
};

// -- the launch and block being run ----------------------------------------------------------------------
struct Run {
    const emu_launch* launch = nullptr;
    void (*body)(void**) = nullptr;
    void** params = nullptr;
    unsigned char *static_shared = nullptr, *window = nullptr;
    unsigned static_bytes = 0, dynamic_base = 0, shared_bytes = 0;  // shared address space [0, shared_bytes)
    unsigned threads = 0, warps = 0;
    unsigned long long rng = 0;
    size_t wg_seq = 0;
    std::vector<Fiber*> fibers;  // of this block, by linear thread index
    std::vector<Warp> warp;
    std::deque<Warpgroup> warpgroups;
    std::vector<unsigned short> chunk_writer;  // per 16 shared bytes: tid + 1 of an unfenced cp.async writer
    std::vector<unsigned> warp_order;          // the order in which the warps run in this pass
} R;

std::vector<std::unique_ptr<Fiber>> pool;  // fibers (and their stacks) live for the whole process
Context scheduler;
Fiber* current = nullptr;
sigjmp_buf launch_env;
volatile sig_atomic_t in_launch = 0;
unsigned char* window_memory = nullptr;

unsigned long long next_random() {  // splitmix64
    unsigned long long z = (R.rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

template <class T>
void shuffle(T* v, size_t n) {
    for (size_t i = n; i > 1; --i) {
        const size_t j = next_random() % i;
        T t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

// -- errors ------------------------------------------------------------------------------------------------
const char* short_name(const char* file) {
    const char* slash = file ? strrchr(file, '/') : nullptr;
    return slash ? slash + 1 : (file ? file : "?");
}

[[noreturn]] void fail_v(const char* file, int line, const char* fmt, va_list ap) {
    const emu_launch* L = R.launch;
    int n = snprintf(L->error, L->error_size, "%s block (%u, %u, %u)", L->kernel, emu_block_idx.x, emu_block_idx.y,
                     emu_block_idx.z);
    if (current && n < L->error_size)
        n += snprintf(L->error + n, L->error_size - n, " thread (%u, %u, %u)", current->idx.x, current->idx.y,
                      current->idx.z);
    if (file && n < L->error_size) n += snprintf(L->error + n, L->error_size - n, " at %s:%d", short_name(file), line);
    if (n < L->error_size) n += snprintf(L->error + n, L->error_size - n, ": ");
    if (n < L->error_size) vsnprintf(L->error + n, L->error_size - n, fmt, ap);
    siglongjmp(launch_env, 1);
}

[[noreturn]] __attribute__((format(printf, 3, 4))) void fail(const char* file, int line, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(file, line, fmt, ap);
}

// -- fibers ------------------------------------------------------------------------------------------------
Fiber* make_fiber() {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void* mem = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (mem == MAP_FAILED) return nullptr;
    mprotect(mem, page, PROT_NONE);  // a stack overflow faults here instead of running into another stack
    auto f = std::make_unique<Fiber>();
    f->stack_top = (unsigned char*)mem + page + STACK_BYTES;
    pool.push_back(std::move(f));
    return pool.back().get();
}

bool in_guard_page(const void* p) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (auto& f : pool) {
        const unsigned char* guard = f->stack_top - STACK_BYTES - page;
        if ((const unsigned char*)p >= guard && (const unsigned char*)p < guard + page) return true;
    }
    return false;
}

void resume(Fiber* f) {
    current = f;
    emu_thread_idx = f->idx;
    context_switch(scheduler, f->ctx);
}

// The calling fiber has blocked (or exited), its runnable bit cleared: run the next runnable lane of its warp
// in the run order, else the scheduler.
void block_current() {
    Fiber* f = current;
    Warp& w = *f->warp;
    if (const unsigned mask = w.runnable) {
        const unsigned shift = (f->pos + 1) % WARP;
        const unsigned rotated = shift ? (mask >> shift) | (mask << (WARP - shift)) : mask;
        Fiber* next = w.lanes[w.order[(shift + __builtin_ctz(rotated)) % WARP]];
        current = next;
        emu_thread_idx = next->idx;
        context_switch(f->ctx, next->ctx);
        return;
    }
    current = nullptr;
    context_switch(f->ctx, scheduler);
}

void block_at(State state, const char* file, int line) {
    Fiber* f = current;
    f->state = state, f->file = file, f->line = line;
    f->warp->runnable &= ~(1u << f->pos);
    block_current();
}

void fiber_entry() {
#if !defined(__x86_64__) || defined(EMU_PORTABLE_CONTEXT)
    _setjmp(current->ctx.home);  // a restart (context_start after a first run) comes back here
#endif
    for (;;) {
        R.body(R.params);
        Fiber* f = current;
        if (!f->group_ends.empty() && f->group_ends.back() > 0)
            fail(nullptr, 0, "exited with %zu cp.async copies never waited for (cp.async.wait_group)",
                 f->group_ends.back());
        if (f->copies.size() > (f->group_ends.empty() ? 0 : f->group_ends.back()))
            fail(nullptr, 0, "exited with %zu cp.async copies never committed", f->copies.size());
        block_at(EXITED, nullptr, 0);
    }
}

// -- shared memory -----------------------------------------------------------------------------------------
unsigned char* shared_ptr(unsigned addr, unsigned bytes, const char* file, int line, const char* what) {
    if (addr + bytes <= R.static_bytes && addr + bytes >= addr) return R.static_shared + addr;
    if (addr >= R.dynamic_base && addr + bytes <= R.shared_bytes && addr + bytes >= addr)
        return R.window + (addr - R.dynamic_base);
    fail(file, line, "%s: shared address %#x (%u bytes) outside the block's %u bytes of shared memory (static %u, "
         "dynamic from %#x)", what, addr, bytes, R.shared_bytes, R.static_bytes, R.dynamic_base);
}

void poison_shared() {
    memset(R.static_shared, 0xFF, R.static_bytes);
    memset(R.window, 0xFF, R.launch->dynamic_shared + CANARY);
    std::fill(R.chunk_writer.begin(), R.chunk_writer.end(), 0);
}

// -- warp and warpgroup meetings -----------------------------------------------------------------------------
const char* const OP_NAMES[] = {"__shfl_sync",      "__shfl_up_sync",   "__shfl_down_sync", "__shfl_xor_sync",
                                "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync", "ldmatrix",
                                "ldmatrix.trans",   "mma.sync",         "wgmma.fence",      "wgmma.commit_group",
                                "wgmma.wait_group", "wgmma.mma_async"};
enum { OP_REDUCE = 4, OP_LDMATRIX = 7, OP_MMA = 9, OP_WGMMA = 10 };

const char* describe(const Fiber* f, char* buf, size_t size) {
    if (f->state == EXITED) snprintf(buf, size, "exited");
    else if (f->state == AT_BARRIER) snprintf(buf, size, "at __syncthreads (%s:%d)", short_name(f->file), f->line);
    else if (f->state == RUNNABLE) snprintf(buf, size, "running");
    else snprintf(buf, size, "at another collective (%s:%d)", short_name(f->file), f->line);
    return buf;
}

void mismatch(const Meeting& m, int op, unsigned mask, bool warp, const char* file, int line) {
    fail(file, line, "%s (mask %#x) while other threads of its %s wait at %s (%s:%d, mask %#x)", OP_NAMES[op], mask,
         warp ? "warp" : "warpgroup", OP_NAMES[m.op], short_name(m.file), m.line, m.mask);
}

// Arrive at a collective of the calling lane's warp whose `mask` lanes must meet. Returns true for the last to
// arrive, which completes the collective and calls release_warp(); the others block until then. A lane that
// never arrives (exited, at a barrier) leaves every thread blocked: resolve_barrier() reports it.
inline bool arrive_warp(Warp& w, unsigned mask, int op, const char* file, int line) {
    Fiber* f = current;
    Meeting& m = w.meeting;
    if (!(mask >> f->lane & 1u)) fail(file, line, "%s with mask %#x, which leaves out the calling lane", OP_NAMES[op], mask);
    if (m.arrived == 0) m.mask = mask, m.op = op, m.file = file, m.line = line;
    else if (m.op != op || m.line != line || m.file != file || m.mask != mask) mismatch(m, op, mask, true, file, line);
    ++m.arrived;
    m.arrived_mask |= 1u << f->lane;
    if (m.arrived_mask == mask) return true;
    block_at(AT_WARP, file, line);
    return false;
}

inline void release_warp(Warp& w) {
    const unsigned mask = w.meeting.mask;
    if (mask == 0xffffffffu) {
        w.runnable = w.present;
        for (unsigned l = 0; l < WARP; ++l) w.lanes[l]->state = RUNNABLE;
    } else {
        for (unsigned l = 0; l < WARP; ++l)
            if (mask >> l & 1u) w.lanes[l]->state = RUNNABLE, w.runnable |= 1u << w.lanes[l]->pos;
    }
    w.meeting.arrived = 0, w.meeting.arrived_mask = 0;
}

// The same for the 128 threads of a warpgroup (all must arrive).
bool arrive_warpgroup(Warpgroup& g, int op, const char* file, int line) {
    Meeting& m = g.meeting;
    if (m.arrived == 0) m.mask = 0xffffffffu, m.op = op, m.file = file, m.line = line;
    else if (m.op != op || m.line != line || m.file != file) mismatch(m, op, 0xffffffffu, false, file, line);
    if (++m.arrived == WARPGROUP) return true;
    block_at(AT_WARPGROUP, file, line);
    return false;
}

void release_warpgroup(Warpgroup& g, unsigned first) {
    for (unsigned t = first; t < first + WARPGROUP; ++t) R.fibers[t]->state = RUNNABLE;
    for (unsigned w = first / WARP; w < (first + WARPGROUP) / WARP; ++w) R.warp[w].runnable = R.warp[w].present;
    g.meeting.arrived = 0;
}

// -- matrix fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16" and ldmatrix) ------------------------
unsigned pack(unsigned short lo, unsigned short hi) { return (unsigned)lo | ((unsigned)hi << 16); }
unsigned short half_of(unsigned w, int h) { return (unsigned short)(h ? w >> 16 : w & 0xffffu); }

void complete_ldmatrix(Warp& w, int trans, const char* file, int line) {
    unsigned short rows[32][8];  // row r of matrix j: the 16 bytes at lane 8 j + r's address
    for (unsigned l = 0; l < WARP; ++l) {
        const unsigned addr = w.frag_in[l][0];
        if (addr % 16) fail(file, line, "ldmatrix: lane %u's row address %#x is not 16-byte aligned", l, addr);
        memcpy(rows[l], shared_ptr(addr, 16, file, line, "ldmatrix"), 16);
    }
    for (unsigned l = 0; l < WARP; ++l) {
        const unsigned g = l / 4, t = l % 4;
        for (int j = 0; j < 4; ++j) {
            const unsigned short* m = rows[8 * j];
            w.frag_out[l][j] = trans ? pack(m[(2 * t) * 8 + g], m[(2 * t + 1) * 8 + g])
                                     : pack(m[g * 8 + 2 * t], m[g * 8 + 2 * t + 1]);
        }
    }
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: per lane (g = lane / 4, t = lane % 4) a0 = A[g][2t..],
// a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..][g], b1 = B[2t+8..][g]; c0, c1 =
// C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]. FP16 products are exact; the sum is taken in double, rounded once.
void complete_mma(Warp& w) {
    float A[16][16], B[16][8], C[16][8];
    for (unsigned l = 0; l < WARP; ++l) {
        const unsigned g = l / 4, t = l % 4, *in = w.frag_in[l];
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = emu_h2f(half_of(in[0], h));
            A[g + 8][2 * t + h] = emu_h2f(half_of(in[1], h));
            A[g][2 * t + 8 + h] = emu_h2f(half_of(in[2], h));
            A[g + 8][2 * t + 8 + h] = emu_h2f(half_of(in[3], h));
            B[2 * t + h][g] = emu_h2f(half_of(in[4], h));
            B[2 * t + 8 + h][g] = emu_h2f(half_of(in[5], h));
            C[g][2 * t + h] = emu_bits_float(in[6 + h]);
            C[g + 8][2 * t + h] = emu_bits_float(in[8 + h]);
        }
    }
    for (unsigned l = 0; l < WARP; ++l) {
        const unsigned g = l / 4, t = l % 4;
        for (int e = 0; e < 4; ++e) {
            const unsigned m = g + 8 * (e / 2), n = 2 * t + e % 2;
            double s = C[m][n];
            for (int k = 0; k < 16; ++k) s += (double)A[m][k] * B[k][n];
            w.frag_out[l][e] = emu_float_bits((float)s);
        }
    }
}

void complete_shfl(Warp& w, int kind, unsigned mask, int width) {
    if (kind == 3 && width == WARP && mask == 0xffffffffu) {  // the common case: __shfl_xor_sync over the warp
        for (unsigned l = 0; l < WARP; ++l) {
            const unsigned src = l ^ (unsigned)w.arg[l];
            w.out[l] = w.in[src < WARP ? src : l];
        }
        return;
    }
    for (unsigned l = 0; l < WARP; ++l) {
        if (!(mask >> l & 1u)) continue;
        const int arg = w.arg[l], seg = (int)l & ~(width - 1), in_seg = (int)l - seg;
        int src = (int)l;
        if (kind == 0) src = seg + (arg & (width - 1));
        else if (kind == 1) src = in_seg >= arg ? (int)l - arg : (int)l;
        else if (kind == 2) src = in_seg + arg < width ? (int)l + arg : (int)l;
        else if (((int)l ^ arg) < seg + width) src = (int)l ^ arg;
        // A source lane outside the mask gives an undefined value (PTX): all ones, a NaN.
        w.out[l] = (mask >> src & 1u) ? w.in[src] : ~0ull;
    }
}

void complete_reduce(Warp& w, int op, int is_signed, unsigned mask) {
    unsigned acc = 0;
    bool first = true;
    for (unsigned l = 0; l < WARP; ++l) {
        if (!(mask >> l & 1u)) continue;
        const unsigned v = (unsigned)w.in[l];
        if (first) acc = v, first = false;
        else if (op == 0) acc += v;
        else if (is_signed) acc = (op == 1) == ((int)v < (int)acc) ? v : acc;
        else acc = (op == 1) == (v < acc) ? v : acc;
    }
    for (unsigned l = 0; l < WARP; ++l)
        if (mask >> l & 1u) w.out[l] = acc;
}

// -- cp.async ----------------------------------------------------------------------------------------------
void retire_copies(Fiber* f, size_t n) {  // the first n copies land: copied now, zero-filled past src_size
    for (size_t i = 0; i < n; ++i) {
        const Copy& c = f->copies[i];
        unsigned char* dst = shared_ptr(c.dst, 16, nullptr, 0, "cp.async");
        memcpy(dst, c.src, c.src_size);
        memset(dst + c.src_size, 0, 16 - c.src_size);
        unsigned short& writer = R.chunk_writer[c.dst / 16];
        writer = (unsigned short)(f->tid + 1);
        f->unfenced.push_back(c.dst / 16);
    }
    f->copies.erase(f->copies.begin(), f->copies.begin() + n);
}

// -- wgmma -------------------------------------------------------------------------------------------------
Warpgroup& warpgroup_of(const Fiber* f) { return R.warpgroups[f->tid / WARPGROUP]; }

// Byte address of element (row i, k) of a K-major operand (PTX ISA "Matrix Descriptor Format" and "Shared
// Memory Matrix Layout"): 128-byte swizzle: row i at (i / 8) SBO + (i % 8) 128 B, k chunks 16 B apart, then
// address bits 4-6 ^= bits 7-9; no swizzle: row i at (i / 8) SBO + (i % 8) 16 B, k chunk j at j LBO.
unsigned operand_address(unsigned long long d, unsigned i, unsigned k, const char* file, int line) {
    const unsigned start = (unsigned)(d & 0x3FFF) << 4, lbo = (unsigned)((d >> 16) & 0x3FFF) << 4;
    const unsigned sbo = (unsigned)((d >> 32) & 0x3FFF) << 4, base_offset = (unsigned)(d >> 49) & 7;
    const unsigned mode = (unsigned)(d >> 62);
    const unsigned long long reserved = ~((0x3FFFull) | (0x3FFFull << 16) | (0x3FFFull << 32) | (7ull << 49) | (3ull << 62));
    if (d & reserved) fail(file, line, "wgmma descriptor %#llx sets reserved bits", d);
    if (base_offset) fail(file, line, "wgmma descriptor %#llx: base offset %u is not emulated", d, base_offset);
    if (mode == 1) {
        const unsigned a = start + (i / 8) * sbo + (i % 8) * 128 + (k / 8) * 16 + (k % 8) * 2;
        return a ^ (((a >> 7) & 7) << 4);
    }
    if (mode == 0) return start + (i / 8) * sbo + (i % 8) * 16 + (k / 8) * lbo + (k % 8) * 2;
    fail(file, line, "wgmma descriptor %#llx: swizzle mode %u (64 or 32 bytes) is not emulated", d, mode);
}

constexpr unsigned IN_FLIGHT = 0xffffffffu;  // an accumulator between its wgmma's issue and retire: a NaN

// Where thread f's copy from the last wgmma.fence holds register `reg`, or nullptr if it does not cover it.
unsigned char* fenced_copy(Fiber* f, const float* reg) {
    const unsigned char* p = (const unsigned char*)reg;
    if (!f->fence_lo || p < f->fence_lo || p + 4 > f->stack_top) return nullptr;
    return f->fenced.data() + (p - f->fence_lo);
}

// The emulator writes accumulator `reg` of thread f (in the copy too: a write the fence rule allows).
void write_accumulator(Fiber* f, float* reg, unsigned bits) {
    __builtin_memcpy(reg, &bits, 4);
    if (unsigned char* copy = fenced_copy(f, reg)) __builtin_memcpy(copy, &bits, 4);
}

void complete_wgmma_mma(unsigned first, const char* file, int line) {
    Warpgroup& wg = R.warpgroups[first / WARPGROUP];
    Fiber* lead = R.fibers[first];
    const int n = lead->wg_n, regs = n / 2;
    const unsigned long long da = lead->wg_desc[0], db = lead->wg_desc[1];
    for (unsigned t = 0; t < WARPGROUP; ++t) {
        const Fiber* f = R.fibers[first + t];
        if (f->wg_n != n || f->wg_desc[0] != da || f->wg_desc[1] != db || f->wg_scale != lead->wg_scale)
            fail(file, line, "wgmma.mma_async: thread %u passes other descriptors or shape than thread %u", first + t,
                 first);
    }
    if (!wg.fenced) fail(file, line, "wgmma.mma_async without a wgmma.fence before the first one");
    WgOp op{{}, {}, nullptr, ++R.wg_seq, file, line};
    op.addrs.reserve(16 * (64 + n));
    float a[64][16], b[256][16];
    for (int which = 0; which < 2; ++which) {
        const unsigned rows = which ? n : 64;
        for (unsigned i = 0; i < rows; ++i)
            for (unsigned k = 0; k < 16; ++k) {
                const unsigned addr = operand_address(which ? db : da, i, k, file, line);
                const unsigned short v = *(const unsigned short*)shared_ptr(addr, 2, file, line, "wgmma operand");
                if (const unsigned w = R.chunk_writer[addr / 16])
                    fail(file, line, "wgmma.mma_async reads shared address %#x, written by thread %u's cp.async "
                         "without a fence.proxy.async after it landed", addr, w - 1);
                op.addrs.push_back(addr), op.values.push_back(v);
                (which ? b[i][k] : a[i][k]) = emu_h2f(v);
            }
    }
    Chain* chain = nullptr;  // the accumulators: continue a pending chain on the same registers, or start one
    for (auto& c : wg.chains)
        if (c->regs[0] == lead->wg_acc[0]) chain = c.get();
    const bool continued = chain != nullptr;
    if (!chain) {
        wg.chains.push_back(std::make_unique<Chain>());
        chain = wg.chains.back().get();
        chain->first = first;
        chain->regs.resize(WARPGROUP * regs);
        chain->shadow.resize(WARPGROUP * regs);
        for (unsigned t = 0; t < WARPGROUP; ++t)
            for (int j = 0; j < regs; ++j) {
                chain->regs[t * regs + j] = R.fibers[first + t]->wg_acc[j];
                chain->shadow[t * regs + j] = *R.fibers[first + t]->wg_acc[j];
            }
    } else if ((int)chain->regs.size() != WARPGROUP * regs) {
        fail(file, line, "wgmma.mma_async: accumulators of another shape still pending");
    }
    for (unsigned t = 0; t < WARPGROUP; ++t) {
        const unsigned warp = t / 32, lane = t % 32;
        Fiber* owner = R.fibers[first + t];
        for (int j = 0; j < regs; ++j) {
            float* reg = owner->wg_acc[j];
            if (chain->regs[t * regs + j] != reg)
                fail(file, line, "wgmma.mma_async: thread %u's accumulator %d is not the register of the pending "
                     "wgmma on the same accumulators", first + t, j);
            const unsigned now = emu_float_bits(*reg);
            const unsigned char* copy = continued ? nullptr : fenced_copy(owner, reg);
            if (continued && now != IN_FLIGHT)
                fail(file, line, "wgmma.mma_async: thread %u wrote its accumulator %d while an earlier wgmma on it "
                     "was in flight (before the wgmma.wait_group that retires it)", first + t, j);
            if (copy && __builtin_memcmp(copy, &now, 4) != 0)
                fail(file, line, "wgmma.mma_async: thread %u wrote its accumulator %d after the last wgmma.fence, "
                     "which must come between that write and this wgmma", first + t, j);
            // Accumulator fragment (PTX ISA "WGMMA .m64nNk16 register fragment layout for accumulator matrix D")
            const unsigned row = 16 * warp + lane / 4 + 8 * ((j / 2) % 2), col = 8 * (j / 4) + 2 * (lane % 4) + j % 2;
            double s = lead->wg_scale ? chain->shadow[t * regs + j] : 0.0;
            for (int k = 0; k < 16; ++k) s += (double)a[row][k] * b[col][k];
            chain->shadow[t * regs + j] = (float)s;
            write_accumulator(owner, reg, IN_FLIGHT);  // reads NaN until the wait_group that retires it
        }
    }
    chain->last_seq = op.seq;
    op.chain = chain;
    wg.uncommitted.push_back(std::move(op));
}

void retire_wgmma(Warpgroup& wg, const std::vector<WgOp>& group, const char* file, int line) {
    for (const WgOp& op : group) {
        for (size_t i = 0; i < op.addrs.size(); ++i) {
            const unsigned short now = *(const unsigned short*)shared_ptr(op.addrs[i], 2, file, line, "wgmma operand");
            if (now != op.values[i])
                fail(file, line, "wgmma.wait_group: shared address %#x, an operand of the wgmma.mma_async at %s:%d, "
                     "changed before this wait retired it (%#06x -> %#06x)", op.addrs[i], short_name(op.file), op.line,
                     op.values[i], now);
        }
        if (op.seq == op.chain->last_seq) {
            const size_t regs = op.chain->regs.size() / WARPGROUP;
            for (size_t i = 0; i < op.chain->regs.size(); ++i) {
                Fiber* owner = R.fibers[op.chain->first + i / regs];
                if (emu_float_bits(*op.chain->regs[i]) != IN_FLIGHT)
                    fail(file, line, "wgmma.wait_group: thread %u wrote its accumulator %zu while the "
                         "wgmma.mma_async at %s:%d on it was in flight", owner->tid, i % regs, short_name(op.file),
                         op.line);
                write_accumulator(owner, op.chain->regs[i], emu_float_bits(op.chain->shadow[i]));
            }
            for (auto it = wg.chains.begin(); it != wg.chains.end(); ++it)
                if (it->get() == op.chain) {
                    wg.chains.erase(it);
                    break;
                }
        }
    }
}

// -- the scheduler -----------------------------------------------------------------------------------------
// Every thread is blocked: open the barrier, finish the block, or report the deadlock.
bool resolve_barrier() {
    current = nullptr;
    Fiber *waiting = nullptr, *exited = nullptr, *stuck = nullptr;
    for (unsigned t = 0; t < R.threads; ++t) {
        Fiber* f = R.fibers[t];
        if (f->state == AT_BARRIER) {
            if (waiting && (waiting->file != f->file || waiting->line != f->line))
                fail(nullptr, 0, "thread %u waits at __syncthreads (%s:%d), thread %u at another one (%s:%d)",
                     waiting->tid, short_name(waiting->file), waiting->line, t, short_name(f->file), f->line);
            if (!waiting) waiting = f;
        } else if (f->state == EXITED) {
            if (!exited) exited = f;
        } else if (!stuck) {
            stuck = f;
        }
    }
    if (stuck) {  // at a warp (or warpgroup) collective that some of its threads never reach
        const unsigned count = stuck->state == AT_WARP ? WARP : WARPGROUP, first = stuck->tid / count * count;
        const unsigned mask = stuck->state == AT_WARP ? stuck->warp->meeting.mask : 0xffffffffu;
        char why[96];
        for (unsigned i = 0; i < count; ++i) {
            if (count == WARP && !(mask >> i & 1u)) continue;
            Fiber* f = first + i < R.threads ? R.fibers[first + i] : nullptr;
            if (!f || f->state != stuck->state)
                fail(nullptr, 0, "deadlock: thread %u waits at a %s collective (%s:%d) that thread %u never reaches "
                     "(%s)", stuck->tid, count == WARP ? "warp" : "warpgroup", short_name(stuck->file), stuck->line,
                     first + i, f ? describe(f, why, sizeof why) : "it does not exist");
        }
        fail(nullptr, 0, "deadlock: thread %u waits at a collective (%s:%d)", stuck->tid, short_name(stuck->file),
             stuck->line);
    }
    if (!waiting) return false;  // every thread exited: the block is done
    if (exited)
        fail(nullptr, 0, "deadlock: thread %u waits at __syncthreads (%s:%d), which thread %u never reaches (it exited)",
             waiting->tid, short_name(waiting->file), waiting->line, exited->tid);
    for (unsigned t = 0; t < R.threads; ++t) R.fibers[t]->state = RUNNABLE;
    for (Warp& w : R.warp) w.runnable = w.present;
    return true;
}

void start_block(unsigned long long linear) {
    const emu_dim3 g = R.launch->grid, b = R.launch->block;
    emu_block_idx = {(unsigned)(linear % g.x), (unsigned)(linear / g.x % g.y), (unsigned)(linear / g.x / g.y)};
    const int schedule = R.launch->schedule;
    poison_shared();
    for (unsigned wi = 0; wi < R.warps; ++wi) {
        Warp& w = R.warp[wi];
        w.meeting = Meeting{};
        w.present = 0;
        for (unsigned k = 0; k < WARP; ++k) w.order[k] = (unsigned char)(schedule == EMU_REVERSE ? WARP - 1 - k : k);
        if (schedule == EMU_SHUFFLED) shuffle(w.order, WARP);
        for (unsigned k = 0; k < WARP; ++k) {
            const unsigned t = wi * WARP + w.order[k];
            if (t >= R.threads) continue;
            Fiber* f = R.fibers[t];
            f->tid = t, f->lane = w.order[k], f->pos = k, f->warp = &w;
            f->idx = {t % b.x, t / b.x % b.y, t / b.x / b.y};
            f->state = RUNNABLE;
            f->copies.clear(), f->group_ends.clear(), f->unfenced.clear();
            f->fence_lo = nullptr;
            context_start(f->ctx, f->stack_top);
            w.lanes[w.order[k]] = f;
            w.present |= 1u << k;
        }
        w.runnable = w.present;
    }
    for (auto& wg : R.warpgroups) wg = Warpgroup{};
}

void run_block(unsigned long long linear) {
    start_block(linear);
    std::vector<unsigned>& order = R.warp_order;
    order.resize(R.warps);
    const int schedule = R.launch->schedule;
    for (;;) {
        bool ran = false;
        for (unsigned w = 0; w < R.warps; ++w) order[w] = schedule == EMU_REVERSE ? R.warps - 1 - w : w;
        if (schedule == EMU_SHUFFLED) shuffle(order.data(), order.size());
        for (unsigned wi : order) {
            Warp& w = R.warp[wi];
            while (w.runnable) {  // a warp runs until all of its lanes are blocked
                resume(w.lanes[w.order[__builtin_ctz(w.runnable)]]);
                ran = true;
            }
        }
        if (!ran && !resolve_barrier()) break;
    }
    for (const Warpgroup& wg : R.warpgroups) {
        const WgOp* left = wg.uncommitted.empty() ? nullptr : &wg.uncommitted.front();
        for (const auto& group : wg.groups)
            if (!left && !group.empty()) left = &group.front();
        if (left || !wg.chains.empty())
            fail(left ? left->file : nullptr, left ? left->line : 0,
                 "the block ended with a wgmma.mma_async never retired by a wgmma.wait_group");
    }
    const unsigned char* canary = R.window + R.launch->dynamic_shared;
    for (unsigned i = 0; i < CANARY; ++i)
        if (canary[i] != 0xFF)
            fail(nullptr, 0, "wrote %u bytes past the end of its %u bytes of dynamic shared memory", i + 1,
                 R.launch->dynamic_shared);
}

void run_blocks(unsigned long long blocks) {
    std::vector<unsigned long long> order(blocks);
    for (unsigned long long i = 0; i < blocks; ++i) order[i] = R.launch->schedule == EMU_REVERSE ? blocks - 1 - i : i;
    if (R.launch->schedule == EMU_SHUFFLED) shuffle(order.data(), order.size());
    for (unsigned long long linear : order) run_block(linear);
}

// -- faults ------------------------------------------------------------------------------------------------
void on_fault(int sig, siginfo_t* info, void*) {
    if (!in_launch) {  // not ours: the default action
        signal(sig, SIG_DFL);
        return;
    }
    const emu_launch* L = R.launch;
    const char* what = in_guard_page(info->si_addr) ? "stack overflow of a fiber" : "invalid memory access";
    int n = snprintf(L->error, L->error_size, "%s block (%u, %u, %u)", L->kernel, emu_block_idx.x, emu_block_idx.y,
                     emu_block_idx.z);
    if (current && n < L->error_size)
        n += snprintf(L->error + n, L->error_size - n, " thread (%u, %u, %u)", current->idx.x, current->idx.y,
                      current->idx.z);
    if (n < L->error_size)
        snprintf(L->error + n, L->error_size - n, ": %s (%s at address %p)", what, sig == SIGBUS ? "SIGBUS" : "SIGSEGV",
                 info->si_addr);
    siglongjmp(launch_env, 1);
}

struct FaultGuard {  // our SIGSEGV / SIGBUS handler, on an alternate stack, for the length of a launch
    struct sigaction old_segv, old_bus;
    stack_t old_stack;
    static unsigned char alt_stack[1 << 16];
    FaultGuard() {
        stack_t st{};
        st.ss_sp = alt_stack, st.ss_size = sizeof alt_stack;
        sigaltstack(&st, &old_stack);
        struct sigaction sa{};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &old_segv);
        sigaction(SIGBUS, &sa, &old_bus);
        in_launch = 1;
    }
    ~FaultGuard() {
        in_launch = 0;
        sigaction(SIGSEGV, &old_segv, nullptr);
        sigaction(SIGBUS, &old_bus, nullptr);
        sigaltstack(&old_stack, nullptr);
    }
};
unsigned char FaultGuard::alt_stack[1 << 16];

}  // namespace

// -- the ABI -----------------------------------------------------------------------------------------------
EMU_API int emu_run(const emu_launch* L, void (*body)(void**), void** params, unsigned char* shared_start,
                    unsigned char* shared_stop) {
    R.launch = L;
    current = nullptr;
    const emu_dim3 b = L->block, g = L->grid;
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    const unsigned long long blocks = (unsigned long long)g.x * g.y * g.z;
    emu_block_idx = {0, 0, 0};
    if (!threads || threads > MAX_THREADS || !blocks || b.z > 64 || g.y > 65535 || g.z > 65535) {
        snprintf(L->error, L->error_size, "%s: bad launch: grid (%u, %u, %u), block (%u, %u, %u)", L->kernel, g.x, g.y,
                 g.z, b.x, b.y, b.z);
        return 1;
    }
    R.static_shared = shared_start, R.static_bytes = (unsigned)(shared_stop - shared_start);
    R.dynamic_base = (R.static_bytes + 15u) & ~15u;
    // (The static part is every kernel's of the library: one section. Ours never come near the limit with it.)
    if (L->dynamic_shared > MAX_SHARED || R.dynamic_base + L->dynamic_shared > MAX_SHARED) {
        snprintf(L->error, L->error_size, "%s: %u bytes of static and %u of dynamic shared memory: more than a block "
                 "may have (%u)", L->kernel, R.static_bytes, L->dynamic_shared, MAX_SHARED);
        return 1;
    }
    if (!window_memory) window_memory = (unsigned char*)aligned_alloc(1024, MAX_SHARED + CANARY);
    R.window = window_memory;
    R.shared_bytes = R.dynamic_base + L->dynamic_shared;
    R.chunk_writer.assign(R.shared_bytes / 16 + 1, 0);
    R.body = body, R.params = params;
    R.threads = (unsigned)threads, R.warps = (R.threads + WARP - 1) / WARP;
    R.rng = L->seed * 0x9E3779B97F4A7C15ull + 1;
    while (pool.size() < R.threads)
        if (!make_fiber()) {
            snprintf(L->error, L->error_size, "%s: cannot map fiber stacks for %u threads", L->kernel, R.threads);
            return 1;
        }
    R.fibers.resize(R.threads);
    for (unsigned t = 0; t < R.threads; ++t) R.fibers[t] = pool[t].get();
    R.warp.assign(R.warps, Warp{});
    R.warpgroups.resize((R.threads + WARPGROUP - 1) / WARPGROUP);
    emu_block_dim = b, emu_grid_dim = g;

    context_main(scheduler);
    FaultGuard guard;
    if (sigsetjmp(launch_env, 1)) {
        current = nullptr;
        return 1;
    }
    run_blocks(blocks);
    current = nullptr;
    return 0;
}

EMU_API void emu_fail(const char* file, int line, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_v(file, line, fmt, ap);
}

// -fsanitize=alignment's check in kernel code (build.py): a typed load or store at an address its type's
// alignment does not divide, which faults on the GPU ("misaligned address") but not on x86, fails the launch
// like any stray access. GCC's (and clang's) layout of the check's static data. Only the alignment check is
// compiled in; a null pointer (-fsanitize=null) or size report would come through the same handler.
struct UbsanLocation {
    const char* file;
    unsigned line, column;
};
struct UbsanType {
    unsigned short kind, info;
    char name[1];  // quoted by GCC: 'const struct float4'
};
struct UbsanTypeMismatch {
    UbsanLocation where;
    const UbsanType* type;
    unsigned char log_alignment, check_kind;
};

[[noreturn]] static void type_mismatch(const UbsanTypeMismatch* d, unsigned long long p) {
    static const char* const kinds[] = {"load of", "store to", "reference binding to", "member access within",
                                        "member call on", "constructor call on", "downcast of", "downcast of",
                                        "upcast of", "cast to virtual base of", "_Nonnull binding to",
                                        "dynamic operation on"};
    const char* kind = d->check_kind < sizeof kinds / sizeof *kinds ? kinds[d->check_kind] : "access to";
    const unsigned long long align = 1ull << d->log_alignment;
    if (!in_launch) {  // kernel code runs only inside a launch; nothing to report through
        fprintf(stderr, "cullama.runtime.emu: %s:%u: %s %#llx outside a launch\n", d->where.file, d->where.line, kind, p);
        abort();
    }
    if (p == 0) fail(d->where.file, (int)d->where.line, "%s null pointer of type %s", kind, d->type->name);
    if (p % align)
        fail(d->where.file, (int)d->where.line, "%s misaligned address %#llx for type %s, which requires %llu-byte "
             "alignment", kind, p, d->type->name, align);
    fail(d->where.file, (int)d->where.line, "%s address %#llx with insufficient space for an object of type %s", kind,
         p, d->type->name);
}

EMU_API void __ubsan_handle_type_mismatch_v1(const UbsanTypeMismatch* d, unsigned long long p) { type_mismatch(d, p); }
EMU_API void __ubsan_handle_type_mismatch_v1_abort(const UbsanTypeMismatch* d, unsigned long long p) {
    type_mismatch(d, p);
}

EMU_API void emu_syncthreads(const char* file, int line) { block_at(AT_BARRIER, file, line); }

EMU_API unsigned long long emu_shfl(int kind, unsigned mask, unsigned long long bits, int arg, int width,
                                    const char* file, int line) {
    if (width < 1 || width > WARP || (width & (width - 1))) fail(file, line, "%s with width %d", OP_NAMES[kind], width);
    Fiber* f = current;
    Warp& w = *f->warp;
    w.in[f->lane] = bits, w.arg[f->lane] = arg;
    if (arrive_warp(w, mask, kind, file, line)) {
        complete_shfl(w, kind, mask, width);
        release_warp(w);
    }
    return w.out[f->lane];
}

EMU_API unsigned emu_reduce(int op, int is_signed, unsigned mask, unsigned value, const char* file, int line) {
    Fiber* f = current;
    Warp& w = *f->warp;
    w.in[f->lane] = value;
    if (arrive_warp(w, mask, OP_REDUCE + op, file, line)) {
        complete_reduce(w, op, is_signed, mask);
        release_warp(w);
    }
    return (unsigned)w.out[f->lane];
}

EMU_API void* emu_dynamic_shared(void) { return R.window; }

EMU_API unsigned emu_shared_address(const void* p, const char* file, int line) {
    const unsigned char* c = (const unsigned char*)p;
    if (c >= R.static_shared && c < R.static_shared + R.static_bytes) return (unsigned)(c - R.static_shared);
    if (c >= R.window && c <= R.window + R.launch->dynamic_shared) return R.dynamic_base + (unsigned)(c - R.window);
    fail(file, line, "cvta.to.shared of %p, which is not in shared memory", p);
}

EMU_API void emu_cp_async(unsigned dst, const void* src, unsigned src_size, const char* file, int line) {
    if (src_size > 16) fail(file, line, "cp.async of 16 bytes with src-size %u", src_size);
    if (dst % 16 || (unsigned long long)src % 16)
        fail(file, line, "cp.async of 16 bytes: destination %#x or source %p not 16-byte aligned", dst, src);
    memset(shared_ptr(dst, 16, file, line, "cp.async"), 0xFF, 16);  // in flight: poisoned until its wait_group
    current->copies.push_back(Copy{dst, (const unsigned char*)src, src_size});
}

EMU_API void emu_cp_async_commit(void) { current->group_ends.push_back(current->copies.size()); }

EMU_API void emu_cp_async_wait(int pending, const char* file, int line) {
    Fiber* f = current;
    if (pending < 0) fail(file, line, "cp.async.wait_group %d", pending);
    const size_t groups = f->group_ends.size();
    if (groups <= (size_t)pending) return;
    const size_t retire = groups - pending, n = f->group_ends[retire - 1];
    retire_copies(f, n);
    f->group_ends.erase(f->group_ends.begin(), f->group_ends.begin() + retire);
    for (size_t& end : f->group_ends) end -= n;
}

EMU_API void emu_ldmatrix_x4(unsigned* r, unsigned addr, int trans, const char* file, int line) {
    Fiber* f = current;
    Warp& w = *f->warp;
    w.frag_in[f->lane][0] = addr;
    if (arrive_warp(w, 0xffffffffu, OP_LDMATRIX + trans, file, line)) {
        complete_ldmatrix(w, trans, file, line);
        release_warp(w);
    }
    memcpy(r, w.frag_out[f->lane], 16);
}

EMU_API void emu_mma_m16n8k16(float* d, const unsigned* a, unsigned b0, unsigned b1, const char* file, int line) {
    Fiber* f = current;
    Warp& w = *f->warp;
    unsigned* in = w.frag_in[f->lane];
    for (int i = 0; i < 4; ++i) in[i] = a[i], in[6 + i] = emu_float_bits(d[i]);
    in[4] = b0, in[5] = b1;
    if (arrive_warp(w, 0xffffffffu, OP_MMA, file, line)) {
        complete_mma(w);
        release_warp(w);
    }
    for (int i = 0; i < 4; ++i) d[i] = emu_bits_float(w.frag_out[f->lane][i]);
}

EMU_API void emu_read_only_load(const void* p, unsigned long long bytes) {
    const emu_launch* L = R.launch;
    const unsigned char* c = (const unsigned char*)p;
    for (int i = 0; i < L->spans; ++i) {  // a few spans: one per array argument at most
        const unsigned char* start = L->span_start[i];
        if (c >= start && c < start + L->span_bytes[i]) {
            const unsigned long long offset = (unsigned long long)(c - start), left = L->span_bytes[i] - offset;
            memset(L->span_read_only[i] + offset, 1, bytes < left ? bytes : left);
            return;
        }
    }  // outside every argument: a read of the guard bytes (or a stray one), checked elsewhere
}

EMU_API void emu_fence_proxy_async(void) {
    Fiber* f = current;
    for (unsigned chunk : f->unfenced)
        if (R.chunk_writer[chunk] == f->tid + 1) R.chunk_writer[chunk] = 0;
    f->unfenced.clear();
}

EMU_API void emu_wgmma_sync(int op, int arg, const char* file, int line) {
    Fiber* f = current;
    const unsigned first = f->tid / WARPGROUP * WARPGROUP;
    if (first + WARPGROUP > R.threads) fail(file, line, "%s in a block without whole warpgroups", OP_NAMES[OP_WGMMA + op]);
    Warpgroup& wg = warpgroup_of(f);
    if (op == 0) f->fence_lo = (unsigned char*)__builtin_frame_address(0);  // its caller's frames lie above
    if (!arrive_warpgroup(wg, OP_WGMMA + op, file, line)) return;
    if (op == 0) {  // every thread's registers as they are now: writes before the fence are ordered
        wg.fenced = true;
        for (unsigned t = first; t < first + WARPGROUP; ++t)
            R.fibers[t]->fenced.assign(R.fibers[t]->fence_lo, R.fibers[t]->stack_top);
    } else if (op == 1) {
        wg.groups.push_back(std::move(wg.uncommitted));
        wg.uncommitted.clear();
    } else {
        if (arg < 0) fail(file, line, "wgmma.wait_group %d", arg);
        while (wg.groups.size() > (size_t)arg) {
            retire_wgmma(wg, wg.groups.front(), file, line);
            wg.groups.pop_front();
        }
    }
    release_warpgroup(wg, first);
}

EMU_API void emu_wgmma_mma(int n, float** acc, unsigned long long desc_a, unsigned long long desc_b, int scale_d,
                           const char* file, int line) {
    Fiber* f = current;
    const unsigned first = f->tid / WARPGROUP * WARPGROUP;
    if (first + WARPGROUP > R.threads) fail(file, line, "wgmma.mma_async in a block without whole warpgroups");
    f->wg_acc = acc, f->wg_n = n, f->wg_desc[0] = desc_a, f->wg_desc[1] = desc_b, f->wg_scale = scale_d;
    Warpgroup& wg = warpgroup_of(f);
    if (arrive_warpgroup(wg, OP_WGMMA + 3, file, line)) {
        complete_wgmma_mma(first, file, line);
        release_warpgroup(wg, first);
    }
    f->wg_acc = nullptr;
}

// For the tests: the conversions every FP16 value of the emulator goes through, on whole arrays.
EMU_API void emu_f2h_array(const float* in, unsigned short* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = emu_f2h(in[i]);
}
EMU_API void emu_h2f_array(const unsigned short* in, float* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = emu_h2f(in[i]);
}
