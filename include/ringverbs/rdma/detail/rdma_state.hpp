// The runtime's state behind channel, cq and qp. Shared ownership runs one way:
// qp_state -> cq_state -> channel_state, so that a user may destroy the handles in any order:
// a channel keeps serving its CQs until the last one is gone, a CQ lives while a QP uses it.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/fd_watch.hpp>
#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/channel_options.hpp>
#include <ringverbs/rdma/counters.hpp>
#include <ringverbs/verbs/completion_channel.hpp>
#include <ringverbs/verbs/completion_queue.hpp>
#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>
#include <ringverbs/verbs/queue_pair.hpp>

#include <infiniband/verbs.h>
#include <rdma/ib_user_verbs.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

namespace ringverbs::detail {

struct qp_state;
struct cq_state;
struct channel_state;
struct srq_state;

// A posted work request that a coroutine awaits. wr_id carries its address, tagged.
struct wr_op {
    void (*on_wc)(wr_op* self, const ibv_wc& wc, bool last) noexcept = nullptr;
    wr_op* prev = nullptr; // the QP's list of requests still owed a completion
    wr_op* next = nullptr;
};

// The requests owed a completion: an intrusive doubly linked list of wr_ops from `head`
// (a qp's and an srq's each count theirs beside it).
inline void push_owed(wr_op*& head, wr_op* op) noexcept {
    op->prev = nullptr;
    op->next = head;
    if (head) head->prev = op;
    head = op;
}
inline void remove_owed(wr_op*& head, wr_op* op) noexcept {
    if (op->prev)
        op->prev->next = op->next;
    else
        head = op->next;
    if (op->next) op->next->prev = op->prev;
    op->prev = op->next = nullptr;
}

// wr_id values with the top bit set belong to ringverbs' per-request awaits; bit 62 marks the
// last request of a chain, whose completion ends the await. Other wr_ids go to cq::next().
inline constexpr std::uint64_t wr_tag_ours = std::uint64_t{1} << 63;
inline constexpr std::uint64_t wr_tag_last = std::uint64_t{1} << 62;
inline std::uint64_t wr_id_for(wr_op* op, bool last) noexcept {
    return reinterpret_cast<std::uintptr_t>(op) | wr_tag_ours | (last ? wr_tag_last : 0);
}

// The ring path's reads of a channel's fd (event_read::ring): one-shot IORING_OP_READs of one
// event each, re-queued from the channel's service pass so that they go out with the next
// submission (the one that waits). Its own heap object, like fd_watch, because the kernel may
// owe a read's CQE after the channel is gone, and the read's buffer must live until then.
//
// Invariants:
// - `keep_open` keeps the fd open while a read is in flight (io_uring does not cancel a read
//   when its fd is closed).
// - Every event a read returned is counted unacked on its CQ first
//   (verbs::completion_channel::take_event), whoever handles it then.
// - A read may have taken a CQ's event from the kernel while its CQE is not handled yet (the
//   CQE is in the ring, or in the kernel's overflow list): until it is, ibv_destroy_cq of that
//   CQ would wait for ever for an ack. So a CQ that may have an event in flight (armed) is not
//   destroyed while reads are in flight: cq_state hands it over (retire), every read is
//   cancelled, and once none is in flight the retired CQs are destroyed and reading resumes.
// - One read in flight while the events come one per wakeup (each read in flight is woken by
//   every event: the losers cost the kernel a retry); more (up to slot_count) while every read
//   comes back with an event and armed CQs may have more.
// - Its CQE callback runs in the CQE loop and never resumes a coroutine. It hands events to
//   the channel's service poller, except in the common case of one read in flight bringing the
//   event of the channel's only armed CQ (events mode, nothing else pending for the channel, no
//   channel of the io_context with a priority): then it services that CQ at once, as the
//   service pass would (ack batch, arm, poll until empty, dispatch), and queues the next read
//   (serve_at_once). What the pass would add (the `fired` list, the poller, the adaptation of
//   the reads in flight) has nothing to do there; the order of the steps per CQ is the same,
//   and completions still only make coroutines ready.
struct event_reader {
    static constexpr std::size_t slot_count = 8;
    struct slot : operation {
        event_reader* reader = nullptr;
        ib_uverbs_comp_event_desc event{}; // the kernel writes one event here
        bool in_flight = false;
        // This slot's read, prepared once (the fd, the buffer and the slot never change):
        // queue() copies it into the ring's SQE. Bytes, not an io_uring_sqe member: its last
        // union has a zero-length array, which ISO C++ does not allow in a member.
        alignas(io_uring_sqe) unsigned char read[sizeof(io_uring_sqe)]{};
    };

    channel_state* owner = nullptr; // null once orphaned (the channel is gone)
    io_context* ctx = nullptr;
    std::shared_ptr<ibv_comp_channel> keep_open;
    slot slots[slot_count];
    std::size_t in_flight = 0;
    std::size_t wanted = 1;          // reads to keep in flight
    std::size_t turn_events = 0;     // reads that came back with an event since the last refill
    bool read_once = false;          // a read returned an event: the ring path works here
    bool stopped = false;            // no more reads: the channel failed or fell back
    bool cancelling = false;         // every read was cancelled for `retiring`
    unsigned failed_attempts = 0;    // refills in a row that could not get an SQE
    unsigned transient_failures = 0; // reads in a row the kernel ended ENOMEM, ENOBUFS, EBUSY
    std::vector<verbs::completion_queue> retiring; // CQs to destroy once no read is in flight

    explicit event_reader(channel_state& ch);
    event_reader(const event_reader&) = delete;
    event_reader& operator=(const event_reader&) = delete;

    // Queues the first read (or falls back, fails: see ended_without_event). Throws
    // std::system_error naming io_uring_submit.
    void start();
    // The service pass: adapts `wanted` to what the reads of this turn found (armed: CQs
    // still armed, which may have an event pending), then queues reads up to it.
    void refill(std::size_t armed) noexcept;
    // Destroys `cq` once no read can hold an unhandled event of it (see above).
    void retire(verbs::completion_queue cq) noexcept;
    // No more reads; those in flight are cancelled (their events are still delivered).
    void stop() noexcept;
    // For the channel's destructor: cancels the reads and frees the reader on the last CQE,
    // or now when none is in flight.
    void release() noexcept;

  private:
    void queue(slot& s);
    void ended_without_event(int res) noexcept;
    void cancel_reads() noexcept;
    void settled() noexcept;
    bool read_again(slot& s) noexcept;
    bool serve_at_once(slot& s, void* cq_context) noexcept;
    static void cqe(operation* op, int res, unsigned flags) noexcept;
};

struct channel_state {
    struct service_poller : poller {
        channel_state* owner;
    };

    io_context* ctx;
    verbs::completion_channel channel;
    // A share of the device: the channel's CQs are made on it, whatever became of the
    // verbs::context the channel was made from (a temporary, a moved-from object).
    verbs::context device;
    channel_options options;
    // Counts a channel with a priority on its io_context (has_prioritized_sources), for as long
    // as the channel lives: events are then serviced in the poller phase only, in priority order.
    struct priority_mark {
        io_context* ctx = nullptr;
        priority_mark(io_context& c, int priority) noexcept {
            if (priority == 0) return;
            ctx = &c;
            detail::loop(c).add_prioritized_source();
        }
        ~priority_mark() {
            if (ctx) detail::loop(*ctx).remove_prioritized_source();
        }
        priority_mark(const priority_mark&) = delete;
        priority_mark& operator=(const priority_mark&) = delete;
    } prioritized;
    // Whether the device raises an event for a solicited receive on a CQ armed solicited-only:
    // -1 not asked yet, 0 no (siw), 1 yes. See cq_options::solicited_only.
    int solicited_events = -1;
    channel_counters counters;
    fd_watch* watch = nullptr;      // event_read::syscall: the multishot poll on the fd
    event_reader* reader = nullptr; // event_read::ring: the reads of the fd
    service_poller service;
    // syscall path: the fd was reported readable, drain its events this turn; ring path: the
    // reads brought events this turn (in `fired`).
    bool fd_ready = false;
    bool spinning = false; // busy, or hybrid within its spin window
    std::chrono::steady_clock::time_point last_completion{};
    std::chrono::nanoseconds spin_window{}; // hybrid: options.hybrid_spin, or adapted
    int next_vector = 0;
    // CQs armed and not yet fired. Each raises at most one event per arm, so once this is 0
    // no event can be pending and reading the fd again would only return EAGAIN.
    std::size_t armed_cqs = 0;
    std::uint32_t spin_turns = 0;
    std::vector<cq_state*> cqs;       // attached CQs (raw: each removes itself)
    std::vector<cq_state*> fired;     // CQs with an event this turn
    std::vector<cq_state*> servicing; // the `fired` a service pass works through (handle_wakeup)
    int error = 0;                    // a failure of the fd's poll or reads: the channel is dead
    bool rearm_due = false;           // a CQ's arming failed for a while: arm it on the next pass
    // QPs moved to the error state by a handler during a poll of this channel's CQs
    // (qp_state::to_error_in_poll): their flush watch runs after that poll, at the end of
    // the service pass (queued for it when the poll was the at-once path's) or after the
    // polls of a reset() or an srq's end (intrusive through qp_state::deferred_next).
    qp_state* deferred_watches = nullptr;
    bool running_deferred_watches = false; // run_deferred_watches is under way

    channel_state(io_context& c, const verbs::context& dev, const channel_options& o);
    ~channel_state();
    channel_state(const channel_state&) = delete;
    channel_state& operator=(const channel_state&) = delete;

    void run_service() noexcept;
    void service_pass() noexcept;
    // run_service's steps, per polling mode (see channel.cpp).
    enum class read_outcome { all_read, interrupted, failed }; // how read_events() ended
    std::optional<std::size_t> handle_wakeup() noexcept;
    read_outcome read_events() noexcept;
    // An event of `c` (read by either path): counted, `c` disarmed and listed in `fired`.
    void take_event(cq_state& c) noexcept;
    // take_event's counting: `c` had an event (counters; disarmed), not listed in `fired`.
    void count_event(cq_state& c) noexcept;
    // The ring path: an event a read returned, for the CQ of `cq_context` (a cq_state).
    void ring_event(void* cq_context) noexcept;
    // The ring path was refused (`err`), or failed for a while (`transient`: ENOMEM, ENOBUFS,
    // EBUSY max_retries times in a row): reads with ibv_get_cq_event from now on.
    void fall_back(int err, bool transient = false) noexcept;
    void start_watch();
    std::size_t service_fired(cq_state& c) noexcept;
    void start_spin() noexcept;
    std::size_t poll_all() noexcept;
    void busy_pass() noexcept;
    static void busy_service(poller* p) noexcept; // busy: the service poller's function
    void spin_pass(std::size_t found) noexcept;
    void end_spin(std::chrono::steady_clock::time_point now) noexcept;
    std::size_t rearm_unarmed() noexcept;
    void adapt_spin(std::chrono::nanoseconds gap) noexcept;
    inline int poll_once(cq_state& cq, int want, ibv_wc* wcs) noexcept; // channel.cpp only
    std::size_t drain_cq(cq_state& cq) noexcept;
    void run_deferred_watches() noexcept;
    // After a poll outside a service pass (a reset's, an srq's end): the watches it deferred.
    void run_deferred_watches_if_any() noexcept {
        if (deferred_watches != nullptr) [[unlikely]]
            run_deferred_watches();
    }
    void fail(int err) noexcept;
};

// A cq::next() / next_batch() waiter, as the cq's state sees it: completions go to
// out[taken .. capacity).
struct completion_waiter : waiter {
    ibv_wc* out = nullptr;
    std::size_t capacity = 0;
    std::size_t taken = 0;
};

struct cq_state {
    // The wr_id of every unsignaled request whose send queue completes here: such a request
    // produces a completion only when it fails or is flushed, possibly after its qp is gone,
    // so the wr_id names this object, which lives as long as the CQ itself. It counts the
    // failure on the qp (found by qp_num) when that qp is still there.
    struct unsignaled_sink : wr_op {
        cq_state* owner = nullptr;
    };

    std::shared_ptr<channel_state> channel;
    verbs::completion_queue cq;
    bool solicited_only = false; // as asked (cq_options): sends are refused on such a CQ
    // Armed with solicited_only = 1: solicited_only, unless the device never notifies solicited
    // receives (siw, see cq_options), where every completion must raise the event.
    bool arm_solicited = false;
    bool armed = false;
    bool in_fired = false; // listed in channel->fired (an event this turn)
    // cq::try_next polled it empty since the last busy pass, which skips it once (busy_pass);
    // cleared when a next() waiter is queued.
    bool polled_by_consumer = false;
    bool closed = false; // the user's cq handle is gone: next() consumers are no more
    int error = 0;       // EOVERFLOW after IBV_EVENT_CQ_ERR (device_events): dead
    // What said that the device went away (detail::device_lost), or null: error is ENODEV.
    const char* lost = nullptr;
    // detail::device_lost posted this cq's loss to its thread already (read and written only
    // under the registry's lock): one post per object, however many times the loss is told.
    bool loss_told = false;
    cq_counters counters;
    waiter_queue waiters; // of completion_waiter
    // A next_batch() waiter fulfilled during the current poll with room left: the poll's
    // further completions go to it too. It cannot have resumed yet (coroutines resume after
    // the poll); drain_cq clears this at its end, before it could.
    completion_waiter* filling = nullptr;
    // Completions nobody waits for yet, for next(). A ring with the CQ's capacity, grown
    // (allocation) only if consumers fall behind by more than that.
    std::vector<ibv_wc> buffer;
    std::size_t head = 0;
    std::size_t count = 0;
    std::vector<qp_state*> qps; // QPs using this CQ (raw: each removes itself)
    // The QPs on an SRQ whose receive CQ this is, by qp_num: their receives' completions
    // count on the SRQ (srq_state::posted). A failed completion does not say whether it was a
    // receive: counted only for a QP whose send CQ is another.
    struct srq_receiver {
        srq_state* srq;
        bool receives_only;
    };
    std::unordered_map<std::uint32_t, srq_receiver> srq_qps;
    // Completions the QPs on this CQ can produce at once (their send or receive queue
    // capacities), for the overrun check at qp creation.
    std::size_t committed = 0;
    unsignaled_sink unsignaled;

    cq_state(std::shared_ptr<channel_state> ch, int entries, int comp_vector, bool solicited);
    ~cq_state();
    cq_state(const cq_state&) = delete;
    cq_state& operator=(const cq_state&) = delete;

    void dispatch(const ibv_wc& wc) noexcept;
    inline bool to_op(const ibv_wc& wc) noexcept; // defined (and only used) in channel.cpp
    void deliver(const ibv_wc& wc) noexcept;
    // A pool completion of a QP on an SRQ: counted on the SRQ. Out of line (see grow()).
    [[gnu::noinline]] void note_srq_receive(const ibv_wc& wc) noexcept;
    [[gnu::noinline]] void grow() noexcept;
    // Inline: cq::next() looks here before it waits (an empty buffer costs a compare).
    bool pop(ibv_wc& out) noexcept {
        if (count == 0) return false;
        out = buffer[head];
        head = (head + 1) & (buffer.size() - 1);
        --count;
        return true;
    }
    // Arms the CQ (ibv_req_notify_cq); a failure is handled out of line (arm_failed).
    void arm() noexcept {
        const int rc = verbs::detail::hooks().req_notify_cq(cq.native(), arm_solicited ? 1 : 0);
        if (rc != 0) [[unlikely]] {
            arm_failed(rc);
            return;
        }
        set_armed(true);
        ++counters.arms;
    }
    void arm_failed(int rc) noexcept;
    void set_armed(bool on) noexcept {
        if (on == armed) return;
        armed = on;
        if (on)
            ++channel->armed_cqs;
        else
            --channel->armed_cqs;
    }
    void fail_waiters(int err) noexcept;
    // cq::try_next with nothing buffered: polls into `out` unless next() waiters are queued
    // or the cq cannot give any more. Returns how many; sets `err` when none came because the
    // cq or its channel failed (EIO: ibv_poll_cq did).
    inline std::size_t poll_now(ibv_wc* out, std::size_t capacity, int& err) noexcept;
};

struct srq_state;

struct qp_state {
    // The wr_id of the signaled request posted every signal_interval unsignaled ones. Each
    // such request is owed a completion like an awaited one: counted in pending_count, the
    // sink sits in the pending list while any is outstanding, and teardown waits for them.
    struct sink_op : wr_op {
        qp_state* owner = nullptr;
    };
    // How many forced-signaled requests may be unconfirmed before the next one is awaited
    // instead (throttled): bounds the send queue slots held by unsignaled requests to about
    // (max_sink_outstanding + 1) * signal_interval.
    static constexpr std::size_t max_sink_outstanding = 2;

    std::shared_ptr<cq_state> send_cq;
    std::shared_ptr<cq_state> recv_cq;
    // Receives come from this SRQ (or null). Declared before qp: destroyed after it
    // (ibv_destroy_srq refuses while a QP uses the SRQ).
    std::shared_ptr<srq_state> srq;
    verbs::queue_pair qp;
    wr_op* pending = nullptr; // requests owed a completion (intrusive list)
    std::size_t pending_count = 0;
    // We moved the QP to the error state (to_error, or reset() to RESET clears it). It stays
    // set until a post finds the QP out of that state (the user reset and connected it).
    bool in_error = false;
    bool posted_in_error = false; // the request being posted goes to a QP in the error state
    // We reset the QP (reset(): the bounded flush, an abandoned post) and no post since found
    // it connected again. siw ignores RESET and keeps the QP in ERROR, where a post is queued
    // and never completes: such a post is refused (posting_while_in_error).
    bool reset_by_us = false;
    // The connection of this QP's cm_id ended (DISCONNECTED, or our rdma_disconnect): its
    // flushes from now on end their awaits with connection_reset.
    bool connection_closed = false;
    // An iWARP QP of a cm_id (cm_id::make_qp): its error state and the end of its connection
    // are one (the TCP stream ends with it), and it fails before rdma_cm reports
    // DISCONNECTED, so its flushes are polled before connection_closed could be set.
    bool iwarp_connection = false;
    bool request_failed = false; // a request of this QP completed with a non-flush error
    // What said that the device went away (detail::device_lost), or null. Once set, what was
    // owed ended (made up, device_lost_vendor_err) and every post is refused with ENODEV
    // (in_error stays set, so posts take the path that checks this).
    const char* lost = nullptr;
    // detail::device_lost posted this qp's loss to its thread already (registry's lock only).
    bool loss_told = false;
    // The errno with which a completion channel of its CQs, or of its srq's receive CQs,
    // failed (channel_state::fail; cut_off_by_srq says which), or 0: nothing of this QP's can
    // complete any more. Once set, what was owed ended (made up, channel_failed_vendor_err)
    // and every post is refused with it (as for `lost`).
    int channel_failed = 0;
    // channel_failed came from a receive CQ of its srq (srq_state::mark_cut_off), not from a
    // CQ of its own: messages say so.
    bool cut_off_by_srq = false;
    // Marked by channel_state::fail's first pass (channel_failed set), not reset yet: its
    // second pass ends what is owed (finish_cut_off).
    bool cut_off_owed = false;

    // Whether the failed completion `wc` was flushed because the QP's connection ended
    // (connection_reset): after DISCONNECTED or our rdma_disconnect; on an iWARP connection
    // also when the QP failed by itself: not moved to error by us, no request failing first.
    bool flushed_by_closed_connection(const ibv_wc& wc) noexcept {
        if (wc.status != IBV_WC_WR_FLUSH_ERR) {
            if (wc.status != IBV_WC_SUCCESS) request_failed = true;
            return false;
        }
        if (iwarp_connection && !in_error && !request_failed) connection_closed = true;
        return connection_closed;
    }
    sink_op sink;
    std::size_t sink_outstanding = 0;  // forced-signaled requests owed a completion
    std::uint32_t signal_interval = 1; // at least one signaled in this many unsignaled
    std::uint32_t unsignaled_run = 0;  // unsignaled posted since the last signaled one
    qp_counters counters;
    std::optional<ibv_wc> unsignaled_failure; // the first non-flush failure of one of them

    // The bounded flush: armed while the QP is in the error state with requests owed.
    struct flush_timer_op : operation {
        qp_state* owner = nullptr;
    };

    io_context* ctx;
    std::chrono::nanoseconds flush_timeout;
    flush_timer_op flush_timer;
    __kernel_timespec flush_ts{};
    bool flush_timer_armed = false;
    // Listed in recv_cq's channel's deferred_watches (to_error_in_poll).
    bool watch_deferred = false;
    qp_state* deferred_next = nullptr;
    // Set by ~qp while requests are still owed: the state owns itself until the last one
    // completes (or is declared never flushed), then frees itself from its flush timer's CQE.
    std::shared_ptr<qp_state> keep_alive;
    waiter_queue close_waiters;     // qp::close(): resumed once nothing is owed
    std::size_t committed_send = 0; // what this QP added to send_cq->committed
    std::size_t committed_recv = 0;
    // The recv_ring of this QP (a recv_ring_state), owned here so that its slots, the wr_ids
    // of its receives, live until the last of those completed.
    std::shared_ptr<void> recv_ring;

    // `flush_timeout`: see qp_options. `overcommit`: allow the QPs on a CQ to hold more
    // requests than the CQ has entries (else EINVAL).
    qp_state(const verbs::protection_domain& pd, std::shared_ptr<cq_state> scq,
             std::shared_ptr<cq_state> rcq, std::shared_ptr<srq_state> srq,
             const verbs::qp_caps& caps, std::chrono::nanoseconds flush_timeout, bool overcommit);
    // A QP created elsewhere on these CQs (rdma_create_qp for a cm_id), and on `srq` if any.
    qp_state(std::shared_ptr<cq_state> scq, std::shared_ptr<cq_state> rcq,
             std::shared_ptr<srq_state> srq, verbs::queue_pair q,
             std::chrono::nanoseconds flush_timeout, bool overcommit);
    ~qp_state();
    qp_state(const qp_state&) = delete;
    qp_state& operator=(const qp_state&) = delete;

    // Inline: once each per request, on the hot path.
    void link(wr_op* op) noexcept {
        push_owed(pending, op);
        ++pending_count;
    }
    void unlink(wr_op* op) noexcept {
        remove_owed(pending, op);
        if (--pending_count == 0) owed_nothing();
    }
    // The last owed request completed.
    void owed_nothing() noexcept;
    // A forced-signaled request was posted / its completion arrived.
    void sink_posted() noexcept {
        if (sink_outstanding++ == 0)
            link(&sink);
        else
            ++pending_count;
    }
    static void sink_completed(wr_op* op, const ibv_wc& wc, bool last) noexcept;
    // Counts the completion of an unsignaled or forced-signaled request.
    void note_unsignaled(const ibv_wc& wc) noexcept;
    // ibv_modify_qp to `state` through the hook table (a fault layer sees the QP's own
    // transitions). Throws std::system_error naming ibv_modify_qp, the qp and the state.
    void move_to(ibv_qp_state state);
    // Moves the QP to the error state (flushing every outstanding request) and starts the
    // bounded flush. Never throws: a failure goes to the diagnostics sink, and the flush
    // timer then ends what is owed.
    void to_error() noexcept;
    // to_error's first half: moves the QP to ERR unless we did already (a failure goes to
    // the diagnostics sink); in_error from then on.
    void enter_error() noexcept;
    // to_error from a completion handler, inside a poll of the QP's CQs (drain_cq): the
    // flush watch runs after the poll (channel_state::deferred_watches), since its fallback
    // (reset(): no SQE for the timer, or the io_context shutting down) polls those CQs and
    // would make up an end for a request whose real completion is still in the batch, which
    // then ended it a second time.
    void to_error_in_poll() noexcept;
    // A request is about to be posted while in_error or reset_by_us: asks the device whether
    // the QP is still in the error state (then the post is bounded like a flush) or was
    // connected again since. Throws std::system_error (EINVAL, naming `verb` and the qp) when
    // we reset it and it reads RESET: no device completes a post there (rxe refuses it with
    // EINVAL itself; siw, whose QP is really still in ERROR, would queue it for ever).
    // First refuses the post when the QP's device went away (ENODEV) or a completion channel
    // of its CQs failed (that errno).
    void posting_while_in_error(const char* verb);
    // Around every post of this QP (qp::request, recv_ring), the in-error probe written once:
    // before_post refuses it or marks it posted in the error state (posting_while_in_error,
    // only then); after_post, once it is posted, bounds it like a flush when it was so marked
    // and is owed a completion (`owed`: not a plain unsignaled send).
    void before_post(const char* verb) {
        if (in_error || reset_by_us) [[unlikely]]
            posting_while_in_error(verb);
    }
    void after_post(bool owed) noexcept {
        if (!posted_in_error) [[likely]]
            return;
        posted_in_error = false;
        if (owed) watch_flush();
    }
    // A completion channel of its CQs (or, `by_srq`, of its srq's receive CQs) failed with
    // `err` (channel_state::fail), in two steps so that every QP on the failed CQs reads as
    // cut off before any of them drains a shared CQ: mark_cut_off sets channel_failed (not
    // when lost or marked already), finish_cut_off ends what is owed (reset(), made up with
    // channel_failed_vendor_err) and makes later posts refused.
    void mark_cut_off(int err, bool by_srq = false) noexcept;
    void finish_cut_off() noexcept;
    // What cut it off, for messages: "a completion channel of its CQs failed" or "... of its
    // srq's receive CQs failed".
    const char* cut_off_cause() const noexcept;
    // The vendor_err a flush of this QP reads as once it was cut off: device_lost_vendor_err
    // (lost), channel_failed_vendor_err(channel_failed, cut_off_by_srq), or 0 when neither
    // happened.
    std::uint32_t cut_off_vendor_err() const noexcept;
    // Starts the flush timer when requests are owed and it is not running. Where no timer
    // can run (the io_context is being destroyed) ends them at once (reset()).
    void watch_flush() noexcept;
    // From the cm layer, for the QP of a cm_id (cm_id::make_qp), which writes none of these
    // fields itself: the connection is on iWARP (set once, at make_qp); it ended (DISCONNECTED
    // or our rdma_disconnect: flushes from now on end their awaits with connection_reset);
    // rdma_disconnect moved the QP to the error state (its flushes bounded, as to_error's).
    void on_iwarp_connection() noexcept { iwarp_connection = true; }
    void connection_ended() noexcept { connection_closed = true; }
    void moved_to_error_by_disconnect() noexcept {
        in_error = true;
        watch_flush();
    }
    // Ends every request still owed, without waiting: moves the QP to the error state (unless
    // in_error; a device that ignores RESET, siw, flushes what it holds there) and then to
    // RESET (after which the device produces no completion for it), polls its CQs
    // (dispatching what the device delivered), then completes each remaining request with a
    // made-up IBV_WC_WR_FLUSH_ERR whose vendor_err is `made_up`: 0, never_flushed_vendor_err
    // (the device did not flush them in time) or device_lost_vendor_err. Not from inside a CQ
    // poll (drain_cq): it polls the CQs.
    void reset(std::uint32_t made_up) noexcept;
    // ~qp: frees the state now when nothing is owed and no flush timer is in flight, or keeps
    // it alive until then.
    static void release(std::shared_ptr<qp_state> self) noexcept;
    static void flush_timer_fired(operation* op, int res, unsigned flags) noexcept;
};

// vendor_err of the completions made up by qp_state::reset(true) for requests the device
// never flushed (a device whose flushes get lost: Linux 6.1's rxe, a CQ overrun).
inline constexpr std::uint32_t never_flushed_vendor_err = 0x7269'6e67; // "ring"
// vendor_err of the completions made up for what was owed when the device went away
// (detail::device_lost): their awaits end with ENODEV.
inline constexpr std::uint32_t device_lost_vendor_err = 0x676f'6e65; // "gone"
// vendor_err of the completions made up for what was owed when a completion channel failed
// (qp_state::finish_cut_off, srq_state::finish_cut_off): "ch" (one of the QP's own CQs) or
// "cs" (a receive CQ of its srq), and the channel's errno in the low 16 bits; their awaits end
// with that errno.
inline constexpr std::uint32_t channel_failed_tag = 0x6368'0000;     // "ch"
inline constexpr std::uint32_t srq_channel_failed_tag = 0x6373'0000; // "cs"
inline constexpr std::uint32_t channel_failed_vendor_err(int err, bool via_srq = false) noexcept {
    return (via_srq ? srq_channel_failed_tag : channel_failed_tag) |
           (static_cast<std::uint32_t>(err) & 0xffff);
}
// Whether a made-up channel_failed_vendor_err came from a receive CQ of the QP's srq.
inline constexpr bool channel_failed_via_srq(std::uint32_t vendor_err) noexcept {
    return (vendor_err & 0xffff'0000) == srq_channel_failed_tag;
}
// The channel's errno of a made-up channel_failed_vendor_err, or 0.
inline constexpr int channel_failed_errno(std::uint32_t vendor_err) noexcept {
    const std::uint32_t tag = vendor_err & 0xffff'0000;
    return tag == channel_failed_tag || tag == srq_channel_failed_tag
               ? static_cast<int>(vendor_err & 0xffff)
               : 0;
}

} // namespace ringverbs::detail
