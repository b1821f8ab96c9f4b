// channel_options: how a channel learns that its CQs have completions (polling_mode) and how
// it fetches and acknowledges them (event_read).
#pragma once

#include <ringverbs/config.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ringverbs {

// How a channel learns that its CQs have completions.
enum class polling_mode {
    events, // arm the CQs and sleep until the channel's fd turns readable: no CPU when idle
    busy,   // poll every CQ every loop turn, never arm: lowest latency, one core spinning
    hybrid, // after a completion keep polling for channel_options::hybrid_spin (adaptive up to
            // hybrid_spin_max), then arm and sleep
};

// The mode's name: "events", "busy" or "hybrid".
constexpr const char* to_string(polling_mode m) noexcept {
    switch (m) {
    case polling_mode::busy:
        return "busy";
    case polling_mode::hybrid:
        return "hybrid";
    case polling_mode::events:
        break;
    }
    return "events";
}

// The mode a name stands for ("events", "busy", "hybrid", as to_string gives them), or
// std::nullopt for any other text.
constexpr std::optional<polling_mode> parse_polling_mode(std::string_view name) noexcept {
    for (polling_mode m : {polling_mode::events, polling_mode::busy, polling_mode::hybrid})
        if (name == to_string(m)) return m;
    return std::nullopt;
}

// How a channel in events or hybrid mode reads its CQ events from the channel's fd.
enum class event_read {
    // Reads of the fd queued on the io_context's ring (IORING_OP_READ, one event each): the
    // event arrives with the wakeup, one system call fewer per wakeup. Relies on the
    // provider's cq_event op being reachable (see docs/design.md); where the kernel refuses
    // such reads, or they end short of memory (ENOMEM, ENOBUFS, EBUSY) 1000 times in a row,
    // the channel says so (diagnostics) and reads with ibv_get_cq_event instead.
    ring,
    // A multishot io_uring poll of the fd, then ibv_get_cq_event until every armed CQ had its
    // event (or EAGAIN): what libibverbs promises, one read() per wakeup more.
    syscall,
};

// The path's name: "ring" or "syscall".
constexpr const char* to_string(event_read r) noexcept {
    return r == event_read::syscall ? "syscall" : "ring";
}

// The path a name stands for ("ring", "syscall"), or std::nullopt for any other text.
constexpr std::optional<event_read> parse_event_read(std::string_view name) noexcept {
    for (event_read r : {event_read::ring, event_read::syscall})
        if (name == to_string(r)) return r;
    return std::nullopt;
}

struct channel_options {
    // When several channels of one io_context have completions in the same loop turn, the
    // coroutines of the higher priority resume first. While a channel with a priority other
    // than 0 lives, every channel of its io_context services its events in the poller phase
    // (in that order), never at once in the CQE loop (channel_counters::served_at_once): about
    // 170 user-space instructions more per wakeup.
    int priority = 0;
    polling_mode mode = polling_mode::events;
    // hybrid: how long to keep polling after the last completion before arming and sleeping.
    std::chrono::nanoseconds hybrid_spin = std::chrono::microseconds(50);
    // Events are acked per CQ once this many are unacked (ibv_ack_cq_events takes a mutex),
    // and always all of them before the CQ is destroyed.
    std::uint32_t ack_batch = 64;
    // Completions fetched per ibv_poll_cq call (0 is taken as 1, more than 64 as 64).
    unsigned poll_batch = 32;
    // hybrid, adaptive spin: when longer than hybrid_spin, the window adapts between the two.
    // A completion that wakes the channel within hybrid_spin_max of the one before (the peer
    // answered just after the window closed: each round trip would cost a sleep and a
    // wakeup) widens the window to twice that gap, at most hybrid_spin_max; a gap longer than
    // hybrid_spin_max (idle) sets it back to hybrid_spin. So CPU is spent only while the
    // traffic comes back within hybrid_spin_max. 0 (default): the window is hybrid_spin.
    std::chrono::nanoseconds hybrid_spin_max = std::chrono::nanoseconds::zero();
    // events and hybrid: how the CQ events are read from the channel's fd (busy reads none).
    event_read read = event_read::ring;
};

} // namespace ringverbs
