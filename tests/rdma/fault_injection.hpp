// Faults between the runtime and the real device, through verbs::detail::verbs_hooks: every hook
// calls the real verb first and then hides or fails part of what it did. Never a mock.
#pragma once

#include "../engine/uring_faults.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>

#include <infiniband/verbs.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>

#include <unistd.h>

namespace rt {

// Hides, for as long as it lives, every flush completion (IBV_WC_WR_FLUSH_ERR) of the QP
// numbered `qp_num` (0: of every QP): a device that never delivers them, like Linux 6.1's rxe
// sometimes. The completions are taken from the CQ and dropped.
class hide_flushes {
  public:
    explicit hide_flushes(std::uint32_t qp_num = 0) noexcept {
        target_ = qp_num;
        hidden_ = 0;
        ringverbs::verbs::detail::hooks().poll_cq = &poll;
    }
    ~hide_flushes() {
        ringverbs::verbs::detail::hooks().poll_cq = ringverbs::verbs::detail::real_verbs().poll_cq;
    }
    hide_flushes(const hide_flushes&) = delete;
    hide_flushes& operator=(const hide_flushes&) = delete;

    static int hidden() noexcept { return hidden_; }

  private:
    static bool hides(const ibv_wc& wc) noexcept {
        return wc.status == IBV_WC_WR_FLUSH_ERR && (target_ == 0 || wc.qp_num == target_);
    }
    // Keeps polling while the real CQ fills the whole request, so that a caller that stops at
    // a short batch ("the CQ is empty") is not misled by what was hidden.
    static int poll(ibv_cq* cq, int n, ibv_wc* wc) noexcept {
        int got = 0;
        for (;;) {
            const int want = n - got;
            const int r = ringverbs::verbs::detail::real_verbs().poll_cq(cq, want, wc + got);
            if (r < 0) return got > 0 ? got : r;
            int kept = got;
            for (int i = got; i < got + r; ++i) {
                if (hides(wc[i]))
                    ++hidden_;
                else
                    wc[kept++] = wc[i];
            }
            got = kept;
            if (r < want || got == n) return got;
        }
    }
    static inline std::uint32_t target_ = 0;
    static inline int hidden_ = 0;
};

// Makes the next ibv_post_recv of a chain post only its first `posted` requests for real and
// then fail with ENOMEM at the next one (bad_wr pointing at it), as a full receive queue would.
class fail_recv_chain_at {
  public:
    explicit fail_recv_chain_at(int posted) noexcept {
        posted_ = posted;
        ringverbs::verbs::detail::hooks().post_recv = &post;
    }
    ~fail_recv_chain_at() {
        ringverbs::verbs::detail::hooks().post_recv =
            ringverbs::verbs::detail::real_verbs().post_recv;
    }
    fail_recv_chain_at(const fail_recv_chain_at&) = delete;
    fail_recv_chain_at& operator=(const fail_recv_chain_at&) = delete;

  private:
    static int post(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
        ibv_recv_wr* cut = wr;
        for (int i = 1; i < posted_ && cut; ++i)
            cut = cut->next;
        if (posted_ <= 0 || cut == nullptr || cut->next == nullptr)
            return ringverbs::verbs::detail::real_verbs().post_recv(qp, wr, bad);
        ibv_recv_wr* rest = cut->next;
        cut->next = nullptr;
        const int rc = ringverbs::verbs::detail::real_verbs().post_recv(qp, wr, bad);
        cut->next = rest;
        if (rc != 0) return rc;
        *bad = rest;
        return ENOMEM;
    }
    static inline int posted_ = 0;
};

// The next `count` ibv_post_send calls, while it lives, reach the real device and then fail
// with `err` naming no request bad: what siw's provider does when the kernel refuses the
// doorbell of requests it has already written into the send queue (ENOTCONN while its QP
// leaves RTS; rxe's provider returns its doorbell's error the same way). Every request is the
// device's: it completes (or is flushed) like any other.
class refuse_send_doorbell {
  public:
    explicit refuse_send_doorbell(int count, int err = ENOTCONN) noexcept {
        left_ = count;
        err_ = err;
        refused_ = 0;
        ringverbs::verbs::detail::hooks().post_send = &post;
    }
    ~refuse_send_doorbell() {
        ringverbs::verbs::detail::hooks().post_send =
            ringverbs::verbs::detail::real_verbs().post_send;
    }
    refuse_send_doorbell(const refuse_send_doorbell&) = delete;
    refuse_send_doorbell& operator=(const refuse_send_doorbell&) = delete;

    static int refused() noexcept { return refused_; }

  private:
    static int post(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
        const int rc = ringverbs::verbs::detail::real_verbs().post_send(qp, wr, bad);
        if (rc != 0 || left_ <= 0) return rc;
        --left_;
        ++refused_;
        *bad = nullptr;
        return err_;
    }
    static inline int left_ = 0;
    static inline int err_ = 0;
    static inline int refused_ = 0;
};

// Takes out of every poll, while it lives, the completions whose wr_id is one of `wr_ids`
// (at most 8), and counts them: the runtime never sees them. For requests whose awaits have
// ended, where any later completion would name an awaiter that is gone.
class drop_late_completions {
  public:
    explicit drop_late_completions(std::span<const std::uint64_t> wr_ids) noexcept {
        count_ = 0;
        n_ = std::min<std::size_t>(wr_ids.size(), std::size(ids_));
        std::copy_n(wr_ids.begin(), n_, ids_);
        saved_ = ringverbs::verbs::detail::hooks().poll_cq;
        ringverbs::verbs::detail::hooks().poll_cq = &poll;
    }
    ~drop_late_completions() { ringverbs::verbs::detail::hooks().poll_cq = saved_; }
    drop_late_completions(const drop_late_completions&) = delete;
    drop_late_completions& operator=(const drop_late_completions&) = delete;

    static int count() noexcept { return count_; }

  private:
    static bool late(std::uint64_t wr_id) noexcept {
        return std::find(ids_, ids_ + n_, wr_id) != ids_ + n_;
    }
    // Keeps polling while the real CQ fills the whole request (as hide_flushes does).
    static int poll(ibv_cq* cq, int n, ibv_wc* wc) noexcept {
        int got = 0;
        for (;;) {
            const int want = n - got;
            const int r = saved_(cq, want, wc + got);
            if (r < 0) return got > 0 ? got : r;
            int kept = got;
            for (int i = got; i < got + r; ++i) {
                if (late(wc[i].wr_id))
                    ++count_;
                else
                    wc[kept++] = wc[i];
            }
            got = kept;
            if (r < want || got == n) return got;
        }
    }
    static inline int (*saved_)(ibv_cq*, int, ibv_wc*) noexcept = nullptr;
    static inline std::uint64_t ids_[8] = {};
    static inline std::size_t n_ = 0;
    static inline int count_ = 0;
};

// Interrupts the next `count` event reads (EINTR, nothing read: ibv_get_cq_event calls, or
// reads about to be queued on the ring) and makes the next `count` calls of ibv_req_notify_cq
// fail with EAGAIN (not armed), while it lives.
class interrupt_events {
  public:
    explicit interrupt_events(int count) noexcept {
        get_left_ = count;
        notify_left_ = count;
        interrupted_ = 0;
        refused_ = 0;
        ringverbs::verbs::detail::hooks().get_cq_event = &get_event;
        ringverbs::verbs::detail::hooks().start_event_read = &start_read;
        ringverbs::verbs::detail::hooks().req_notify_cq = &notify;
    }
    ~interrupt_events() {
        ringverbs::verbs::detail::hooks().get_cq_event =
            ringverbs::verbs::detail::real_verbs().get_cq_event;
        ringverbs::verbs::detail::hooks().start_event_read =
            ringverbs::verbs::detail::real_verbs().start_event_read;
        ringverbs::verbs::detail::hooks().req_notify_cq =
            ringverbs::verbs::detail::real_verbs().req_notify_cq;
    }
    interrupt_events(const interrupt_events&) = delete;
    interrupt_events& operator=(const interrupt_events&) = delete;

    static int interrupted() noexcept { return interrupted_; }
    static int refused() noexcept { return refused_; }

  private:
    static int get_event(ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept {
        if (get_left_ > 0) {
            --get_left_;
            ++interrupted_;
            errno = EINTR;
            return -1;
        }
        return ringverbs::verbs::detail::real_verbs().get_cq_event(ch, cq, ctx);
    }
    static int start_read(ibv_comp_channel* ch) noexcept {
        if (get_left_ > 0) {
            --get_left_;
            ++interrupted_;
            return -EINTR;
        }
        return ringverbs::verbs::detail::real_verbs().start_event_read(ch);
    }
    static int notify(ibv_cq* cq, int solicited_only) noexcept {
        if (notify_left_ > 0) {
            --notify_left_;
            ++refused_;
            return EAGAIN;
        }
        return ringverbs::verbs::detail::real_verbs().req_notify_cq(cq, solicited_only);
    }
    static inline int get_left_ = 0;
    static inline int notify_left_ = 0;
    static inline int interrupted_ = 0;
    static inline int refused_ = 0;
};

// Makes every read of a completion channel's events through the ring end without an event,
// with `err`, while it lives; counts them. EINVAL: refused as a kernel without support refuses
// it (such a channel falls back to ibv_get_cq_event at once); ENOMEM: the kernel short of
// memory for it (retried, then the same fallback).
class fail_ring_reads {
  public:
    explicit fail_ring_reads(int err) noexcept {
        err_ = err;
        calls_ = 0;
        ringverbs::verbs::detail::hooks().start_event_read = [](ibv_comp_channel*) noexcept {
            ++calls_;
            return -err_;
        };
    }
    ~fail_ring_reads() {
        ringverbs::verbs::detail::hooks().start_event_read =
            ringverbs::verbs::detail::real_verbs().start_event_read;
    }
    fail_ring_reads(const fail_ring_reads&) = delete;
    fail_ring_reads& operator=(const fail_ring_reads&) = delete;
    static int calls() noexcept { return calls_; }

  private:
    static inline int err_ = 0;
    static inline int calls_ = 0;
};

using ::test::one_stale_sqe;
using ::test::refuse_submits;

// The next `per_channel` ring reads of each completion channel's events find no SQE when they
// are queued: at the moment a read is about to be queued (its start_event_read), `io`'s
// submission ring is filled (NOPs nobody waits for) and io_uring_submit refused (EBUSY) exactly
// as many times as io_context::get_sqe tries it, so the read's get_sqe throws "io_uring_submit"
// as a ring that cannot be drained makes it. The loop's own submission of the turn (not hooked)
// sends the NOPs on. `seen`, if given, is called at each starved read with the channel's fd
// (before its get_sqe). Counts the starved reads, per channel; while it lives (up to 8 channels).
class starve_event_reads {
  public:
    using observer = void (*)(int channel_fd) noexcept;
    starve_event_reads(ringverbs::io_context& io, int per_channel,
                       observer seen = nullptr) noexcept {
        io_ = &io;
        per_channel_ = per_channel;
        seen_ = seen;
        channels_.fill(entry{-1, 0});
        refuse_ = 0;
        saved_submit_ = ringverbs::detail::io_uring_hooks().submit;
        ringverbs::detail::io_uring_hooks().submit = [](io_uring* ring) noexcept {
            if (refuse_ > 0) {
                --refuse_;
                return -EBUSY;
            }
            return saved_submit_(ring);
        };
        ringverbs::verbs::detail::hooks().start_event_read = [](ibv_comp_channel* ch) noexcept {
            if (entry* e = find(ch->fd); e != nullptr && e->starved < per_channel_) {
                ++e->starved;
                if (seen_ != nullptr) seen_(ch->fd);
                ::test::fill_sq(*io_, 0);
                refuse_ = ringverbs::detail::get_sqe_submit_attempts;
            }
            return ringverbs::verbs::detail::real_verbs().start_event_read(ch);
        };
    }
    ~starve_event_reads() {
        ringverbs::detail::io_uring_hooks().submit = saved_submit_;
        ringverbs::verbs::detail::hooks().start_event_read =
            ringverbs::verbs::detail::real_verbs().start_event_read;
    }
    starve_event_reads(const starve_event_reads&) = delete;
    starve_event_reads& operator=(const starve_event_reads&) = delete;
    // Starved reads of the channel with this fd, or of all of them (-1).
    static int starved(int channel_fd = -1) noexcept {
        int n = 0;
        for (const entry& e : channels_)
            if (e.fd >= 0 && (channel_fd < 0 || e.fd == channel_fd)) n += e.starved;
        return n;
    }
    // Submissions refused and not yet asked for (0 once every starved get_sqe gave up).
    static int refusals_left() noexcept { return refuse_; }

  private:
    struct entry { // fd -1: free
        int fd;
        int starved;
    };
    static entry* find(int fd) noexcept {
        for (entry& e : channels_) {
            if (e.fd == fd) return &e;
            if (e.fd < 0) {
                e.fd = fd;
                return &e;
            }
        }
        return nullptr; // more channels than it keeps: not starved
    }
    static inline ringverbs::io_context* io_ = nullptr;
    static inline int per_channel_ = 0;
    static inline observer seen_ = nullptr;
    static inline std::array<entry, 8> channels_{};
    static inline int refuse_ = 0;
    static inline decltype(ringverbs::detail::uring_hooks::submit) saved_submit_ = nullptr;
};

// Leaves `io`'s submission ring full (NOPs whose CQEs nobody waits for) and makes submitting
// fail (EBUSY), while it lives: every wait that needs an SQE throws "io_uring_submit".
class refuse_submission {
  public:
    explicit refuse_submission(ringverbs::io_context& io) noexcept : refused_(filled(io)) {}

  private:
    static int filled(ringverbs::io_context& io) noexcept {
        ::test::fill_sq(io, 0);
        return std::numeric_limits<int>::max();
    }
    refuse_submits refused_;
};

// Aborts the test program, naming `what`, unless destroyed within `limit`: a hang becomes a
// failure with a message instead of a CI timeout.
class watchdog {
  public:
    watchdog(std::chrono::seconds limit, const char* what)
        : thread_([limit, what](std::stop_token st) {
              std::mutex m;
              std::condition_variable_any cv;
              std::unique_lock lock(m);
              cv.wait_for(lock, st, limit, [] { return false; });
              if (st.stop_requested()) return;
              std::fprintf(stderr, "watchdog: '%s' did not finish within %lld s\n", what,
                           static_cast<long long>(limit.count()));
              where_each_thread_waits();
              std::abort();
          }) {}

    // Before the abort, where it hangs: each thread's system call and kernel stack (readable
    // as root, as in the VM), and its user stack when gdb is installed (bounded: 60 s).
    static void where_each_thread_waits() noexcept {
        const std::string self = std::to_string(::getpid());
        std::error_code ec;
        for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
            for (const char* file : {"comm", "status", "wchan", "syscall", "stack"}) {
                std::ifstream in(t.path() / file);
                std::string text((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
                if (std::string_view(file) == "status") // its state line only
                    text = text.substr(0, text.find("\nTgid"));
                std::fprintf(stderr, "watchdog: task %s %s: %s\n", t.path().filename().c_str(),
                             file, text.c_str());
            }
        }
        if (::access("/usr/bin/gdb", X_OK) == 0) {
            // Bounded: a gdb that cannot attach must not keep the abort from coming.
            const std::string cmd = "timeout -s KILL 60 /usr/bin/gdb -q -p " + self +
                                    " -batch -ex 'thread apply all bt' </dev/null 1>&2";
            [[maybe_unused]] const int rc = std::system(cmd.c_str());
        }
        std::fflush(stderr);
    }

  private:
    std::jthread thread_;
};

} // namespace rt
