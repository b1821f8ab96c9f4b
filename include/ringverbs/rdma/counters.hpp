// What a channel, a cq and a qp did so far: counts read with channel::counters(),
// cq::counters() and qp::counters(), for tests, benchmarks and monitoring.
#pragma once

#include <ringverbs/config.hpp>

#include <cstdint>

namespace ringverbs {

struct channel_counters {
    // Turns in which the channel woke with events: its fd was reported readable
    // (event_read::syscall), or reads of the ring brought events (event_read::ring).
    std::uint64_t wakeups = 0;
    std::uint64_t events = 0;      // CQ events read (either path)
    std::uint64_t acks = 0;        // ibv_ack_cq_events calls
    std::uint64_t arms = 0;        // ibv_req_notify_cq calls
    std::uint64_t polls = 0;       // ibv_poll_cq calls
    std::uint64_t empty_polls = 0; // ibv_poll_cq calls that found nothing
    std::uint64_t completions = 0; // work completions polled
    std::uint64_t arm_retries = 0; // ibv_req_notify_cq failed for a while: armed again later
    // Events of a CQ whose ringverbs::cq was destroyed while the CQ itself lived on (a QP or a
    // completion_queue::handle() still held it) and was armed: not dispatched; acked when the
    // CQ goes.
    std::uint64_t gone_cq_events = 0;
    // Wakeups of the ring path serviced at once, in the io_context's CQE loop: one read in
    // flight brought the event of the channel's only armed CQ (events mode, no channel of the
    // io_context with a priority). The others go through the service pass.
    std::uint64_t served_at_once = 0;
};

struct cq_counters {
    std::uint64_t events = 0;
    std::uint64_t acks = 0;         // ibv_ack_cq_events calls
    std::uint64_t acked_events = 0; // events acked by those calls
    std::uint64_t arms = 0;
    std::uint64_t polls = 0;
    std::uint64_t empty_polls = 0;
    std::uint64_t completions = 0;
};

// What became of a qp's unsignaled sends and writes (send_options::signaled = false).
struct qp_counters {
    // Posted without a completion to wait for: their awaits ended right after posting.
    std::uint64_t unsignaled = 0;
    // Of those, posted signaled all the same (one in signal_interval(), so that the send queue
    // slots of the ones before are freed); the qp consumes their completions itself.
    std::uint64_t forced_signaled = 0;
    // Asked to be unsignaled but posted signaled and awaited like any other request, because
    // too many unsignaled ones were not yet confirmed by a completion (back pressure).
    std::uint64_t throttled = 0;
    // Completions with IBV_WC_WR_FLUSH_ERR of unsignaled or forced-signaled requests (the QP
    // went to the error state while they were outstanding).
    std::uint64_t flushed = 0;
    // Completions with any other error status of unsignaled or forced-signaled requests.
    std::uint64_t failed = 0;
};

} // namespace ringverbs
