// wait_core: the state machine every wait of a coroutine on a source shares (a waiter queued on
// a CQ, a poll stream, an rdma_cm id; a posted work request): an outcome, an optional deadline
// (an IORING_OP_TIMEOUT) and an optional std::stop_token.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/detail/stop_gate.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <cerrno>
#include <coroutine>
#include <cstdint>

namespace ringverbs::detail {

// Invariants:
// - The coroutine is resumed exactly once, when the wait is decided AND its timer request
//   (whose user_data is this object) has delivered its CQE AND a stop request that won the
//   gate has run on the loop thread: nothing the kernel or another thread holds names a
//   dead wait.
// - The source decides it with decide(error) (0: its outcome is ready). The deadline and the
//   stop come to the owner's interrupt function with ETIMEDOUT / ECANCELED while the wait is
//   undecided. The owner either decides at once (a queued waiter unlinks itself and ends with
//   that error: returns true) or starts something that decides it later (a work request
//   cannot be recalled: the QP is moved to the error state and the flush decides: returns
//   false). interrupted() tells which came first.
// - Everything that can throw happens in reserve_timer(), before the owner links or posts.
class wait_core : operation {
  public:
    using interrupt_fn = bool (*)(wait_core* self, int reason) noexcept;

    enum class phase : std::uint8_t {
        idle,    // not waiting (not started, or resumed)
        waiting, // started, undecided
        decided, // outcome known; resumes once the timer's CQE and a won stop request came
    };

    // Only what is read before a wait begins is set here (the outcome, the phase): a request
    // that never waits (an unsignaled send, done at its post) pays for nothing else.
    wait_core() noexcept = default;
    wait_core(const wait_core&) = delete;
    wait_core& operator=(const wait_core&) = delete;

    // Holds back the SQE slot of the deadline's timer (true), or nothing without a timeout
    // (false). Throws std::system_error naming io_uring_submit (a full submission ring that
    // cannot be submitted): call it before the wait is linked anywhere or anything is posted.
    // The slot is taken only in begin_wait(), when the timer is prepared: whatever submits the
    // ring in between (the owner's post arming a flush bound, a reset cancelling timers) never
    // sends the kernel a slot not prepared yet.
    static bool reserve_timer(io_context& ctx, const wait_options& options) {
        if (options.timeout == wait_options::no_timeout) return false;
        detail::loop(ctx).reserve_sqe();
        return true;
    }
    // Gives back what reserve_timer() held when the wait is not started after all.
    static void unreserve(io_context& ctx, bool reserved) noexcept {
        if (reserved) detail::loop(ctx).release_reserved_sqe();
    }

    // Starts waiting, with the timer reserve_timer() made room for. Never throws. The stop
    // callback may run at once (stop already requested): the owner must be ready for
    // interrupt by then.
    void begin_wait(io_context& ctx, const wait_options& options, bool timer_reserved,
                    std::coroutine_handle<> h, interrupt_fn interrupt) noexcept {
        ctx_ = &ctx;
        handle_ = h;
        interrupt_ = interrupt;
        phase_ = phase::waiting;
        detail::loop(ctx).add_waiter();
        if (timer_reserved) {
            io_uring_sqe* timer_sqe = detail::loop(ctx).take_reserved_sqe();
            on_cqe = &wait_core::timer_fired;
            ts_ = to_kernel_timespec(options.timeout);
            io_uring_prep_timeout(timer_sqe, &ts_, 0, 0);
            io_uring_sqe_set_data(timer_sqe, static_cast<operation*>(this));
            timer_pending_ = true;
            detail::loop(ctx).start_operation();
        }
        gate_.arm(ctx, options.stop, this, &wait_core::on_stop, &wait_core::on_resume);
    }

    // The source's outcome: 0, or a positive errno. Only while waiting.
    void decide(int error) noexcept {
        phase_ = phase::decided;
        error_ = error;
        if (timer_pending_)
            cancel_timer(); // resumed on the timer's CQE
        else
            finish();
    }

    phase wait_phase() const noexcept { return phase_; }
    bool waiting() const noexcept { return phase_ == phase::waiting; }
    // ETIMEDOUT or ECANCELED when the deadline or the stop came first (even if the owner let
    // the source decide after), else 0.
    int interrupted() const noexcept { return interrupted_; }
    bool stop_won() const noexcept { return gate_.stop_won(); }

    // After resuming: the outcome (0, ETIMEDOUT, ECANCELED, or the source's errno). Destroys
    // the stop callback.
    int finish_wait() noexcept {
        gate_.disarm();
        phase_ = phase::idle;
        return error_;
    }

  private:
    void finish() noexcept {
        if (gate_.finish()) resume();
    }
    void resume() noexcept {
        detail::loop(*ctx_).remove_waiter();
        detail::loop(*ctx_).ready(handle_);
    }
    void cancel_timer() noexcept {
        try {
            detail::loop(*ctx_).cancel(this);
        } catch (...) {
            // The ring is unusable: the timer still fires on its own.
        }
    }
    // The deadline or the stop, while undecided: the owner decides now or later.
    void interrupt(int reason) noexcept {
        if (phase_ != phase::waiting) return;
        if (interrupted_ == 0) interrupted_ = reason;
        if (interrupt_(this, reason)) {
            phase_ = phase::decided;
            error_ = reason;
        }
    }
    static void timer_fired(operation* op, int, unsigned) noexcept {
        auto* self = static_cast<wait_core*>(op);
        self->timer_pending_ = false;
        detail::loop(*self->ctx_).finish_operation();
        self->interrupt(self->ctx_->shutting_down() ? ECANCELED : ETIMEDOUT);
        if (self->phase_ == phase::decided) self->finish();
    }
    // Returns true when the wait may resume now (stop_gate's contract).
    static bool on_stop(void* owner) noexcept {
        auto* self = static_cast<wait_core*>(owner);
        self->interrupt(ECANCELED);
        if (self->phase_ != phase::decided) return false; // the source decides later
        if (self->timer_pending_) {
            self->cancel_timer();
            return false;
        }
        return true;
    }
    static void on_resume(void* owner) noexcept { static_cast<wait_core*>(owner)->resume(); }

    io_context* ctx_; // set by begin_wait, read only after it
    std::coroutine_handle<> handle_;
    interrupt_fn interrupt_;
    int error_ = 0;
    int interrupted_ = 0;
    phase phase_ = phase::idle;
    bool timer_pending_ = false;
    __kernel_timespec ts_; // written before its timer SQE is prepared
    stop_gate gate_;
};

} // namespace ringverbs::detail
