#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/channel.hpp>

#include <ringverbs/rdma/detail/verbs_hooks.hpp>

#include <poll.h>

#include <algorithm>
#include <cstdio>

namespace ringverbs {

namespace detail {

channel_state::channel_state(io_context& c, const verbs::context& dev, const channel_options& o)
    : ctx(&c), channel(dev), device(dev.handle()), options(o), spin_window(o.hybrid_spin) {
    if (options.poll_batch == 0) options.poll_batch = 1;
    service.owner = this;
    service.priority = options.priority;
    service.run = [](poller* p) noexcept { static_cast<service_poller*>(p)->owner->run_service(); };
    if (options.mode == polling_mode::busy) {
        spinning = true; // never armed: no fd to watch
        detail::loop(*ctx).queue_poller(&service);
        return;
    }
    watch = fd_watch::start(
        *ctx, channel.fd(), channel.handle(), this,
        [](void* self, unsigned) noexcept {
            auto* ch = static_cast<channel_state*>(self);
            if (ch->error != 0) return;
            ++ch->counters.wakeups;
            ch->fd_ready = true;
            detail::loop(*ch->ctx).queue_poller(&ch->service);
        },
        [](void* self, int err) noexcept { static_cast<channel_state*>(self)->fail(err); });
}

channel_state::~channel_state() {
    detail::loop(*ctx).dequeue_poller(&service);
    if (watch) watch->release();
}

void channel_state::fail(int err) noexcept {
    error = err;
    diagnose("completion channel fd %d: poll failed: %s", channel.fd(),
             std::system_category().message(err).c_str());
    for (cq_state* c : cqs)
        c->fail_waiters(err);
}

// The most completions drain_cq takes per ibv_poll_cq, whatever poll_batch asks (its stack array).
constexpr std::size_t max_poll_batch = 64;

// Polls `c` until it is empty, dispatching every completion. Returns how many.
std::size_t channel_state::drain_cq(cq_state& c) noexcept {
    ibv_wc wcs[max_poll_batch];
    const std::size_t batch = std::min<std::size_t>(options.poll_batch, max_poll_batch);
    std::size_t total = 0;
    for (;;) {
        const int got = hooks().poll_cq(c.cq.native(), static_cast<int>(batch), wcs);
        if (got < 0) [[unlikely]] {
            diagnose("ibv_poll_cq failed (the provider returned %d)", got);
            c.fail_waiters(EIO);
            break;
        }
        const auto n = static_cast<std::size_t>(got);
        ++counters.polls;
        ++c.counters.polls;
        if (n == 0) {
            ++counters.empty_polls;
            ++c.counters.empty_polls;
            break;
        }
        counters.completions += n;
        c.counters.completions += n;
        total += n;
        for (std::size_t i = 0; i < n; ++i)
            c.dispatch(wcs[i]);
        if (n < batch) break; // the CQ was empty when polled: nothing is stranded (armed first)
    }
    c.filling = nullptr;
    return total;
}

// One service pass, in the io_context's poller phase (after the CQEs of this turn, before
// coroutines resume). The order per CQ is the one that strands nothing: take the event, count
// it for the batched ack, re-arm, then poll until empty: a completion that lands between the
// last poll and the arm raises a new event, one that lands before is found by the poll.
void channel_state::run_service() noexcept {
    std::size_t found = 0;
    if (fd_ready) {
        const std::optional<std::size_t> got = handle_wakeup();
        if (!got) return; // the channel failed
        found = *got;
    }
    if (rearm_due && !spinning) found += rearm_unarmed();
    if (!spinning) {
        // events, or hybrid asleep: completions that woke a hybrid channel open its window.
        if (found > 0 && options.mode == polling_mode::hybrid) start_spin();
        return;
    }
    if (options.mode == polling_mode::busy)
        busy_pass();
    else
        spin_pass(found);
}

// The fd was reported readable: reads its events, then counts, arms and polls each CQ that
// fired. Returns the completions found, or nothing when the channel failed.
std::optional<std::size_t> channel_state::handle_wakeup() noexcept {
    fd_ready = false;
    const event_read read = read_events();
    if (read == event_read::failed) return std::nullopt;
    std::size_t found = 0;
    for (cq_state* c : fired)
        found += service_fired(*c);
    if (read == event_read::interrupted) {
        fd_ready = true;
        detail::loop(*ctx).queue_poller(&service);
    }
    return found;
}

// Collects the CQs with an event this turn in `fired`, each marked disarmed.
channel_state::event_read channel_state::read_events() noexcept {
    for (cq_state* c : fired)
        c->in_fired = false;
    fired.clear();
    // Read until EAGAIN, or until every armed CQ has had its one event: then nothing can
    // be pending, and the read that would say EAGAIN is saved. At least one read per
    // wakeup, whatever the count says: the fd is readable, and an event left unread
    // would make the level-triggered poll fire on every turn.
    for (bool first = true; first || armed_cqs > 0; first = false) {
        std::optional<verbs::cq_event> ev;
        try {
            ev = channel.get_event();
        } catch (const std::system_error& e) {
            if (e.code().value() != EINTR) {
                fail(e.code().value());
                return event_read::failed;
            }
            // Interrupted: the event is still there, and the multishot poll reports the
            // fd only on a new wakeup. Read again on the next turn.
            return event_read::interrupted;
        }
        if (!ev) break;
        ++counters.events;
        auto* c = static_cast<cq_state*>(ev->user_context);
        ++c->counters.events;
        c->set_armed(false);
        // A flag, not a search of `fired`: one wakeup may bring an event from each of
        // thousands of CQs.
        if (!c->in_fired) {
            c->in_fired = true;
            fired.push_back(c);
        }
    }
    return event_read::all_read;
}

// A CQ that had an event: acks its events once ack_batch are unacked, re-arms it (unless
// spinning), then polls it until empty. Returns the completions found.
std::size_t channel_state::service_fired(cq_state& c) noexcept {
    if (c.cq.unacked_events() >= options.ack_batch) {
        std::uint32_t n = c.cq.unacked_events();
        c.cq.ack_events(n);
        ++counters.acks;
        ++c.counters.acks;
        c.counters.acked_events += n;
    }
    if (!spinning) {
        c.arm();
        ++counters.arms;
    }
    return drain_cq(c);
}

// hybrid, woken from its sleep by completions: spin from now on.
void channel_state::start_spin() noexcept {
    spinning = true;
    auto now = std::chrono::steady_clock::now();
    adapt_spin(now - last_completion);
    last_completion = now;
    detail::loop(*ctx).queue_poller(&service);
}

// busy, or hybrid inside its spin window: poll everything, arm nothing.
std::size_t channel_state::poll_all() noexcept {
    std::size_t found = 0;
    for (cq_state* c : cqs)
        found += drain_cq(*c);
    return found;
}

// busy: poll every CQ on every turn, for ever.
void channel_state::busy_pass() noexcept {
    poll_all();
    detail::loop(*ctx).queue_poller(&service);
}

// hybrid inside its spin window (`found`: completions of this pass so far): poll every CQ,
// and once the window after the last completion is over, arm and sleep.
void channel_state::spin_pass(std::size_t found) noexcept {
    found += poll_all();
    // Reading the clock can be a system call (a VM whose clocksource is the HPET): read it
    // when completions arrive and on every 32nd empty turn only.
    if (found == 0 && (++spin_turns & 31u) != 0) {
        detail::loop(*ctx).queue_poller(&service);
        return;
    }
    auto now = std::chrono::steady_clock::now();
    if (found > 0) last_completion = now;
    if (now - last_completion < spin_window) {
        detail::loop(*ctx).queue_poller(&service);
        return;
    }
    end_spin(now);
}

// The spin window is over: arm every CQ, then poll once more so that a completion that
// arrived before its arm is not left waiting for an event that will never come.
void channel_state::end_spin(std::chrono::steady_clock::time_point now) noexcept {
    spinning = false;
    std::size_t late = 0;
    for (cq_state* c : cqs) {
        if (!c->armed) {
            c->arm();
            ++counters.arms;
        }
        late += drain_cq(*c);
    }
    if (late > 0) {
        spinning = true;
        last_completion = now;
        detail::loop(*ctx).queue_poller(&service);
    }
}

// A CQ whose arming failed for a while (cq_state::arm) is armed again here, on a later turn,
// and polled after, as any arm must be. Returns the completions found.
std::size_t channel_state::rearm_unarmed() noexcept {
    rearm_due = false;
    std::size_t found = 0;
    for (cq_state* c : cqs) {
        if (c->armed || c->error != 0) continue;
        c->arm();
        ++counters.arms;
        found += drain_cq(*c);
    }
    return found;
}

// hybrid, woken by completions after a sleep: `gap` is the time since the completion before.
// A gap within hybrid_spin_max means the window closed just before the answer came: widen it
// to cover twice that gap. A longer gap is idleness: back to the configured window.
void channel_state::adapt_spin(std::chrono::nanoseconds gap) noexcept {
    if (options.hybrid_spin_max <= options.hybrid_spin) return;
    spin_window = gap <= options.hybrid_spin_max
                      ? std::clamp(2 * gap, options.hybrid_spin, options.hybrid_spin_max)
                      : options.hybrid_spin;
}

} // namespace detail

channel::channel(io_context& ctx, const verbs::context& device, channel_options o)
    : state_(std::make_shared<detail::channel_state>(ctx, device, o)) {}

channel::~channel() = default;

} // namespace ringverbs
