#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/cq.hpp>

#include <ringverbs/rdma/detail/srq_state.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

namespace ringverbs {

namespace detail {

using verbs::detail::hooks;

// The most completions drain_cq takes per ibv_poll_cq (its stack array): a larger
// channel_options::poll_batch is taken as this.
constexpr unsigned max_poll_batch = 64;

event_reader::event_reader(channel_state& ch)
    : owner(&ch), ctx(ch.ctx), keep_open(ch.channel.handle()) {
    for (slot& s : slots) {
        s.reader = this;
        s.on_cqe = &event_reader::cqe;
        // One event per read: the kernel gives whole events only, and never more than one.
        auto* read = ::new (static_cast<void*>(s.read)) io_uring_sqe{};
        io_uring_prep_read(read, keep_open->fd, &s.event, sizeof s.event, 0);
        io_uring_sqe_set_data(read, static_cast<operation*>(&s));
    }
}

void event_reader::start() {
    if (const int rc = verbs::detail::start_event_read(keep_open.get()); rc < 0) {
        ended_without_event(rc);
        if (!stopped) detail::loop(*ctx).queue_poller(&owner->service); // refill tries again
        return;
    }
    queue(slots[0]);
}

// A read ended (or was refused before it started) without an event: `res` is a negative errno
// (or a part of an event, which no sane kernel returns).
void event_reader::ended_without_event(int res) noexcept {
    // Cancelled by us, or nothing read: read again (refill).
    if (res == -ECANCELED || res == -EAGAIN || res == -EINTR) return;
    // The kernel short of memory for the request (as fd_watch's poll): read again, a bounded
    // number of times in a row; then the other path (the channel's poll and ibv_get_cq_event
    // in the loop), which a shortage of io_uring requests does not stop, rather than a failed
    // channel.
    const bool transient = res == -ENOMEM || res == -ENOBUFS || res == -EBUSY;
    if (transient && ++transient_failures < fd_watch::max_retries) return;
    if (owner == nullptr || stopped || owner->error != 0) return;
    const int err = res < 0 ? -res : EIO;
    if (transient) {
        owner->fall_back(err, true);
        return;
    }
    // Refused before any read worked (the kernel cannot read this file through io_uring): the
    // other path. Once reads worked, a failure is the channel's (EIO: the device is gone).
    if (!read_once && (err == EINVAL || err == EOPNOTSUPP))
        owner->fall_back(err);
    else
        owner->fail(err);
}

// Throws std::system_error naming io_uring_submit (no SQE could be had).
void event_reader::queue(slot& s) {
    std::memcpy(detail::loop(*ctx).get_sqe(), s.read, sizeof s.read);
    s.in_flight = true;
    ++in_flight;
    detail::loop(*ctx).start_background();
}

void event_reader::refill(std::size_t armed) noexcept {
    if (turn_events > 0) {
        // Every read came back with an event and armed CQs may have more: read more at once.
        // A read still waiting means the fd was drained: one is enough.
        if (in_flight == 0 && armed > 0)
            wanted = std::min(wanted * 2, slot_count);
        else if (in_flight > 0)
            wanted = 1;
        turn_events = 0;
    }
    if (stopped || cancelling || owner == nullptr || ctx->shutting_down()) return;
    for (slot& s : slots) {
        // A failed start_event_read or queue() below may stop or fail the reader.
        if (stopped || cancelling || owner == nullptr) return;
        if (in_flight >= wanted) break;
        if (s.in_flight) continue;
        if (!read_again(s)) return;
    }
}

// Starts a read into `s`. Returns false when it could not: the read failed before it started
// (interrupted: the event waits in the kernel; tried again on the next turn, so that a run of
// interruptions cannot hold this one up), or no SQE could be had (again on the next turn; the
// channel fails after max_retries such turns in a row).
bool event_reader::read_again(slot& s) noexcept {
    if (const int rc = verbs::detail::start_event_read(keep_open.get()); rc < 0) [[unlikely]] {
        ended_without_event(rc);
        if (!stopped) detail::loop(*ctx).queue_poller(&owner->service);
        return false;
    }
    try {
        queue(s);
        failed_attempts = 0;
        return true;
    } catch (const std::system_error& e) {
        if (++failed_attempts >= fd_watch::max_retries)
            owner->fail(e.code().value());
        else
            detail::loop(*ctx).queue_poller(&owner->service);
        return false;
    }
}

void event_reader::retire(verbs::completion_queue cq) noexcept {
    try {
        retiring.push_back(std::move(cq));
    } catch (...) {
        // Out of memory: `cq` is destroyed here, and ibv_destroy_cq waits for ever if a read
        // in flight took its event. Nothing better can be done without memory.
        return;
    }
    cancelling = true;
    cancel_reads();
}

void event_reader::stop() noexcept {
    stopped = true;
    cancel_reads();
}

void event_reader::release() noexcept {
    owner = nullptr;
    if (in_flight == 0) {
        delete this;
        return;
    }
    cancel_reads();
}

void event_reader::cancel_reads() noexcept {
    if (ctx->shutting_down()) return; // ~io_context's cancel-all reaps the reads
    for (slot& s : slots) {
        if (!s.in_flight) continue;
        try {
            detail::loop(*ctx).cancel(&s);
        } catch (...) {
            // No SQE for the cancel: the read ends with the next event, or with ~io_context.
        }
    }
}

// No read is in flight any more: no read can hold an unhandled event.
void event_reader::settled() noexcept {
    retiring.clear(); // each acks what it has unacked, then ibv_destroy_cq
    cancelling = false;
    if (owner == nullptr) {
        delete this;
        return;
    }
    if (!stopped) detail::loop(*ctx).queue_poller(&owner->service); // read again
}

// Flattened: the common wakeup (serve_at_once: count, arm, poll, dispatch, the next read) runs
// without the calls between this file's functions (tools/bench-cost: about 40 instructions a
// message and side).
[[gnu::flatten]] void event_reader::cqe(operation* op, int res, unsigned) noexcept {
    auto& s = *static_cast<slot*>(op);
    event_reader* r = s.reader;
    s.in_flight = false;
    --r->in_flight;
    detail::loop(*r->ctx).finish_background();
    if (res == static_cast<int>(sizeof s.event)) {
        r->read_once = true;
        r->transient_failures = 0;
        ++r->turn_events;
        // Counted unacked first, whoever gets it: the CQ's destroy waits for its ack. A CQ
        // whose state is gone (retired here, or living on in a QP) has no user context any
        // more (~cq_state): ring_event counts the event in gone_cq_events.
        const verbs::cq_event ev = verbs::detail::take_cq_event(s.event.cq_handle);
        if (r->owner != nullptr) {
            // Its dispatch cannot end the channel or the reader: completion handlers unlink
            // requests, make waiters ready and queue SQEs, and free nothing (a qp_state goes
            // in its own flush timer's CQE, or from user code).
            if (r->serve_at_once(s, ev.user_context)) return;
            r->owner->ring_event(ev.user_context);
        }
    } else {
        r->ended_without_event(res);
    }
    if (r->in_flight == 0 && (r->owner == nullptr || r->cancelling)) {
        r->settled(); // may free r
        return;
    }
    if (r->owner != nullptr && !r->stopped) detail::loop(*r->ctx).queue_poller(&r->owner->service);
}

// The fast path of cqe() (see the invariants in rdma_state.hpp): the read of slot `s` brought
// the event of `cq_context` (counted unacked already). When it is the only read in flight, the
// channel in events mode has nothing else to do this turn (no other CQ armed, which could
// have an event still unread; no service pass queued, no CQ waiting to be armed again) and no
// channel of the io_context has a priority (whose order the poller phase keeps), services
// that CQ now and queues the next read: returns true. Otherwise false, touching nothing.
bool event_reader::serve_at_once(slot& s, void* cq_context) noexcept {
    channel_state& ch = *owner;
    // (A failed channel has stopped its reader, in fail(): `stopped` covers ch.error. In
    // events mode a CQ in `fired` or one to arm again (rearm_due) has the service queued:
    // ring_event and cq_state::arm_failed queue it, and the pass, which empties `fired` and
    // clears rearm_due, queues itself again when either is left; `service.queued` covers
    // both.)
    if (cq_context == nullptr || in_flight != 0 || wanted != 1 || stopped || cancelling ||
        ch.options.mode != polling_mode::events || ch.service.queued || ctx->shutting_down() ||
        detail::loop(*ctx).has_prioritized_sources()) [[unlikely]]
        return false;
    cq_state& c = *static_cast<cq_state*>(cq_context);
    if (ch.armed_cqs != (c.armed ? 1u : 0u)) return false; // another CQ may have an event
    turn_events = 0;
    ++ch.counters.wakeups;
    ++ch.counters.served_at_once;
    ch.count_event(c);
    ch.service_fired(c);
    // The next read, as refill() queues it (one that could not start is left to refill() on
    // this turn's service pass). Of what the checks above read, the service can only have
    // failed the channel (which stops the reader): the reader is released, and CQs retired,
    // by user code only, which does not run here (completions only make coroutines ready).
    if (stopped) [[unlikely]]
        return true;
    (void)read_again(s);
    return true;
}

channel_state::channel_state(io_context& c, const verbs::context& dev, const channel_options& o)
    : ctx(&c), channel(dev), device(dev.handle()), options(o), prioritized(c, o.priority),
      spin_window(o.hybrid_spin) {
    options.poll_batch = std::clamp(options.poll_batch, 1u, max_poll_batch);
    service.owner = this;
    service.priority = options.priority;
    if (options.mode == polling_mode::busy) {
        spinning = true; // never armed: no fd to watch, no event to read
        service.run = &channel_state::busy_service;
        detail::loop(*ctx).queue_poller(&service);
        return;
    }
    service.run = [](poller* p) noexcept { static_cast<service_poller*>(p)->owner->run_service(); };
    if (options.read == event_read::ring) {
        // A read queued on the ring must not block: without O_NONBLOCK the kernel hands it to
        // a worker thread, which would take events at any time, not in the waiting
        // io_uring_enter. completion_channel sets the flag; a fd it could not set it on
        // (another kernel) is read the other way.
        const int fl = fcntl(channel.fd(), F_GETFL);
        if (fl == -1 || (fl & O_NONBLOCK) == 0) {
            diagnose("completion channel fd %d is not O_NONBLOCK: reading its events with "
                     "ibv_get_cq_event, not through io_uring",
                     channel.fd());
            options.read = event_read::syscall;
        }
    }
    if (options.read == event_read::syscall) {
        start_watch();
        return;
    }
    reader = new event_reader(*this);
    try {
        reader->start();
    } catch (...) {
        delete reader;
        throw;
    }
}

void channel_state::start_watch() {
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
    if (reader) reader->release();
}

void channel_state::fail(int err) noexcept {
    error = err;
    diagnose("completion channel fd %d: %s failed: %s", channel.fd(),
             options.read == event_read::ring ? "reading its events through io_uring" : "poll",
             std::system_category().message(err).c_str());
    if (reader) reader->stop();
    for (cq_state* c : fired)
        c->in_fired = false;
    fired.clear();
    for (cq_state* c : cqs)
        c->fail_waiters(err);
    // Nothing of the QPs on these CQs can be read any more: what they owe ends now, and their
    // posts are refused; with an srq that one of these CQs serves, every QP on it and what it
    // owes (qp_state and srq_state's cut off). Every one is marked before any is reset, since
    // a reset polls CQs that others may share. Every one is of this loop: a QP's two CQs, and
    // its srq, belong to one io_context (the qp_state constructor).
    for (cq_state* c : cqs)
        for (qp_state* q : c->qps) {
            q->mark_cut_off(err);
            // Its receives complete on a CQ of this channel: the srq's qps, all of this loop,
            // whichever CQs they use.
            if (q->srq && q->recv_cq->channel.get() == this) q->srq->mark_cut_off(err);
        }
    for (cq_state* c : cqs)
        for (qp_state* q : c->qps) {
            if (q->srq) q->srq->finish_cut_off();
            q->finish_cut_off();
        }
}

void channel_state::fall_back(int err, bool transient) noexcept {
    const std::string why = std::system_category().message(err);
    if (transient)
        diagnose("completion channel fd %d: reads of its events through io_uring failed %u times "
                 "in a row (%s): reading them with ibv_get_cq_event",
                 channel.fd(), fd_watch::max_retries, why.c_str());
    else
        diagnose("completion channel fd %d: the kernel refused to read its events through "
                 "io_uring (%s): reading them with ibv_get_cq_event",
                 channel.fd(), why.c_str());
    options.read = event_read::syscall;
    reader->stop(); // reads still in flight deliver what they read
    try {
        start_watch();
    } catch (const std::system_error& e) {
        fail(e.code().value());
    } catch (const std::bad_alloc&) { // the watch's own allocation: noexcept here
        fail(ENOMEM);
    }
}

// A per-request await's completion (its wr_id tagged) to its op: true; else false.
[[gnu::always_inline]] inline bool cq_state::to_op(const ibv_wc& wc) noexcept {
    if (!(wc.wr_id & wr_tag_ours)) return false;
    auto* op = reinterpret_cast<wr_op*>(wc.wr_id & ~(wr_tag_ours | wr_tag_last));
    op->on_wc(op, wc, (wc.wr_id & wr_tag_last) != 0);
    return true;
}

// A completion drain_cq polled, to its owner: a per-request await's op (its wr_id names it),
// else cq::next()'s waiters or buffer. Here, beside the poll loop, so that the loop and the
// at-once path (event_reader::cqe, flattened) inline it.
void cq_state::dispatch(const ibv_wc& wc) noexcept {
    if (to_op(wc)) return;
    if (!srq_qps.empty()) note_srq_receive(wc);
    deliver(wc);
}

void cq_state::deliver(const ibv_wc& wc) noexcept {
    if (closed) return; // nobody can consume it any more
    if (filling) {
        filling->out[filling->taken++] = wc;
        if (filling->taken == filling->capacity) filling = nullptr;
        return;
    }
    if (waiter* w = waiters.pop_front()) {
        auto* c = static_cast<completion_waiter*>(w); // only those wait on a cq
        c->out[c->taken++] = wc;
        c->fulfil(0);
        if (c->taken < c->capacity) filling = c;
        return;
    }
    if (count == buffer.size()) [[unlikely]]
        grow();
    buffer[(head + count) & (buffer.size() - 1)] = wc;
    ++count;
}

// One ibv_poll_cq of `c` for up to `want` completions into `wcs`, counted: how many, or -1
// when it failed (said once here; c's next() waiters end with EIO).
[[gnu::always_inline]] inline int channel_state::poll_once(cq_state& c, int want,
                                                           ibv_wc* wcs) noexcept {
    const int got = hooks().poll_cq(c.cq.native(), want, wcs);
    if (got < 0) [[unlikely]] {
        diagnose("ibv_poll_cq failed (the provider returned %d)", got);
        c.fail_waiters(EIO);
        return -1;
    }
    ++counters.polls;
    ++c.counters.polls;
    if (got == 0) {
        ++counters.empty_polls;
        ++c.counters.empty_polls;
        return 0;
    }
    const auto n = static_cast<std::size_t>(got);
    counters.completions += n;
    c.counters.completions += n;
    return got;
}

// Polls `c` until it is empty, dispatching every completion. Returns how many.
std::size_t channel_state::drain_cq(cq_state& c) noexcept {
    ibv_wc wcs[max_poll_batch];
    const std::size_t batch = options.poll_batch; // 1 to max_poll_batch (the constructor)
    std::size_t total = 0;
    for (;;) {
        const int got = poll_once(c, static_cast<int>(batch), wcs);
        if (got <= 0) break;
        const auto n = static_cast<std::size_t>(got);
        total += n;
        for (std::size_t i = 0; i < n; ++i)
            c.dispatch(wcs[i]);
        if (n < batch) break; // the CQ was empty when polled: nothing is stranded (armed first)
    }
    c.filling = nullptr;
    return total;
}

// cq::try_next with nothing buffered: polls straight into `out`, and moves every completion
// for next() to the front, in order, as a per-request await's goes to its op. A queued next()
// waiter is owed them first, so nothing is polled then. Polls again while per-request
// completions took room and the CQ filled the poll.
[[gnu::always_inline]] inline std::size_t cq_state::poll_now(ibv_wc* out, std::size_t capacity,
                                                             int& err) noexcept {
    // (Never `closed` here: that is the cq handle's end, and try_next is called through it.)
    if (error != 0 || channel->error != 0 || !waiters.empty()) [[unlikely]] {
        err = error != 0 ? error : channel->error;
        return 0;
    }
    std::size_t kept = 0;
    bool emptied = false; // the last poll found the CQ empty (it gave less than asked)
    for (;;) {
        const int want = static_cast<int>(std::min<std::size_t>(capacity - kept, INT_MAX));
        const int got = channel->poll_once(*this, want, out + kept);
        if (got <= 0) {
            if (got < 0 && kept == 0) err = EIO;
            emptied = got == 0;
            break;
        }
        const std::size_t end = kept + static_cast<std::size_t>(got);
        for (std::size_t i = kept; i < end; ++i) {
            if (to_op(out[i])) continue;
            if (!srq_qps.empty()) note_srq_receive(out[i]);
            if (i != kept) out[kept] = out[i];
            ++kept;
        }
        emptied = got < want;
        if (kept == capacity || emptied) break;
    }
    // Only a CQ left empty is the consumer's for the next pass: one it left completions in
    // (taking fewer than it holds) is drained by the pass as usual, so a per-request await
    // behind them is not held back while the consumer takes one a turn.
    polled_by_consumer = emptied;
    channel->run_deferred_watches_if_any();
    return kept;
}

namespace {
[[noreturn, gnu::cold, gnu::noinline]] void try_next_failed(int err) {
    if (err == EIO) throw_system_error(err, "cq::try_next: ibv_poll_cq failed");
    throw_cq_failure("cq::try_next", err);
}
} // namespace

} // namespace detail

// Here, beside the poll: a try_next that polls runs without calls between itself and the
// poll's counting and sorting (the provider's poll, and a per-request op's handler, are left).
std::size_t cq::try_next_polled(std::span<ibv_wc> out) {
    int err = 0;
    const std::size_t n = state_->poll_now(out.data(), out.size(), err);
    if (n == 0 && err != 0) [[unlikely]]
        detail::try_next_failed(err);
    return n;
}

// try_next(wc) with nothing buffered: poll_now for one completion, without its loop over a
// batch (about 20 instructions fewer, tools/bench-cost's busy ours_poll). A per-request
// await's completion is polled into `wc` too, handed to its op, and the CQ polled again.
bool cq::try_next_polled(ibv_wc& wc) {
    detail::cq_state& s = *state_;
    detail::channel_state& ch = *s.channel;
    if (s.error != 0 || ch.error != 0 || !s.waiters.empty()) [[unlikely]]
        return try_next_polled(std::span<ibv_wc>(&wc, 1)) != 0; // says why, or takes nothing
    int got;
    while ((got = ch.poll_once(s, 1, &wc)) > 0) {
        if (s.to_op(wc)) continue;
        if (!s.srq_qps.empty()) s.note_srq_receive(wc);
        break;
    }
    s.polled_by_consumer = got == 0; // left empty (see poll_now)
    ch.run_deferred_watches_if_any();
    if (got < 0) [[unlikely]]
        detail::try_next_failed(EIO);
    return got > 0;
}

namespace detail {

// No poll is under way: the QPs a handler moved to the error state during one start their
// flush watch now, which may end what they owe at once (reset(), polling their CQs again, and
// running this list after). Inside such a reset the loop already under way takes what its
// polls listed: one after another, not each watch inside the one before (the stack would grow
// with the number of QPs listed).
void channel_state::run_deferred_watches() noexcept {
    if (running_deferred_watches) return;
    running_deferred_watches = true;
    while (qp_state* q = deferred_watches) {
        deferred_watches = q->deferred_next;
        q->deferred_next = nullptr;
        q->watch_deferred = false;
        q->watch_flush();
    }
    running_deferred_watches = false;
}

// One service pass, in the io_context's poller phase (after the CQEs of this turn, before
// coroutines resume). The order per CQ is the one that strands nothing: take the event, count
// it for the batched ack, re-arm, then poll until empty: a completion that lands between the
// last poll and the arm raises a new event, one that lands before is found by the poll.
void channel_state::run_service() noexcept {
    service_pass();
    // After the pass's polls, in this turn: a flush watch a handler deferred (the at-once path
    // queued this pass for it).
    run_deferred_watches_if_any();
}

void channel_state::service_pass() noexcept {
    std::size_t found = 0;
    // CQs still armed after this turn's ring events: some may have an event still unread.
    const std::size_t armed_before = armed_cqs;
    if (fd_ready || !fired.empty()) {
        const std::optional<std::size_t> got = handle_wakeup();
        if (!got) return; // the channel failed
        found = *got;
    }
    if (reader) reader->refill(armed_before);
    if (rearm_due && !spinning) found += rearm_unarmed();
    if (!spinning) {
        // events, or hybrid asleep: completions that woke a hybrid channel open its window.
        if (found > 0 && options.mode == polling_mode::hybrid) start_spin();
        return;
    }
    spin_pass(found); // hybrid in its window (busy has a pass of its own: busy_pass)
}

// Events came: the ring's reads put their CQs in `fired` already; the poll said the fd is
// readable: read its events. Then counts, arms and polls each CQ that fired. Returns the
// completions found, or nothing when the channel failed.
std::optional<std::size_t> channel_state::handle_wakeup() noexcept {
    read_outcome read = read_outcome::all_read;
    if (fd_ready) {
        fd_ready = false;
        read = read_events();
        if (read == read_outcome::failed) return std::nullopt;
    }
    // Serviced from a vector of its own, each CQ unlisted first: an event that reaches `fired`
    // during the pass (a waiter's timer or a dispatch that ends a CQ's state; before
    // io_context::get_sqe() set CQEs aside, also a nested reap of the ring's reads) goes to
    // the next pass (queued below), not past this loop's end, where it was dropped: its CQ
    // never armed again (review of the ring path).
    servicing.swap(fired);
    for (cq_state* c : servicing)
        c->in_fired = false;
    std::size_t found = 0;
    for (std::size_t i = 0; i < servicing.size(); ++i)
        if (cq_state* c = servicing[i]) found += service_fired(*c); // null: destroyed meanwhile
    servicing.clear();
    if (!fired.empty()) detail::loop(*ctx).queue_poller(&service);
    if (read == read_outcome::interrupted) {
        fd_ready = true;
        detail::loop(*ctx).queue_poller(&service);
    }
    return found;
}

void channel_state::count_event(cq_state& c) noexcept {
    ++counters.events;
    ++c.counters.events;
    c.set_armed(false);
}

// An event of `c`, read by either path.
void channel_state::take_event(cq_state& c) noexcept {
    count_event(c);
    // A flag, not a search of `fired`: one wakeup may bring an event from each of thousands
    // of CQs.
    if (!c.in_fired) {
        c.in_fired = true;
        fired.push_back(&c);
    }
}

void channel_state::ring_event(void* cq_context) noexcept {
    if (error != 0) return;      // counted unacked already: acked when its CQ goes
    if (cq_context == nullptr) { // its cq is gone, the CQ lives on (~cq_state)
        ++counters.gone_cq_events;
        return;
    }
    if (fired.empty()) {
        ++counters.wakeups; // the first event of this turn
        detail::loop(*ctx).queue_poller(&service);
    }
    take_event(*static_cast<cq_state*>(cq_context));
}

// The syscall path: adds the CQs with an event to `fired`, each marked disarmed.
channel_state::read_outcome channel_state::read_events() noexcept {
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
                return read_outcome::failed;
            }
            // Interrupted: the event is still there, and the multishot poll reports the
            // fd only on a new wakeup. Read again on the next turn.
            return read_outcome::interrupted;
        }
        if (!ev) break;
        if (ev->user_context == nullptr) { // its cq is gone, the CQ lives on (~cq_state)
            ++counters.gone_cq_events;
            continue;
        }
        take_event(*static_cast<cq_state*>(ev->user_context));
    }
    return read_outcome::all_read;
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

// busy: poll every CQ on every turn, for ever. Its service poller runs this instead of
// run_service: a busy channel arms nothing and reads no event (no fd watch, no reader, no
// `fired`, no failed arm), so of a service pass only the polls are left, and the flush
// watches a handler deferred (tools/bench-cost: about 40 instructions less a turn). Its
// poller runs it flattened: the polls, dispatch and deliver without calls between them.
[[gnu::flatten]] void channel_state::busy_service(poller* p) noexcept {
    static_cast<service_poller*>(p)->owner->busy_pass();
}

// A CQ that its consumer polled empty itself (cq::try_next) since the last pass is left to it
// this turn: a coroutine spinning on try_next and yield() then takes every completion with
// its own poll, once, instead of racing the pass for it (tools/bench-cost: busy ours_poll).
// Once it stops polling (or leaves completions in the CQ, or a next() waits), the next pass
// polls the CQ again: at most one turn later than without the skip.
void channel_state::busy_pass() noexcept {
    for (cq_state* c : cqs) {
        if (c->polled_by_consumer) {
            c->polled_by_consumer = false;
            continue;
        }
        drain_cq(*c);
    }
    detail::loop(*ctx).queue_poller(&service);
    run_deferred_watches_if_any();
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
