// io_context: one io_uring ring, driven by one thread, that resumes coroutines when their
// operations complete.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/task.hpp>

#include <liburing.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <stop_token>
#include <vector>

namespace ringverbs {

class io_context;

// How long an awaitable may wait, and who may cancel it. Every awaitable that can wait takes
// one: `co_await recv(ctx, fd, buf, 5ms)`, `..., stop_token)` or `..., {5ms, stop_token}`.
// A wait that times out throws std::system_error with std::errc::timed_out; one whose
// stop_token fires throws std::errc::operation_canceled. An operation that completed before
// the cancellation took effect returns its real result.
//
// Deliberately not an aggregate: GCC 12 destroys an aggregate temporary that appears in a
// co_await expression twice (a use-after-free of the stop_token's state), while a class
// with constructors is handled correctly.
class wait_options {
  public:
    static constexpr std::chrono::nanoseconds no_timeout = std::chrono::nanoseconds::max();

    wait_options() noexcept {}
    template <typename Rep, typename Period>
    wait_options(std::chrono::duration<Rep, Period> t, std::stop_token s = {}) noexcept
        : timeout(std::chrono::duration_cast<std::chrono::nanoseconds>(t)), stop(std::move(s)) {}
    wait_options(std::stop_token s) noexcept : stop(std::move(s)) {}

    std::chrono::nanoseconds timeout = no_timeout; // no_timeout: wait as long as it takes
    std::stop_token stop;                          // default: cannot be stopped
};

// What the loop met under pressure (diagnostics; tests/rdma/soak_test.cpp counts them).
struct io_context_counters {
    // get_sqe() found the submission ring too full and submitted first.
    std::uint64_t sq_full = 0;
    // Turns that found CQEs in the kernel's overflow list (the completion ring was full) and
    // entered the kernel to collect them.
    std::uint64_t cq_overflows = 0;
};

struct io_context_options {
    // Submission ring size (at least 4); a full ring is submitted, never an error.
    unsigned sq_entries = 256;
    unsigned cq_entries = 4096; // completion ring size; the kernel queues overflow (NODROP)
    // Ask for IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN (fewer interrupts and context
    // switches). The context falls back to COOP_TASKRUN and then to no flags when the kernel
    // refuses; setup_flags() says what was granted.
    bool single_issuer = true;
};

namespace detail {
struct spawned_promise;
class io_context_access;

// What io_uring_get_sqe does to the slot it hands out, for io_context::get_sqe's own fast path:
// from liburing 2.6 it clears the fields its prep helpers no longer write (flags, ioprio,
// rw_flags...), or a reused slot would keep, say, a timed request's IOSQE_IO_LINK; before 2.6
// the prep helpers write every field and there is nothing to do.
inline void initialize_sqe([[maybe_unused]] io_uring_sqe* sqe) noexcept {
#if defined(IO_URING_VERSION_MAJOR) &&                                                             \
    (IO_URING_VERSION_MAJOR > 2 || (IO_URING_VERSION_MAJOR == 2 && IO_URING_VERSION_MINOR >= 6))
    io_uring_initialize_sqe(sqe);
#endif
}

template <typename T>
struct root_promise;
} // namespace detail

// Threads: an io_context belongs to the first thread that runs it (or submits through it:
// a constructor that fills the submission ring does). Everything but stop(), post(),
// schedule() and work_guard is called on that thread, the destructor included.
class io_context {
  public:
    // Creates the ring and its cross-thread wakeup eventfd.
    // Throws std::system_error naming io_uring_queue_init_params. When io_uring is unavailable
    // (ENOSYS: kernel without io_uring; EPERM: kernel.io_uring_disabled or a seccomp filter)
    // the message says exactly that.
    explicit io_context(io_context_options options = {});

    // Cancels every operation still in flight, resumes their awaiters with
    // operation_canceled, reaps every CQE the kernel owes (so no buffer of a live operation
    // is freed while the kernel may write it), then destroys spawned tasks still suspended.
    // Must be called on the thread that ran the context.
    ~io_context();

    io_context(const io_context&) = delete;
    io_context& operator=(const io_context&) = delete;

    // Runs until stop() is called or there is no work left: no operation in flight, no
    // coroutine ready or waiting (on a poll_stream, a CQ, a work request), no work_guard held.
    // An idle poll_stream or completion channel is not work. Rethrows an exception that escaped a
    // spawned task (unless an exception handler is set); run() may then be called again.
    void run();

    // One turn of the loop: submits pending requests, reaps every available CQE, then
    // resumes the coroutines that became ready. With `block`, waits for at least one CQE
    // when no coroutine is ready. Returns the number of coroutines resumed.
    std::size_t run_once(bool block = true);

    // Runs `t` to completion on this thread and returns its value or rethrows its exception.
    // Blocks for as long as the task waits (a task that waits for nothing that can ever come
    // blocks forever, like any wait). Ignores stop().
    template <typename T>
    T run(task<T> t);

    // Starts `t` as detached work owned by the context. An exception escaping it is passed to
    // the exception handler, by default rethrown from run() / run_once(): never swallowed.
    void spawn(task<void> t);

    // Replaces the default handling of exceptions escaping spawned tasks.
    void set_exception_handler(std::function<void(std::exception_ptr)> handler);

    // Makes run() return at the end of its current turn. Thread-safe.
    void stop() noexcept;
    bool stopped() const noexcept { return stop_requested_.load(std::memory_order_relaxed); }
    // Clears a previous stop().
    void restart() noexcept { stop_requested_.store(false, std::memory_order_relaxed); }

    // co_await ctx.schedule(): continue on this context's thread. Callable from any thread;
    // no allocation (the awaiter is the queue node).
    class schedule_awaitable;
    schedule_awaitable schedule() noexcept;

    // co_await ctx.yield(): on this context's thread, lets the rest of the turn and the next
    // turn's start (the ring, the pollers: a busy channel's polls) run, then continues. For a
    // coroutine that polls on its own (cq::try_next). Allocates nothing once the context's
    // ready list has grown (std::bad_alloc from the co_await if it cannot). While the context
    // is being destroyed it throws operation_canceled instead of suspending.
    class yield_awaitable;
    yield_awaitable yield() noexcept;

    // Runs `fn` on this context's thread. Thread-safe. Allocates one node per call.
    void post(std::function<void()> fn);

    // Keeps run() from returning for lack of work while held (for example while another
    // thread will post()). Thread-safe.
    class work_guard {
      public:
        explicit work_guard(io_context& ctx) noexcept : ctx_(&ctx) {
            ctx_->external_work_.fetch_add(1, std::memory_order_relaxed);
        }
        work_guard(work_guard&& o) noexcept : ctx_(std::exchange(o.ctx_, nullptr)) {}
        work_guard& operator=(work_guard&&) = delete;
        ~work_guard() { reset(); }
        void reset() noexcept;

      private:
        io_context* ctx_;
    };

    // The IORING_SETUP_* flags the kernel granted.
    unsigned setup_flags() const noexcept { return setup_flags_; }
    const io_context_counters& counters() const noexcept { return counters_; }

    // Operations in flight in the kernel, background ones (poll streams, channels) included;
    // and coroutines waiting on a background source (for tests and diagnostics).
    std::size_t operations_in_flight() const noexcept { return in_flight_ + background_; }
    std::size_t waiters() const noexcept { return waiting_; }

    // Work the runtime finishes on its own after the objects that started it are gone: a
    // destroyed qp (a connection, a recv_ring's qp) whose owed requests the device has yet to
    // flush, each bounded by its qp_options::flush_timeout (5 s). run() does not wait for it
    // (nothing awaits it); operations_in_flight() counts it until it ends.
    std::size_t teardown_in_flight() const noexcept { return teardown_; }
    // Runs the loop until teardown_in_flight() is 0 (or stop() is called): after destroying
    // the connections and qps, before a leak check or a look at operations_in_flight(), or
    // to let the device see every QP's end. Bounded by the longest flush_timeout among them;
    // returns at once when there is nothing to finish. Rethrows as run_once() does.
    void finish_teardown();

    // True while the destructor drains: new operations must complete at once as cancelled.
    bool shutting_down() const noexcept { return shutting_down_; }

  private:
    // For awaitable implementers (ringverbs' own layers), through detail::loop(ctx): called on
    // the context's thread only (push_remote excepted).
    friend class detail::io_context_access;

    // Returns a free SQE and guarantees `reserve - 1` more after it (for linked requests:
    // take those with io_uring_get_sqe(native_ring()), which cannot fail then), submitting
    // queued requests first when the ring is too full. Runs no CQE's handler: when submitting
    // is refused for want of room in the completion ring, its CQEs are set aside for the next
    // reap. Throws std::system_error naming io_uring_submit (ENOMEM when even that fails;
    // EBUSY after 1,000 refusals). Slots held back by reserve_sqe() are never handed out here
    // (ENOBUFS naming io_uring_get_sqe when the ring could never hold them and `reserve`).
    io_uring_sqe* get_sqe(unsigned reserve = 1) {
        // Inline where the ring has room (every call but rare ones): room_for() otherwise.
        // io_uring_sq_space_left and io_uring_get_sqe for this ring: no SQPOLL (the kernel
        // moves the head only inside our io_uring_enter), no SQE128 (64-byte slots).
        io_uring_sq& sq = ring_.sq;
        const unsigned tail = sq.sqe_tail;
        if (sq.ring_entries - (tail - *sq.khead) >= reserve + reserved_) [[likely]] {
            sq.sqe_tail = tail + 1;
            io_uring_sqe* sqe = &sq.sqes[tail & sq.ring_mask];
            detail::initialize_sqe(sqe);
            return sqe;
        }
        return get_sqe_after_room(reserve);
    }
    io_uring_sqe* get_sqe_after_room(unsigned reserve);
    // Holds back one SQE slot, to be taken later with take_reserved_sqe() (which cannot fail)
    // or given back with release_reserved_sqe(), submitting first when the ring is too full;
    // throws as get_sqe() does. Between the two, get_sqe() may submit what is queued: a slot
    // taken early (io_uring_get_sqe) and prepared late could go to the kernel unprepared,
    // stale; a held-back slot is taken only when it is prepared.
    void reserve_sqe() {
        room_for(1);
        ++reserved_;
    }
    io_uring_sqe* take_reserved_sqe() noexcept {
        --reserved_;
        return io_uring_get_sqe(&ring_);
    }
    void release_reserved_sqe() noexcept { --reserved_; }
    // Counts one more operation that owes a final CQE; finish_operation() when it arrives.
    // Operations are work: run() does not return while one is in flight.
    void start_operation() noexcept { ++in_flight_; }
    void finish_operation() noexcept { --in_flight_; }
    // A long-lived request that is not work by itself (the multishot poll of a poll_stream or
    // a completion channel): run() may return while it is armed, but the destructor still
    // reaps its last CQE. The coroutines waiting on it are work: add_waiter() / remove_waiter().
    void start_background() noexcept { ++background_; }
    void finish_background() noexcept { --background_; }
    void add_waiter() noexcept { ++waiting_; }
    void remove_waiter() noexcept { --waiting_; }
    // Teardown work (teardown_in_flight()) begins / ends: counted apart, not work for run().
    void start_teardown() noexcept { ++teardown_; }
    void end_teardown() noexcept { --teardown_; }
    // Queues a coroutine to be resumed after the current CQE batch. Never resumes inline.
    void ready(std::coroutine_handle<> h) { ready_.push_back(h); }
    // Asks the kernel to cancel the request whose user_data is `op` (its CQE still arrives).
    void cancel(detail::operation* op);
    // Hands `node` to the context's thread; thread-safe and allocation-free.
    void push_remote(detail::remote_node* node) noexcept;
    // Runs `p` in this turn (or the next, if this turn's pollers already ran), in priority
    // order. Queuing a queued poller does nothing. While a poller is queued the loop does not
    // sleep: a poller that spins (busy polling) re-queues itself every turn.
    void queue_poller(detail::poller* p) noexcept {
        // Inline when the list is empty (run_pollers took it): a spinning poller queuing
        // itself again every turn.
        if (pollers_ == nullptr && !p->queued) {
            p->queued = true;
            p->next = nullptr;
            pollers_ = p;
            return;
        }
        queue_poller_in_order(p);
    }
    void queue_poller_in_order(detail::poller* p) noexcept;
    void dequeue_poller(detail::poller* p) noexcept;
    // Sources whose pollers have a priority other than 0 (a channel with
    // channel_options::priority): while any exists, an event source does its work in the poller
    // phase, in priority order, never earlier in the CQE loop (channel_state's fast path).
    void add_prioritized_source() noexcept { ++prioritized_sources_; }
    void remove_prioritized_source() noexcept { --prioritized_sources_; }
    bool has_prioritized_sources() const noexcept { return prioritized_sources_ != 0; }
    io_uring* native_ring() noexcept { return &ring_; }

    friend struct detail::spawned_promise;
    template <typename T>
    friend struct detail::root_promise;

    void submit_and_reap(bool wait, bool spinning);
    void room_for(unsigned count);
    void enable_ring();
    void reap();
    void reap_from(std::size_t due);
    void set_cqes_aside();
    std::size_t resume_ready();
    void run_pollers();
    // The checks of the common turn inline, the work out of line.
    void drain_remote() {
        if (remote_head_.load(std::memory_order_relaxed) != nullptr) [[unlikely]]
            run_remote();
    }
    void run_remote();
    void arm_wakeup();
    void arm_wakeup_retry();
    void wake() noexcept;
    void report(std::exception_ptr e);
    void rethrow_reported();
    bool out_of_work() const noexcept;
    std::size_t turn(bool block);
    // run(task)'s loop: turns until `done` (set by the task's end).
    void run_until(const bool& done);
    int submit_and_wait_one() noexcept;

    io_uring ring_{};
    unsigned setup_flags_ = 0;
    unsigned reserved_ = 0; // SQE slots held back by reserve_sqe()
    io_context_counters counters_;
    int wake_fd_ = -1;
    bool shutting_down_ = false;
    bool ring_disabled_ = false;
    bool wakeup_rearm_due_ = false;   // the wakeup read could not be re-armed in the CQE loop
    bool ring_fd_registered_ = false; // io_uring_register_ring_fd: enter by the fd's index
    unsigned spin_turns_ = 0;         // created disabled; enabled by the first thread that submits
    std::size_t in_flight_ = 0;
    std::size_t background_ = 0;
    std::size_t waiting_ = 0;
    std::size_t teardown_ = 0;
    std::vector<std::coroutine_handle<>> ready_;
    std::vector<std::coroutine_handle<>> resuming_;
    // CQEs get_sqe() took out of a full completion ring, for reap() to handle.
    std::vector<detail::set_aside_cqe> set_aside_;
    // Times set_cqes_aside() emptied the completion ring (it may set nothing aside: ignored
    // CQEs are dropped): reap()'s common pass hands over to reap_from() when this changes.
    std::uint64_t ring_emptied_ = 0;
    detail::poller* pollers_ = nullptr; // queued pollers, sorted by priority (highest first)
    std::size_t prioritized_sources_ = 0;
    std::atomic<detail::remote_node*> remote_head_{nullptr};
    std::atomic<bool> stop_requested_{false};
    std::atomic<std::size_t> external_work_{0};
    std::atomic<int> posters_{0}; // threads inside push_remote/stop/work_guard::reset

    struct wakeup_op : detail::operation {
        io_context* ctx = nullptr;
        std::uint64_t value = 0; // the eventfd counter the kernel reads into
        bool armed = false;
    } wakeup_;

    detail::spawned_promise* spawned_ = nullptr; // intrusive list of live spawned tasks
    std::vector<std::exception_ptr> reported_;
    std::function<void(std::exception_ptr)> exception_handler_;
};

// ---------------------------------------------------------------------------------------
namespace detail {

// What ringverbs' own awaitables and event sources use of an io_context (not for users):
// detail::loop(ctx).get_sqe(), .ready(h), .queue_poller(p)... Each call is the io_context's own
// member of that name, documented there.
class io_context_access {
  public:
    explicit io_context_access(io_context& ctx) noexcept : ctx_(&ctx) {}
    io_uring_sqe* get_sqe(unsigned reserve = 1) { return ctx_->get_sqe(reserve); }
    void reserve_sqe() { ctx_->reserve_sqe(); }
    io_uring_sqe* take_reserved_sqe() noexcept { return ctx_->take_reserved_sqe(); }
    void release_reserved_sqe() noexcept { ctx_->release_reserved_sqe(); }
    void start_operation() noexcept { ctx_->start_operation(); }
    void finish_operation() noexcept { ctx_->finish_operation(); }
    void start_background() noexcept { ctx_->start_background(); }
    void finish_background() noexcept { ctx_->finish_background(); }
    void add_waiter() noexcept { ctx_->add_waiter(); }
    void remove_waiter() noexcept { ctx_->remove_waiter(); }
    void start_teardown() noexcept { ctx_->start_teardown(); }
    void end_teardown() noexcept { ctx_->end_teardown(); }
    void ready(std::coroutine_handle<> h) { ctx_->ready(h); }
    void cancel(operation* op) { ctx_->cancel(op); }
    void push_remote(remote_node* node) noexcept { ctx_->push_remote(node); }
    void queue_poller(poller* p) noexcept { ctx_->queue_poller(p); }
    void dequeue_poller(poller* p) noexcept { ctx_->dequeue_poller(p); }
    void add_prioritized_source() noexcept { ctx_->add_prioritized_source(); }
    void remove_prioritized_source() noexcept { ctx_->remove_prioritized_source(); }
    bool has_prioritized_sources() const noexcept { return ctx_->has_prioritized_sources(); }
    io_uring* native_ring() noexcept { return ctx_->native_ring(); }

  private:
    io_context* ctx_;
};

inline io_context_access loop(io_context& ctx) noexcept {
    return io_context_access(ctx);
}

// The coroutine that owns a spawned task. Its frame destroys itself at the end; while it is
// suspended it sits in the context's list so that ~io_context can destroy it.
struct spawned_promise {
    io_context* ctx;
    spawned_promise* prev = nullptr;
    spawned_promise* next = nullptr;

    spawned_promise(io_context& c, task<void>&) noexcept : ctx(&c) {
        next = c.spawned_;
        if (next) next->prev = this;
        c.spawned_ = this;
    }
    ~spawned_promise() {
        if (prev)
            prev->next = next;
        else
            ctx->spawned_ = next;
        if (next) next->prev = prev;
    }
    struct handle_type {
        std::coroutine_handle<spawned_promise> h;
    };
    handle_type get_return_object() noexcept {
        return {std::coroutine_handle<spawned_promise>::from_promise(*this)};
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() { ctx->report(std::current_exception()); }
};

struct spawned_coroutine {
    using promise_type = spawned_promise;
    spawned_coroutine(spawned_promise::handle_type h) noexcept : handle(h.h) {}
    std::coroutine_handle<spawned_promise> handle;
};

template <typename T>
struct root_result {
    std::optional<T> value;
    void set(T&& v) { value.emplace(std::move(v)); }
    T take() { return std::move(*value); }
};
template <>
struct root_result<void> {
    void take() {}
};

// The coroutine io_context::run(task) drives: awaits the task, records its outcome.
template <typename T>
struct root_promise {
    root_result<T>* result;
    std::exception_ptr* error;
    bool* done;
    root_promise(io_context&, task<T>&, root_result<T>& r, std::exception_ptr& e, bool& d) noexcept
        : result(&r), error(&e), done(&d) {}
    std::coroutine_handle<root_promise> get_return_object() noexcept {
        return std::coroutine_handle<root_promise>::from_promise(*this);
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept {
        *done = true;
        return {};
    }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { *error = std::current_exception(); }
};

template <typename T>
struct root_coroutine {
    using promise_type = root_promise<T>;
    root_coroutine(std::coroutine_handle<root_promise<T>> h) noexcept : handle(h) {}
    root_coroutine(root_coroutine&& o) noexcept : handle(std::exchange(o.handle, {})) {}
    ~root_coroutine() {
        if (handle) handle.destroy();
    }
    std::coroutine_handle<root_promise<T>> handle;
};

template <typename T>
root_coroutine<T> run_root(io_context&, task<T> t, root_result<T>& r, std::exception_ptr&, bool&) {
    if constexpr (std::is_void_v<T>) {
        co_await std::move(t);
    } else {
        r.set(co_await std::move(t));
    }
}

inline spawned_coroutine run_spawned(io_context&, task<void> t) {
    co_await std::move(t);
}

} // namespace detail

template <typename T>
T io_context::run(task<T> t) {
    detail::root_result<T> result;
    std::exception_ptr error;
    bool done = false;
    auto root = detail::run_root<T>(*this, std::move(t), result, error, done);
    ready(root.handle);
    run_until(done);
    if (error) std::rethrow_exception(error);
    return result.take();
}

// The awaitable io_context::schedule() returns. `co_await` always suspends, queues the
// coroutine to the context's thread (thread-safe, no allocation: the awaitable is the queue
// node) and resumes it there; gives nothing and throws nothing. Await it once, in place:
// while suspended the context's cross-thread queue links to it, so it is neither copyable nor
// movable. The context must outlive the co_await.
class [[nodiscard]] io_context::schedule_awaitable : detail::remote_node {
  public:
    schedule_awaitable(const schedule_awaitable&) = delete;
    schedule_awaitable& operator=(const schedule_awaitable&) = delete;

    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> caller) noexcept {
        handle_ = caller;
        ctx_->push_remote(this);
    }
    void await_resume() const noexcept {}

  private:
    friend class io_context;

    explicit schedule_awaitable(io_context* c) noexcept : ctx_(c) {
        run = [](detail::remote_node* n) noexcept {
            auto* self = static_cast<schedule_awaitable*>(n);
            self->ctx_->ready(self->handle_);
        };
    }

    io_context* ctx_;
    std::coroutine_handle<> handle_;
};

inline io_context::schedule_awaitable io_context::schedule() noexcept {
    return schedule_awaitable{this};
}

// The awaitable io_context::yield() returns: suspends, queues the coroutine on the context's
// ready list (a later turn resumes it: resume_ready takes only what was ready when it began).
// Once the context is being destroyed it does not suspend and throws std::system_error
// "io_context::yield" (operation_canceled), as every other await does then: a coroutine that
// spins on yield() would otherwise keep the destructor's last turns going for ever.
class [[nodiscard]] io_context::yield_awaitable {
  public:
    bool await_ready() const noexcept { return ctx_->shutting_down(); }
    void await_suspend(std::coroutine_handle<> caller) const { ctx_->ready(caller); }
    void await_resume() const {
        if (ctx_->shutting_down()) [[unlikely]]
            throw_system_error(ECANCELED, "io_context::yield (the io_context is being destroyed)");
    }

  private:
    friend class io_context;
    explicit yield_awaitable(io_context* c) noexcept : ctx_(c) {}
    io_context* ctx_;
};

inline io_context::yield_awaitable io_context::yield() noexcept {
    return yield_awaitable{this};
}

} // namespace ringverbs
