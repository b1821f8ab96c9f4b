// stop_gate: connects a std::stop_token, which may fire on any thread, to an operation that
// lives on one io_context's thread.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <atomic>
#include <cstdint>
#include <new>
#include <stop_token>

namespace ringverbs::detail {

// Invariants:
// - Exactly one of "the operation finished" and "a stop request was queued" wins the
//   compare-exchange on state_. If finishing wins, the stop callback does nothing; if the
//   stop wins, its node is pushed to the context and the awaiter is resumed only after the
//   node ran on the context's thread, so the node never outlives the awaiter.
// - on_stop runs on the context's thread. It returns true when the operation is finished by
//   it (a waiter removed from a queue), false when the operation still owes a CQE (a cancel
//   request was sent; the CQE's arrival calls finish() again).
// - The std::stop_callback is destroyed before the awaiter: its destructor waits for a
//   callback running on another thread, which then cannot touch a dead gate.
class stop_gate : remote_node {
  public:
    using on_stop_fn = bool (*)(void* owner) noexcept;
    using on_resume_fn = void (*)(void* owner) noexcept;

    // The rest is set by arm(): a wait without a stop_token stores nothing more here.
    stop_gate() noexcept = default;
    ~stop_gate() { disarm(); }
    stop_gate(const stop_gate&) = delete;
    stop_gate& operator=(const stop_gate&) = delete;

    // Registers the stop callback. Call after the operation was started: the callback may run
    // at once, in this call, if stop was already requested.
    void arm(io_context& ctx, const std::stop_token& token, void* owner, on_stop_fn on_stop,
             on_resume_fn on_resume) {
        // No wait arms twice today; one that did would start clean (start_again).
        if (armed_ || state_.load(std::memory_order_relaxed) != armed) [[unlikely]]
            start_again();
        if (!token.stop_possible()) return;
        run = &stop_gate::run_on_context;
        ctx_ = &ctx;
        owner_ = owner;
        on_stop_ = on_stop;
        on_resume_ = on_resume;
        ::new (static_cast<void*>(callback_)) callback(token, trigger{this});
        armed_ = true;
    }

    // The operation is complete (context thread). Returns true when the owner may resume
    // now; false when a queued stop request must run first (it resumes the owner then).
    bool finish() noexcept {
        if (!armed_) return true;
        std::uint8_t expected = armed;
        if (state_.compare_exchange_strong(expected, finished, std::memory_order_acq_rel))
            return true;
        if (stop_handled_) return true;
        finished_early_ = true;
        return false;
    }

    // True when a stop request won: the operation ends as cancelled (unless its real result
    // arrived first, which the owner decides).
    bool stop_won() const noexcept { return state_.load(std::memory_order_acquire) == stop_queued; }

    // Destroys the stop callback (waiting for it if it runs on another thread right now).
    // The deregistration out of line: most waits have no stop_token, and its inlined code (a
    // lock and a wait) would weigh on every caller's registers.
    void disarm() noexcept {
        if (armed_) [[unlikely]]
            disarm_armed();
    }

  private:
    enum : std::uint8_t { armed, stop_queued, finished };

    struct trigger {
        stop_gate* gate;
        void operator()() const noexcept {
            std::uint8_t expected = armed;
            if (gate->state_.compare_exchange_strong(expected, stop_queued,
                                                     std::memory_order_acq_rel))
                detail::loop(*gate->ctx_).push_remote(gate);
        }
    };

    // Armed again (after a wait that ended, or that is still armed): the last wait's outcome
    // must not decide this one (its stop_won(), a stop request's compare-exchange). Unless its
    // stop's node is still queued (the owner is resumed only after it ran, so this is a misuse):
    // set back then, a second request would push the node twice, so it stays as it was.
    [[gnu::noinline]] void start_again() noexcept {
        if (armed_) disarm_armed();
        if (state_.load(std::memory_order_acquire) == stop_queued && !stop_handled_) return;
        state_.store(armed, std::memory_order_relaxed);
        stop_handled_ = false;
        finished_early_ = false;
    }
    [[gnu::noinline]] void disarm_armed() noexcept {
        armed_ = false;
        std::launder(reinterpret_cast<callback*>(callback_))->~callback();
    }

    static void run_on_context(remote_node* n) noexcept {
        auto* g = static_cast<stop_gate*>(n);
        g->stop_handled_ = true;
        if (g->finished_early_ || g->on_stop_(g->owner_)) g->on_resume_(g->owner_);
    }

    // Set by arm(), read only while armed_.
    io_context* ctx_;
    void* owner_;
    on_stop_fn on_stop_;
    on_resume_fn on_resume_;
    std::atomic<std::uint8_t> state_{armed};
    bool stop_handled_ = false;   // context thread only
    bool finished_early_ = false; // context thread only
    bool armed_ = false;          // callback_ holds a registered stop_callback
    // Not a std::optional: its destructor, inlined into every awaiter's, carried the
    // deregistration's code (a lock and a wait) and its registers into the common path.
    using callback = std::stop_callback<trigger>;
    alignas(callback) unsigned char callback_[sizeof(callback)];
};

} // namespace ringverbs::detail
