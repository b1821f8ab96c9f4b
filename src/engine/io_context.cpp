#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <ringverbs/engine/detail/uring_hooks.hpp>

#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <new>
#include <string>
#include <thread>

namespace ringverbs {

namespace {

// The io_context whose loop (run_once(), run(), run(task)) is on this thread's stack:
// push_remote() from inside it needs no eventfd write, the loop looks at the queue before it
// sleeps. initial-exec: read at a fixed offset from the thread pointer instead of through
// __tls_get_addr (the default model in a shared library). A program
// linked with the library has it in its static TLS block; one that dlopen()s it gets these 8
// bytes from glibc's reserve of static TLS, which exists for such variables.
[[gnu::tls_model("initial-exec")]] thread_local io_context* running_context = nullptr;

std::string io_uring_unavailable_reason(int err) {
    std::string why = "io_uring_queue_init_params";
    if (err == ENOSYS) return why + ": io_uring is not available in this kernel (ENOSYS)";
    if (err == EPERM) {
        std::ifstream f("/proc/sys/kernel/io_uring_disabled");
        int disabled = 0;
        if (f >> disabled && disabled != 0)
            return why + ": io_uring is disabled by the sysctl kernel.io_uring_disabled=" +
                   std::to_string(disabled) + " (EPERM)";
        return why + ": io_uring is not permitted for this process (EPERM: "
                     "kernel.io_uring_disabled, a seccomp filter or a container policy)";
    }
    return why;
}

// The CQE at the completion ring's head, copied, and the head moved past it (the kernel may
// reuse its slot from then on). The ring must hold one.
[[gnu::always_inline]] inline detail::set_aside_cqe consume_head(io_uring& ring) noexcept {
    const io_uring_cqe* cqe = &ring.cq.cqes[*ring.cq.khead & ring.cq.ring_mask];
    const detail::set_aside_cqe c{cqe->user_data, cqe->res, cqe->flags};
    io_uring_cq_advance(&ring, 1);
    return c;
}

} // namespace

io_context::io_context(io_context_options options) {
    // Most wanted first. DEFER_TASKRUN (6.1) needs SINGLE_ISSUER (6.0); COOP_TASKRUN (5.19)
    // and SUBMIT_ALL (5.18) are older. A kernel that does not know a flag says EINVAL.
    const unsigned base = IORING_SETUP_CQSIZE | IORING_SETUP_SUBMIT_ALL;
    // A SINGLE_ISSUER ring belongs to the task that enables it: start it disabled so that it
    // belongs to the thread that first runs the context, not the one that built it.
    const unsigned attempts[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_R_DISABLED,
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_R_DISABLED,
        IORING_SETUP_COOP_TASKRUN,
        0,
    };
    int err = EINVAL;
    for (unsigned extra : attempts) {
        if (!options.single_issuer && (extra & IORING_SETUP_SINGLE_ISSUER)) continue;
        for (unsigned b : {base, unsigned{IORING_SETUP_CQSIZE}}) {
            io_uring_params p{};
            p.flags = b | extra;
            p.cq_entries = options.cq_entries;
            // At least 4: a timed wait holds one slot back while its post may take two.
            int r = io_uring_queue_init_params(std::max(options.sq_entries, 4u), &ring_, &p);
            if (r == 0) {
                setup_flags_ = p.flags & ~unsigned{IORING_SETUP_R_DISABLED};
                ring_disabled_ = (p.flags & IORING_SETUP_R_DISABLED) != 0;
                err = 0;
                break;
            }
            err = -r;
            if (err != EINVAL) break;
        }
        if (err != EINVAL) break;
    }
    if (err != 0) throw_system_error(err, io_uring_unavailable_reason(err));

    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) {
        int e = errno;
        io_uring_queue_exit(&ring_);
        throw_system_error(e, "eventfd (io_context wakeup)");
    }
    ready_.reserve(64);
    resuming_.reserve(64);
    wakeup_.ctx = this;

    wakeup_.on_cqe = [](detail::operation* op, int, unsigned) noexcept {
        auto* w = static_cast<wakeup_op*>(op);
        w->armed = false;
        if (w->ctx->shutting_down_) return;
        // In the CQE loop, where nothing may throw: a ring that has no SQE to give right now
        // (submission failing under pressure) gets the read re-armed on the next turn.
        try {
            w->ctx->arm_wakeup();
        } catch (...) {
            w->ctx->wakeup_rearm_due_ = true;
        }
    };
    arm_wakeup();
}

// Cross-thread wakeup: an eventfd on which the ring keeps a read pending, so one write from
// another thread completes the read and wakes the ring, and the read itself resets the
// counter (no extra syscall on our side). The alternative, IORING_OP_MSG_RING from the
// sender's ring, needs a ring on the sending thread; tests/bench/post_bench.cpp measures both
// side by side: on kernel 6.18 with 2 cores, eventfd 2.6-3.2 us per round trip, msg_ring
// 2.8-3.3 us, so the eventfd, which also serves threads without a ring, is kept.
void io_context::arm_wakeup() {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_read(sqe, wake_fd_, &wakeup_.value, sizeof wakeup_.value, 0);
    io_uring_sqe_set_data(sqe, static_cast<detail::operation*>(&wakeup_));
    wakeup_.armed = true;
}

void io_context::arm_wakeup_retry() {
    wakeup_rearm_due_ = false;
    if (wakeup_.armed || shutting_down_) return;
    try {
        arm_wakeup();
    } catch (...) {
        wakeup_rearm_due_ = true; // next turn again; meanwhile cross-thread posts wait
        throw;
    }
}

io_context::~io_context() {
    shutting_down_ = true;
    // One cancel request matches every request in flight, the wakeup read included.
    // Awaitables refuse new operations from here on, so none escapes it.
    // No SQE for it (the ring full and submitting refused for good): nothing in flight could
    // be reaped, so none is waited for; io_uring_queue_exit below ends them in the kernel,
    // without their handlers (what they would have freed is left).
    bool cancelled = true;
    try {
        io_uring_sqe* sqe = get_sqe();
        io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
        io_uring_sqe_set_data64(sqe, detail::ignored_user_data);
    } catch (const std::exception& e) {
        detail::diagnose("~io_context: the cancel of what is in flight could not be queued (%s): "
                         "the ring's exit ends it, without its handlers",
                         e.what());
        cancelled = false;
    }
    io_context* outer = std::exchange(running_context, this);
    while (cancelled) {
        drain_remote();
        if (ready_.empty() && in_flight_ == 0 && background_ == 0 && !wakeup_.armed &&
            remote_head_.load(std::memory_order_acquire) == nullptr)
            break;
        try {
            submit_and_reap(ready_.empty(), false);
        } catch (const std::exception& e) {
            detail::diagnose("~io_context: %s", e.what());
            break;
        }
        resume_ready();
    }
    running_context = outer;
    // What is still suspended waits for something that will never come (a when_all sibling,
    // a source that is gone): no kernel request refers to it any more, so it can go.
    while (spawned_)
        std::coroutine_handle<detail::spawned_promise>::from_promise(*spawned_).destroy();
    for (auto& e : reported_) {
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            detail::diagnose("exception from a spawned task lost at io_context destruction: %s",
                             ex.what());
        } catch (...) {
            detail::diagnose("exception from a spawned task lost at io_context destruction");
        }
    }
    while (posters_.load() != 0)
        std::this_thread::yield();
    ::close(wake_fd_);
    io_uring_queue_exit(&ring_);
}

io_uring_sqe* io_context::get_sqe_after_room(unsigned reserve) {
    room_for(reserve);
    return io_uring_get_sqe(&ring_);
}

// Makes room for `count` SQEs besides the held-back ones, submitting what is queued when the
// ring is too full.
void io_context::room_for(unsigned count) {
    for (int attempt = 0;; ++attempt) {
        if (io_uring_sq_space_left(&ring_) >= count + reserved_) return;
        if (count + reserved_ > ring_.sq.ring_entries) // no submission could make that room
            throw_system_error(ENOBUFS, "io_uring_get_sqe");
        if (attempt == 0) ++counters_.sq_full;
        enable_ring();
        int r = detail::io_uring_hooks().submit(&ring_);
        if (r >= 0 || r == -EINTR) continue;
        if ((r == -EBUSY || r == -EAGAIN) && attempt + 1 < detail::get_sqe_submit_attempts) {
            set_cqes_aside(); // make room in the completion ring, then try again
            continue;
        }
        throw_system_error(-r, "io_uring_submit");
    }
}

void io_context::cancel(detail::operation* op) {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_cancel64(sqe, reinterpret_cast<std::uint64_t>(op), 0);
    io_uring_sqe_set_data64(sqe, detail::ignored_user_data);
}

// Another thread's push can be consumed, and the context destroyed, before that thread's
// wake() has written the eventfd: posters_ counts the threads between the two, and the
// destructor waits for them before it closes the eventfd.
void io_context::push_remote(detail::remote_node* node) noexcept {
    posters_.fetch_add(1);
    detail::remote_node* head = remote_head_.load(std::memory_order_relaxed);
    do {
        node->next = head;
    } while (!remote_head_.compare_exchange_weak(head, node, std::memory_order_release,
                                                 std::memory_order_relaxed));
    // Only the push onto an empty queue needs to wake the loop: a non-empty queue means a
    // wake is already on its way, or the loop has not drained it yet.
    if (head == nullptr && running_context != this) wake();
    posters_.fetch_sub(1);
}

void io_context::wake() noexcept {
    std::uint64_t one = 1;
    // EAGAIN means the counter is saturated: a wake is pending anyway.
    [[maybe_unused]] ssize_t r = ::write(wake_fd_, &one, sizeof one);
}

void io_context::stop() noexcept {
    posters_.fetch_add(1);
    stop_requested_.store(true, std::memory_order_relaxed);
    if (running_context != this) wake();
    posters_.fetch_sub(1);
}

void io_context::work_guard::reset() noexcept {
    if (!ctx_) return;
    io_context* c = std::exchange(ctx_, nullptr);
    c->posters_.fetch_add(1);
    if (c->external_work_.fetch_sub(1, std::memory_order_acq_rel) == 1 && running_context != c)
        c->wake();
    c->posters_.fetch_sub(1);
}

void io_context::post(std::function<void()> fn) {
    struct node : detail::remote_node {
        std::function<void()> fn;
    };
    auto* n = new node;
    n->fn = std::move(fn);
    n->run = [](detail::remote_node* self) noexcept {
        auto* me = static_cast<node*>(self);
        try {
            me->fn();
        } catch (...) {
            // Reported like an exception from a spawned task.
            running_context->report(std::current_exception());
        }
        delete me;
    };
    push_remote(n);
}

void io_context::run_remote() {
    detail::remote_node* list = remote_head_.exchange(nullptr, std::memory_order_acquire);
    // The queue is a stack: reverse it so nodes run in the order they were pushed.
    detail::remote_node* fifo = nullptr;
    while (list) {
        detail::remote_node* next = list->next;
        list->next = fifo;
        fifo = list;
        list = next;
    }
    while (fifo) {
        detail::remote_node* next = fifo->next; // run() may end the node's life
        fifo->run(fifo);
        fifo = next;
    }
}

// Empties the completion ring into set_aside_ without running a handler: get_sqe() is called
// from awaiters, pollers and CQE handlers, whose objects a handler run there could end (a
// qp's flush timer releasing the cq a poller is draining). reap() handles them first.
void io_context::set_cqes_aside() {
    // Room for all of them first: a CQE is never half taken, and the caller (often noexcept,
    // catching std::system_error to retry on a later turn) gets ENOMEM, not std::bad_alloc.
    try {
        set_aside_.reserve(set_aside_.size() + io_uring_cq_ready(&ring_));
    } catch (const std::bad_alloc&) {
        throw_system_error(ENOMEM, "io_uring_submit (no memory to set the completion ring's "
                                   "CQEs aside)");
    }
    ++ring_emptied_;
    while (io_uring_cq_ready(&ring_) != 0) {
        const detail::set_aside_cqe c = consume_head(ring_);
        if (c.user_data != detail::ignored_user_data) set_aside_.push_back(c); // reserved
    }
}

void io_context::reap() {
    // Not re-entrant (`aside` below): handlers never run the loop, get_sqe() never reaps.
    // One pass handles what was there when it began: CQEs its handlers cause (a re-armed poll
    // of a still-readable fd completes at once) wait for the next pass, after the coroutines
    // the handlers woke have run. What get_sqe() set aside comes first (it is older than what
    // the ring holds now); a handler that sets more aside (get_sqe() again, which empties the
    // ring) puts it after, in this pass. Each CQE is consumed before its handler runs, so the
    // ring's head is right whatever the handler does.
    if (!set_aside_.empty()) [[unlikely]] {
        reap_from(set_aside_.size() + io_uring_cq_ready(&ring_));
        return;
    }
    // The common pass: nothing set aside, the CQEs taken from the ring one by one. A handler
    // whose get_sqe() emptied the ring (setting its CQEs aside, or dropping them when ignored:
    // the ring may hold fewer than `due` now, even none) hands the rest of the pass to
    // reap_from, which takes what was set aside first and looks at the ring before each CQE.
    const std::uint64_t emptied = ring_emptied_;
    for (unsigned due = io_uring_cq_ready(&ring_); due > 0;) {
        --due;
        const detail::set_aside_cqe c = consume_head(ring_);
        if (c.user_data == detail::ignored_user_data) continue;
        auto* op = reinterpret_cast<detail::operation*>(c.user_data);
        op->on_cqe(op, c.res, c.flags);
        if (ring_emptied_ != emptied) [[unlikely]] {
            reap_from(due);
            return;
        }
    }
}

// reap(), once CQEs were set aside: `due` CQEs of this pass are left, set_aside_'s first.
void io_context::reap_from(std::size_t due) {
    std::size_t aside = 0; // set_aside_[0, aside) handled
    for (; due > 0; --due) {
        detail::set_aside_cqe c;
        if (aside < set_aside_.size()) {
            c = set_aside_[aside++];
        } else if (io_uring_cq_ready(&ring_) != 0) {
            c = consume_head(ring_);
            if (c.user_data == detail::ignored_user_data) continue;
        } else {
            break;
        }
        auto* op = reinterpret_cast<detail::operation*>(c.user_data);
        op->on_cqe(op, c.res, c.flags);
    }
    if (aside == set_aside_.size())
        set_aside_.clear();
    else if (aside != 0)
        set_aside_.erase(set_aside_.begin(),
                         set_aside_.begin() + static_cast<std::ptrdiff_t>(aside));
}

void io_context::enable_ring() {
    if (!ring_disabled_) return;
    // liburing 2.3 declares io_uring_enable_rings() but does not export it.
    if (::syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0) <
        0)
        throw_system_error(errno, "io_uring_register(IORING_REGISTER_ENABLE_RINGS)");
    ring_disabled_ = false;
    // The ring belongs to this thread from now on (SINGLE_ISSUER): register its fd with this
    // thread's io_uring context, so that each io_uring_enter names it by index and skips the
    // file lookup (5.18). A failure (no free slot, an older kernel) only costs that saving.
    ring_fd_registered_ = io_uring_register_ring_fd(&ring_) == 1;
}

namespace {

// io_uring_enter(2) without a signal mask, as liburing 2.3's wrapper makes it on x86-64 (which
// passes the mask's size, 8, where this passes 0: the kernel reads it only with a mask): the
// instruction inline, the result -errno or what the kernel returned.
inline int sys_io_uring_enter(int fd, unsigned submit, unsigned wait, unsigned flags) noexcept {
#if defined(__x86_64__)
    long ret = __NR_io_uring_enter;
    register long r10 __asm__("r10") = flags;
    register long r8 __asm__("r8") = 0; // no signal mask
    register long r9 __asm__("r9") = 0;
    __asm__ volatile("syscall"
                     : "+a"(ret)
                     : "D"(static_cast<long>(fd)), "S"(static_cast<long>(submit)),
                       "d"(static_cast<long>(wait)), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return static_cast<int>(ret);
#else
    const long r = ::syscall(__NR_io_uring_enter, fd, submit, wait, flags, nullptr, 0);
    return r < 0 ? -errno : static_cast<int>(r);
#endif
}

} // namespace

// io_uring_submit_and_wait(&ring_, 1) for this ring (no SQPOLL: the kernel reads the
// submission ring's tail only inside io_uring_enter, so a plain store publishes it): the
// loop's wait without the library's calls and branches (tools/bench-cost: liburing 2.3 took
// 42 instructions a wait).
int io_context::submit_and_wait_one() noexcept {
    io_uring_sq& sq = ring_.sq;
    const unsigned tail = sq.sqe_tail;
    if (sq.sqe_head != tail) {
        sq.sqe_head = tail;
        __atomic_store_n(sq.ktail, tail, __ATOMIC_RELAXED);
    }
    const unsigned submit = tail - *sq.khead;
    return sys_io_uring_enter(ring_.enter_ring_fd, submit, 1,
                              IORING_ENTER_GETEVENTS |
                                  (ring_fd_registered_ ? IORING_ENTER_REGISTERED_RING : 0u));
}

void io_context::submit_and_reap(bool wait, bool spinning) {
    if (ring_disabled_) [[unlikely]]
        enable_ring();
    int r;
    const bool defer = (setup_flags_ & IORING_SETUP_DEFER_TASKRUN) != 0;
    const bool coop = (setup_flags_ & IORING_SETUP_COOP_TASKRUN) != 0;
    if (wakeup_rearm_due_) arm_wakeup_retry();
    if (wait && io_uring_cq_ready(&ring_) == 0 && set_aside_.empty())
        r = submit_and_wait_one();
    else if (io_uring_cq_has_overflow(&ring_)) {
        // CQEs the kernel could not post (the CQ ring was full) wait in its overflow list
        // until someone enters with GETEVENTS: the shortcuts below would strand them (a
        // timer, an rdma_cm event) for as long as the loop spins.
        ++counters_.cq_overflows;
        r = io_uring_submit_and_get_events(&ring_);
    } else if (io_uring_sq_ready(&ring_) > 0)
        r = defer ? io_uring_submit_and_get_events(&ring_) : io_uring_submit(&ring_);
    else if (!defer && !coop)
        r = 0; // completions are posted without us (task work runs by signal): read below
    else if (spinning && (in_flight_ + background_ == 0 || (++spin_turns_ & 15u) != 0))
        // A busy-polling channel turns the loop as fast as it can; entering the kernel each
        // turn only to collect io_uring completions (DEFER_TASKRUN posts them only then;
        // COOP_TASKRUN runs their task work only when we enter) would put a syscall between
        // every two polls of the CQ. Every 16th turn is enough, and none when no request is
        // in the kernel. The same holds for a turn that starts with coroutines ready (made
        // ready by the previous turn's coroutines: a receiver handing a message to a
        // sender): they run now, and the ring is looked at again within 16 such turns.
        r = 0;
    else
        r = io_uring_get_events(&ring_); // GETEVENTS: runs task work, posts completions
    if (r < 0 && r != -EINTR && r != -EBUSY && r != -EAGAIN && r != -ETIME)
        throw_system_error(-r, "io_uring_enter");
    reap();
}

std::size_t io_context::resume_ready() {
    // Resume only what was ready at the start: a coroutine that makes another ready (or
    // itself, by yielding) lets this turn end and the ring be looked at again.
    if (ready_.empty()) return 0; // a spinning turn that found nothing
    if (ready_.size() == 1) {     // the common turn, without the swap
        const std::coroutine_handle<> h = ready_.front();
        ready_.clear();
        h.resume();
        return 1;
    }
    resuming_.swap(ready_);
    std::size_t n = resuming_.size();
    for (std::size_t i = 0; i < n; ++i)
        resuming_[i].resume();
    resuming_.clear();
    return n;
}

void io_context::queue_poller_in_order(detail::poller* p) noexcept {
    if (p->queued) return;
    p->queued = true;
    detail::poller** at = &pollers_;
    while (*at && (*at)->priority >= p->priority)
        at = &(*at)->next;
    p->next = *at;
    *at = p;
}

void io_context::dequeue_poller(detail::poller* p) noexcept {
    if (!p->queued) return;
    for (detail::poller** at = &pollers_; *at; at = &(*at)->next) {
        if (*at == p) {
            *at = p->next;
            break;
        }
    }
    p->queued = false;
    p->next = nullptr;
}

void io_context::run_pollers() {
    // Take this turn's list: pollers queued while it runs go to the next turn.
    detail::poller* list = std::exchange(pollers_, nullptr);
    while (list) {
        detail::poller* p = list;
        list = p->next;
        p->next = nullptr;
        p->queued = false;
        p->run(p);
    }
}

bool io_context::out_of_work() const noexcept {
    return in_flight_ == 0 && waiting_ == 0 && external_work_.load(std::memory_order_acquire) == 0;
}

namespace {
// Sets the thread's running_context for a scope, and puts the outer one back at its end.
struct running_scope {
    io_context* outer;
    explicit running_scope(io_context* ctx) noexcept : outer(std::exchange(running_context, ctx)) {}
    ~running_scope() { running_context = outer; }
    running_scope(const running_scope&) = delete;
    running_scope& operator=(const running_scope&) = delete;
};
} // namespace

// One turn: submit and wait, reap, pollers, resume. Inlined into run_once, run() and
// run_until(), which are flattened: a turn runs without calls between the loop's own
// functions (tools/bench-cost: about 20 instructions a turn), and run() and run_until() pay
// their entry and exit once, not every turn (18 instructions a turn when they called
// run_once).
[[gnu::always_inline]] inline std::size_t io_context::turn(bool block) {
    drain_remote();
    const bool spinning = pollers_ != nullptr;
    const bool ready_empty = ready_.empty();
    bool wait = block && !spinning && ready_empty && !stopped() &&
                remote_head_.load(std::memory_order_relaxed) == nullptr;
    submit_and_reap(wait, spinning || !ready_empty);
    drain_remote();
    run_pollers();
    std::size_t n = resume_ready();
    if (!reported_.empty()) [[unlikely]]
        rethrow_reported();
    return n;
}

[[gnu::flatten]] std::size_t io_context::run_once(bool block) {
    const running_scope scope(this);
    return turn(block);
}

[[gnu::flatten]] void io_context::run_until(const bool& done) {
    const running_scope scope(this);
    while (!done)
        turn(true);
}

[[gnu::flatten]] void io_context::run() {
    const running_scope scope(this);
    while (!stopped()) {
        if (ready_.empty() && out_of_work() &&
            remote_head_.load(std::memory_order_acquire) == nullptr)
            return;
        turn(true);
    }
}

void io_context::finish_teardown() {
    while (teardown_ > 0 && !stopped())
        run_once(true); // a flush, or the flush timer's CQE, is due within flush_timeout
}

void io_context::spawn(task<void> t) {
    auto c = detail::run_spawned(*this, std::move(t));
    ready(c.handle);
}

void io_context::set_exception_handler(std::function<void(std::exception_ptr)> handler) {
    exception_handler_ = std::move(handler);
}

void io_context::report(std::exception_ptr e) {
    if (exception_handler_ && !shutting_down_) {
        exception_handler_(std::move(e));
        return;
    }
    reported_.push_back(std::move(e));
}

void io_context::rethrow_reported() {
    if (reported_.empty() || shutting_down_) return;
    std::exception_ptr e = reported_.front();
    reported_.erase(reported_.begin());
    std::rethrow_exception(e);
}

namespace detail {

uring_hooks& io_uring_hooks() noexcept {
    static uring_hooks table{[](io_uring* ring) noexcept { return io_uring_submit(ring); }};
    return table;
}

} // namespace detail

} // namespace ringverbs
