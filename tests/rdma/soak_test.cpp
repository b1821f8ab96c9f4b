// The soak: at least a million requests through 8 QPs, 4 CQs and 2 channels (one in events
// mode, one hybrid, or busy: RINGVERBS_SOAK_SECOND) on a real device, with timeouts, stops, QP
// errors and teardowns mixed in and seeded random faults injected between the runtime and the
// device (chaos_hooks.hpp). Every request's await must end exactly once, every received byte must
// be the one sent, no hang (a watchdog prints what is pending), and every resource is released at
// the end.
//
//   RINGVERBS_SEED=<n>            reproduce a run (printed first, with the settings below)
//   RINGVERBS_SOAK_REQUESTS=<n>   how many requests (default 1,000,000)
//   RINGVERBS_FAULTS_JSON=<path>  where to write the summary (faults.json)
//   RINGVERBS_EVENT_READ=<path>   how both channels read their events: ring (default) or
//                                 syscall (channel_options::read)
//   RINGVERBS_SOAK_SECOND=<mode>  the second channel's polling mode: hybrid (default) or busy;
//                                 busy also runs a coroutine that polls the busy channel's CQs
//                                 itself (cq::try_next_batch, yield between): the busy pass
//                                 leaves a CQ it polled empty to it, so most of their
//                                 completions are dispatched by the consumer's poll
#include "chaos_hooks.hpp"
#include "fault_injection.hpp"
#include "rdma_fixture.hpp"

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/completion_error.hpp>
#include <ringverbs/rdma/device_events.hpp>

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

using namespace rt;
using namespace std::chrono_literals;

namespace {

constexpr int pairs = 4;            // 8 QPs
constexpr int streams_per_pair = 8; // concurrent exchanges on each pair
constexpr std::size_t msg = 64;
constexpr verbs::qp_caps caps{.max_send_wr = 64,
                              .max_recv_wr = 64,
                              .max_send_sge = 1,
                              .max_recv_sge = 1,
                              .max_inline_data = 0};
constexpr qp_options fast_bound{.flush_timeout = 50ms};

task<void> nap(io_context& io, std::chrono::microseconds d) {
    co_await sleep_for(io, d);
}

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != 0 ? std::strtoull(v, nullptr, 10) : fallback;
}

// QPs of this process the kernel's resource tracker knows (iproute2's `rdma`, one dump), or -1.
int one_dump_of_our_qps() {
    const std::string cmd = "rdma -j resource show qp 2>/dev/null";
    FILE* f = ::popen(cmd.c_str(), "r");
    if (f == nullptr) return -1;
    std::string out;
    char buf[4096];
    while (std::size_t n = std::fread(buf, 1, sizeof buf, f))
        out.append(buf, n);
    if (::pclose(f) != 0) return -1;
    const std::string key = "\"pid\":" + std::to_string(::getpid());
    int count = 0;
    for (std::size_t at = out.find(key); at != std::string::npos; at = out.find(key, at + 1)) {
        const char next = at + key.size() < out.size() ? out[at + key.size()] : '}';
        if (next == ',' || next == '}') ++count;
    }
    return count;
}

// As one_dump_of_our_qps(), read until two dumps in a row agree (5 at most): the kernel resumes
// a dump by position, so one taken while other processes (tests beside this one) make and
// destroy QPs may skip or repeat entries (tests/support/harness.py's restrack does the same).
int kernel_qps_of_this_process() {
    int last = one_dump_of_our_qps();
    for (int i = 0; i < 4 && last >= 0; ++i) {
        const int now = one_dump_of_our_qps();
        if (now == last) break;
        last = now;
    }
    return last;
}

struct tally {
    std::atomic<std::uint64_t> issued{0}; // posted requests (owed an end)
    std::atomic<std::uint64_t> ended{0};
    std::uint64_t duplicated = 0;
    std::uint64_t corrupted = 0;
    // A receive that got its message, right, while its send ended in error: the sender's QP
    // failed before the ACK came (legal for RC; seen on Linux 6.12, whose rxe sends from a
    // work queue, so that a send is still in flight when its QP fails).
    std::uint64_t delivered_unacknowledged = 0;
    // iWARP: a send that siw was transmitting when the test failed its QP ends with
    // IBV_WC_LOC_QP_OP_ERR instead of a flush (soak::cut_off_in_flight).
    std::uint64_t cut_off = 0;
    std::uint64_t ok = 0, flushed = 0, timed_out = 0, cancelled = 0, never_flushed = 0,
                  other_error = 0, not_posted = 0;
    std::vector<std::string> other_errors; // the first few, said in the log
    std::vector<std::uint8_t> seen;        // per request id: how many times it ended

    void other(std::string what) {
        if (other_error++ < 8) other_errors.push_back(std::move(what));
    }
    std::uint64_t next_id = 0;

    std::uint64_t open() {
        const std::uint64_t id = next_id++;
        if (id >= seen.size()) seen.resize(seen.size() * 2 + 1024);
        issued.fetch_add(1, std::memory_order_relaxed);
        return id;
    }
    void end(std::uint64_t id) {
        if (seen[id]++ != 0) ++duplicated;
        ended.fetch_add(1, std::memory_order_relaxed);
    }
};

// How an epoch of a pair ends.
enum class action { calm, stop, peer_error, timeout, teardown };

struct pair_state {
    int index = 0;
    cq* cq_a = nullptr;
    cq* cq_b = nullptr;
    std::unique_ptr<qp> a, b;
    pair_link link; // on iWARP the connection (reset before the QPs are)
    std::unique_ptr<region> out, in, spare;
    std::stop_source stop;
    bool over = false; // the epoch ends: streams start no new exchange
    int running = 0;   // streams of this epoch still running
    std::uint32_t seq = 0;
    std::uint64_t exchanges = 0;   // started on this pair
    std::optional<action> trigger; // the fault the next stream to post sets off
    bool failed_by_test = false;   // this epoch's QPs were made to leave RTS (strike, errors)
    int probes = 0;                // timeout probes still running
    const char* where = "";        // what run_pair waits for (for the hang report)
    int standing = 0; // standing receives on a (nobody sends to a: they end only by a fault)
    std::uint32_t next_spare = 0;
    std::vector<std::uint32_t> forget_later; // hidden QPs torn down: forgotten once all ended
    std::string log[8];                      // the last actions, for the hang report
    int logged = 0;
    void note(std::string what) { log[logged++ % 8] = std::move(what); }
};

class soak {
  public:
    soak(device& d, io_context& io, std::uint64_t seed, std::uint64_t target)
        : dev_(d), io_(io), rng_(seed), target_(target) {}

    tally t;

    task<void> run_pair(pair_state& p) {
        while (t.issued.load() < target_) {
            const int epoch_len = std::uniform_int_distribution<int>(100, 1500)(rng_); // exchanges
            const int roll = std::uniform_int_distribution<int>(0, 99)(rng_);
            const action what = roll < 20   ? action::calm
                                : roll < 40 ? action::stop
                                : roll < 60 ? action::peer_error
                                : roll < 80 ? action::timeout
                                            : action::teardown;
            p.over = false;
            p.failed_by_test = false;
            p.stop = std::stop_source();
            p.running = streams_per_pair;
            p.trigger.reset();
            const std::uint64_t until = p.exchanges + static_cast<std::uint64_t>(epoch_len);
            for (int s = 0; s < streams_per_pair; ++s)
                io_.spawn(stream(p, s));
            // Receives that wait for a fault: the requests in flight when it strikes (rxe
            // completes a loopback exchange inside ibv_post_send, so the streams' own are
            // rarely still outstanding).
            for (int k = 0; k < 4 && p.standing < 16; ++k) {
                ++p.standing;
                io_.spawn(standing(p));
            }
            p.where = "epoch running";
            while (p.running > 0 && p.exchanges < until && t.issued.load() < target_)
                co_await sleep_for(io_, 1ms);
            p.note("epoch end, action " + std::to_string(static_cast<int>(what)) + " at " +
                   std::to_string(t.issued.load()));
            const bool failed = p.over; // a stream met an error (its QP is in the error state)
            if (what == action::calm && !failed) {
                // A calm end: the streams finish their exchanges, the QPs stay connected.
                p.over = true;
                p.where = "calm end: streams finishing";
                while (p.running > 0)
                    co_await sleep_for(io_, 1ms);
                continue;
            }
            // The fault is set off by the next stream that posts (so that requests are in
            // flight when it strikes), or here when every stream is done already.
            if (p.running > 0 && !failed) {
                p.trigger = what;
                p.where = "waiting for a stream to strike";
                while (p.trigger && p.running > 0)
                    co_await sleep_for(io_, 1ms);
            }
            if (p.trigger || failed) {
                p.trigger.reset();
                strike(p, what);
            }
            p.where = "streams and probes finishing";
            while (p.running > 0 || p.probes > 0)
                co_await sleep_for(io_, 1ms);
            if (!p.a) { // torn down: new QPs once the old ones owe nothing
                p.where = "torn down: standing receives ending";
                while (p.standing > 0)
                    co_await sleep_for(io_, 1ms);
                for (std::uint32_t q : p.forget_later)
                    chaos_hooks::forget(q);
                p.forget_later.clear();
                make_qps(p);
                continue;
            }
            // Both sides to error (a peer left in RTS would retry sends into a dead QP); wait
            // for the flushes (or the bound) before resetting: nothing may be owed.
            to_error_unless_reset(*p.a);
            to_error_unless_reset(*p.b);
            p.where = "waiting for the flushes";
            while (p.a->pending() + p.b->pending() > 0 || p.standing > 0)
                co_await sleep_for(io_, 1ms);
            chaos_hooks::forget(p.a->qp_num());
            chaos_hooks::forget(p.b->qp_num());
            reset_and_connect(p);
            if (chance(0.3)) {
                p.where = "failing chain";
                co_await failing_chain(p);
                reset_and_connect(p);
            }
        }
        // The standing receives of calm epochs end with the QP's last error.
        to_error_unless_reset(*p.a);
        p.where = "last standing receives";
        while (p.standing > 0)
            co_await sleep_for(io_, 1ms);
    }

    task<void> standing(pair_state& p) {
        const std::size_t slot = 1 + (p.next_spare++ % 31);
        auto r = p.a->recv(p.spare->local(slot * msg, msg), wait_options(p.stop.get_token()));
        try {
            r.post();
        } catch (const std::system_error&) {
            ++t.not_posted;
            --p.standing;
            co_return;
        }
        const std::uint64_t id = t.open();
        try {
            co_await r;
            t.other("a standing receive succeeded, where nobody sends"); // on a
        } catch (...) {
            classify(std::current_exception(), "a standing receive");
        }
        t.end(id);
        --p.standing;
    }

    // The fault of an epoch's end, with the streams' requests in flight.
    void strike(pair_state& p, action what) {
        p.over = true;
        p.failed_by_test = true;
        switch (what) {
        case action::calm:
        case action::stop:
            p.stop.request_stop(); // pending awaits: operation_canceled after the flush
            break;
        case action::peer_error:
            if (chance(0.5)) chaos_hooks::hide_flushes_of(p.a->qp_num());
            to_error_unless_reset(*p.a); // every request flushed (or never: the bound ends it)
            break;
        case action::timeout:
            // A receive on a, where nobody sends: its timeout moves a to the error state
            // under the streams' feet.
            ++p.probes;
            io_.spawn(timeout_probe(p));
            break;
        case action::teardown: {
            // Destroyed with requests in flight: ~qp returns at once, the states live on
            // until every await of theirs ended (by flush, or by the bound when hidden).
            if (chance(0.5)) chaos_hooks::hide_flushes_of(p.a->qp_num());
            const std::uint32_t qa = p.a->qp_num(), qb = p.b->qp_num();
            p.a.reset();
            p.b.reset();
            p.forget_later.push_back(qa);
            p.forget_later.push_back(qb);
            break;
        }
        }
    }

    task<void> timeout_probe(pair_state& p) {
        auto r = p.a->recv(p.spare->local(0, msg), wait_options(200us));
        try {
            r.post(); // the 200 us count from the co_await
        } catch (const std::system_error&) {
            ++t.not_posted; // an injected post_failed: nothing posted, nothing owed
            --p.probes;
            co_return;
        }
        const std::uint64_t id = t.open();
        try {
            co_await r;
            t.other("a timeout probe's receive succeeded, where nobody sends");
        } catch (...) {
            classify(std::current_exception(), "a timeout probe");
        }
        t.end(id);
        --p.probes;
    }

    // A chain of 3 receives whose post fails after its first k: ENOMEM, nothing owed after.
    task<void> failing_chain(pair_state& p) {
        ibv_sge sge[3];
        ibv_recv_wr wr[3]{};
        for (int i = 0; i < 3; ++i) {
            auto b = p.in->local(static_cast<std::size_t>(i) * msg, msg);
            sge[i] = {reinterpret_cast<std::uintptr_t>(b.addr), b.length, b.lkey};
            wr[i].sg_list = &sge[i];
            wr[i].num_sge = 1;
            wr[i].next = i < 2 ? &wr[i + 1] : nullptr;
        }
        chaos_hooks::fail_next_chain_at(std::uniform_int_distribution<int>(1, 2)(rng_));
        const std::uint64_t id = t.open();
        try {
            co_await p.b->post_recv(wr[0]);
            t.other("a receive chain cut at its k-th request succeeded");
        } catch (const std::system_error& e) {
            if (e.code().value() == ENOMEM)
                ++t.not_posted;
            else
                t.other(std::string("a receive chain cut at its k-th request: ") + e.what());
        }
        t.end(id);
        if (p.b->pending() != 0) t.other("a receive chain cut at its k-th request left some owed");
    }

    // A QP the bounded flush moved to RESET stays there (rxe refuses RESET -> ERR: EINVAL).
    // siw reports no state (always RESET) and takes ERR from any state.
    static void to_error_unless_reset(qp& q) {
        if (!device_reports_qp_state() || q.native_qp().state() != IBV_QPS_RESET) q.to_error();
    }

    // A stream's exchange failed: both QPs to error, so that every request of the epoch ends
    // by its flush (a torn-down pair's states flush on their own).
    static void end_epoch_on_both(pair_state& p) {
        p.failed_by_test = true;
        if (p.a) to_error_unless_reset(*p.a);
        if (p.b) to_error_unless_reset(*p.b);
    }

    void make_qps(pair_state& p) {
        p.a = std::make_unique<qp>(dev_.pd, *p.cq_a, *p.cq_a, caps, fast_bound);
        p.b = std::make_unique<qp>(dev_.pd, *p.cq_b, *p.cq_b, caps, fast_bound);
        connect(p);
    }
    void reset_and_connect(pair_state& p) {
        p.link.reset(); // iWARP: the old connection ends before its QPs are reset
        if (rdma_device().iwarp) {
            // An iWARP QP is connected once: its CM refuses it again (rdma_accept: EINVAL).
            make_qps(p);
            return;
        }
        p.a->native_qp().reset();
        p.b->native_qp().reset();
        connect(p);
    }
    static void connect(pair_state& p) {
        p.link = connect_pair(p.a->native_qp(), p.b->native_qp(), all_remote);
    }

  private:
    bool chance(double prob) { return std::uniform_real_distribution<double>(0, 1)(rng_) < prob; }

    void classify(const std::exception_ptr& e, const char* what) {
        try {
            std::rethrow_exception(e);
        } catch (const completion_error& ce) {
            if (ce.status() == IBV_WC_WR_FLUSH_ERR)
                ++t.flushed;
            else
                t.other(std::string(what) + ": " + ce.what());
        } catch (const std::system_error& se) {
            switch (se.code().value()) {
            case ETIMEDOUT:
                ++t.timed_out;
                break;
            case ECANCELED:
                ++t.cancelled;
                break;
            case EIO:
                ++t.never_flushed;
                break;
            default:
                t.other(std::string(what) + ": " + se.what());
                break;
            }
        } catch (const std::exception& x) {
            t.other(std::string(what) + ": " + x.what());
        } catch (...) {
            t.other(std::string(what) + ": an unknown exception");
        }
    }

    // iWARP: siw completes the send it is transmitting when its QP leaves RTS with
    // IBV_WC_LOC_QP_OP_ERR, not a flush (siw_qp_sq_process: a whole DDP segment went out,
    // then tx_suspend), and its message may have reached b. The request still ends once, by
    // its own completion; it is legal where the test failed the QP (strike, or another
    // exchange's error), and an other error anywhere else.
    bool cut_off_in_flight(const pair_state& p, const std::exception_ptr& e) {
        if (!rdma_device().iwarp || !p.failed_by_test) return false;
        try {
            std::rethrow_exception(e);
        } catch (const completion_error& ce) {
            if (ce.status() != IBV_WC_LOC_QP_OP_ERR) return false;
            ++t.cut_off;
            return true;
        } catch (...) {
        }
        return false;
    }

    // One stream: receive on b, send on a, both awaited, the bytes checked. The receive is
    // posted first and the send right after (no suspension between), so the n-th send of
    // the pair lands in the n-th receive: its own.
    task<void> stream(pair_state& p, int s) {
        const std::size_t off = static_cast<std::size_t>(s) * msg;
        while (!p.over && t.issued.load() < target_) {
            const std::uint32_t seq = ++p.seq;
            ++p.exchanges;
            auto out = std::span(p.out->bytes).subspan(off, msg);
            std::memcpy(out.data(), &seq, sizeof seq);
            fill(out.subspan(sizeof seq), seq);
            std::memset(p.in->bytes.data() + off, 0, msg);
            auto r = p.b->recv(p.in->local(off, msg), wait_options(p.stop.get_token()));
            bool posted = true;
            try {
                r.post();
            } catch (const std::system_error&) {
                ++t.not_posted; // nothing posted, nothing owed
                posted = false;
            }
            if (!posted) {
                // The epoch ends, as for a refused send: a QP the runtime reset refuses every
                // post, and the stream whose failure would end the epoch may still be queued
                // to resume behind this one, which would spin here without ever suspending.
                p.over = true;
                end_epoch_on_both(p);
                continue;
            }
            const std::uint64_t rid = t.open();
            auto snd = p.a->send(p.out->local(off, msg), {}, wait_options(p.stop.get_token()));
            bool send_posted = true;
            std::uint64_t sid = 0;
            try {
                snd.post();
                sid = t.open();
            } catch (const std::system_error&) {
                ++t.not_posted;
                send_posted = false;
                // Our receive has no send: end the epoch so that it is flushed instead of
                // taking another stream's message.
                p.over = true;
                end_epoch_on_both(p);
            }
            if (send_posted && p.trigger) {
                const action what = *p.trigger;
                p.trigger.reset();
                strike(p, what); // with this exchange (and maybe others) in flight
            }
            bool send_ok = false;
            if (send_posted) {
                try {
                    ibv_wc swc = co_await snd;
                    send_ok = swc.status == IBV_WC_SUCCESS;
                    ++t.ok;
                } catch (...) {
                    if (!cut_off_in_flight(p, std::current_exception()))
                        classify(std::current_exception(), "a stream's send");
                    p.over = true; // the connection failed: this epoch is over
                    // Its message may never reach b (Linux 6.12's rxe still had it queued when
                    // a failed): b's receive would wait for ever; b's flush ends it. And a
                    // goes too: rxe retries a send for ever (retry_cnt 7) into a b in error.
                    end_epoch_on_both(p);
                }
                t.end(sid);
            }
            try {
                ibv_wc rwc = co_await r;
                ++t.ok;
                std::uint32_t got = 0;
                std::memcpy(&got, p.in->bytes.data() + off, sizeof got);
                std::vector<std::byte> want(msg);
                std::memcpy(want.data(), &seq, sizeof seq);
                fill(std::span(want).subspan(sizeof seq), seq);
                if (rwc.byte_len != msg ||
                    std::memcmp(want.data(), p.in->bytes.data() + off, msg) != 0)
                    ++t.corrupted;
                else if (!send_ok)
                    ++t.delivered_unacknowledged;
            } catch (...) {
                classify(std::current_exception(), "a stream's receive");
                p.over = true;
            }
            t.end(rid);
        }
        --p.running;
    }

    device& dev_;
    io_context& io_;
    std::mt19937_64 rng_;
    std::uint64_t target_;
};

} // namespace

namespace {
// The library's diagnostics during the soak (QP resets when flushes never came, ...): counted,
// the first few kept for the log, instead of a line each on stderr.
std::atomic<std::uint64_t> diagnostics_seen{0};
char first_diagnostics[3][256];

void count_diagnostic(std::string_view message) noexcept {
    const std::uint64_t n = diagnostics_seen.fetch_add(1);
    if (n < std::size(first_diagnostics)) {
        const std::size_t len = std::min(message.size(), sizeof first_diagnostics[n] - 1);
        std::memcpy(first_diagnostics[n], message.data(), len);
        first_diagnostics[n][len] = 0;
    }
}
} // namespace

TEST_CASE("soak: a million requests under timeouts, stops, QP errors, teardowns and injected "
          "faults: every await ends exactly once, every byte is right, nothing leaks") {
    const std::uint64_t seed = env_u64("RINGVERBS_SEED", std::random_device{}());
    const std::uint64_t target = env_u64("RINGVERBS_SOAK_REQUESTS", 1'000'000);
    const char* path_env = std::getenv("RINGVERBS_EVENT_READ");
    const std::optional<event_read> path =
        parse_event_read(path_env != nullptr && *path_env != 0 ? path_env : "ring");
    REQUIRE_MESSAGE(path.has_value(), "RINGVERBS_EVENT_READ is ring or syscall");
    const char* second_env = std::getenv("RINGVERBS_SOAK_SECOND");
    const std::optional<polling_mode> second_mode =
        parse_polling_mode(second_env != nullptr && *second_env != 0 ? second_env : "hybrid");
    REQUIRE_MESSAGE((second_mode == polling_mode::hybrid || second_mode == polling_mode::busy),
                    "RINGVERBS_SOAK_SECOND is hybrid or busy");
    std::printf("soak: events read by the %s path; the second channel %s\n", to_string(*path),
                to_string(*second_mode));
    // The whole setting, so that the line reproduces this run, not the default one.
    char reproduce[200];
    std::snprintf(reproduce, sizeof reproduce,
                  "RINGVERBS_SEED=%llu RINGVERBS_EVENT_READ=%s RINGVERBS_SOAK_SECOND=%s "
                  "RINGVERBS_SOAK_REQUESTS=%llu",
                  static_cast<unsigned long long>(seed), to_string(*path), to_string(*second_mode),
                  static_cast<unsigned long long>(target));
    std::printf("soak: seed %llu, %llu requests (%s reproduces it)\n",
                static_cast<unsigned long long>(seed), static_cast<unsigned long long>(target),
                reproduce);
    std::fflush(stdout);
    const int qps_before = kernel_qps_of_this_process();
    int qps_during = -1;
    std::uint64_t sq_full = 0, cq_overflows = 0, hangs = 0;
    chaos_counts injected;
    std::uint64_t issued = 0, ended = 0, duplicated = 0, corrupted = 0,
                  delivered_unacknowledged = 0, cut_off = 0;
    std::vector<std::string> other_errors;
    std::uint64_t ok = 0, flushed = 0, timed_out = 0, cancelled = 0, never_flushed = 0,
                  other_error = 0, not_posted = 0;
    std::vector<ibv_wc> held_at_end;
    std::uint64_t consumer_polls = 0, consumer_took = 0; // busy: the try_next poller's
    const diagnostics_sink default_sink = set_diagnostics_sink(&count_diagnostic);
    {
        device dev;
        // Small rings: the submission ring fills up, timer bursts overflow the completion ring.
        io_context io(io_context_options{.sq_entries = 8, .cq_entries = 16});
        channel events(io, dev.ctx, channel_options{.mode = polling_mode::events, .read = *path});
        channel second(
            io, dev.ctx,
            channel_options{
                .priority = 1, .mode = *second_mode, .hybrid_spin = 20us, .read = *path});
        REQUIRE(events.event_path() == *path);
        REQUIRE(second.mode() == *second_mode);
        if (*second_mode == polling_mode::hybrid) REQUIRE(second.event_path() == *path);
        cq c0(events), c1(events), c2(second), c3(second); // busy: c2 and c3 arm nothing
        cq* cqs[] = {&c0, &c1, &c2, &c3};
        soak s(dev, io, seed, target);
        std::vector<std::unique_ptr<pair_state>> ps;
        for (int i = 0; i < pairs; ++i) {
            auto p = std::make_unique<pair_state>();
            p->index = i;
            p->cq_a = cqs[i];
            p->cq_b = cqs[(i + 1) % 4]; // each pair spans the two channels or two CQs of one
            p->out = std::make_unique<region>(dev.pd, streams_per_pair * msg);
            p->in = std::make_unique<region>(dev.pd, streams_per_pair * msg);
            p->spare = std::make_unique<region>(dev.pd, 32 * msg);
            s.make_qps(*p);
            ps.push_back(std::move(p));
        }
        qps_during = kernel_qps_of_this_process();
        // A user of the runtime watches the device's async events: a QP that fails on its own
        // (QP_FATAL) is moved to error and bounded like any other.
        device_events async(io, dev.ctx);
        std::vector<std::string> async_log;
        chaos_hooks chaos(seed);

        // Watchdog: no request ended for 30 s is a hang: say what is pending, then fail.
        std::atomic<bool> done{false};
        std::jthread watchdog([&] {
            std::uint64_t last = 0;
            auto last_change = std::chrono::steady_clock::now();
            while (!done.load()) {
                std::this_thread::sleep_for(200ms);
                const std::uint64_t e = s.t.ended.load();
                if (e != last) {
                    last = e;
                    last_change = std::chrono::steady_clock::now();
                } else if (std::chrono::steady_clock::now() - last_change > 30s) {
                    std::fprintf(stderr,
                                 "soak: HANG (%s): %llu requests posted, %llu ended; "
                                 "no progress for 30 s\n",
                                 reproduce, static_cast<unsigned long long>(s.t.issued.load()),
                                 static_cast<unsigned long long>(e));
                    // Read from another thread while the loop is stuck: good enough to say
                    // where it is stuck.
                    auto state_of = [](std::unique_ptr<qp>& q) -> int {
                        if (!q) return -1;
                        try {
                            return static_cast<int>(q->native_qp().state());
                        } catch (...) {
                            return -2;
                        }
                    };
                    for (auto& p : ps)
                        std::fprintf(stderr,
                                     "soak:   pair %d: qp a %s pending %zu state %d, qp b %s "
                                     "pending %zu state %d, %d streams running, %d standing, "
                                     "%d probes, epoch over %d\n",
                                     p->index, p->a ? "live" : "gone", p->a ? p->a->pending() : 0,
                                     state_of(p->a), p->b ? "live" : "gone",
                                     p->b ? p->b->pending() : 0, state_of(p->b), p->running,
                                     p->standing, p->probes, int(p->over));
                    for (auto& p : ps)
                        std::fprintf(stderr, "soak:   pair %d: %s\n", p->index, p->where);
                    // What the CQs still hold (taken: the run is over anyway).
                    for (int i = 0; i < 4; ++i) {
                        ibv_wc wc[64];
                        const int n = ibv_poll_cq(cqs[i]->native(), 64, wc);
                        std::fprintf(stderr, "soak:   cq %d still holds %d completions", i, n);
                        for (int k = 0; k < n && k < 4; ++k)
                            std::fprintf(stderr, " [qp %u %s]", wc[k].qp_num,
                                         ibv_wc_status_str(wc[k].status));
                        std::fprintf(stderr, "; buffered %zu, events %llu arms %llu\n",
                                     cqs[i]->buffered(),
                                     (unsigned long long)cqs[i]->counters().events,
                                     (unsigned long long)cqs[i]->counters().arms);
                    }
                    for (auto& p : ps)
                        for (int k = 0; k < 8; ++k)
                            if (!p->log[k].empty())
                                std::fprintf(stderr, "soak:   pair %d log: %s\n", p->index,
                                             p->log[k].c_str());
                    for (auto& line : async_log)
                        std::fprintf(stderr, "soak:   async event: %s\n", line.c_str());
                    std::fprintf(stderr,
                                 "soak:   completions held by faults: %zu; io waiters %zu, "
                                 "in flight %zu; channels: events armed/fired %llu/%llu, "
                                 "%s %llu/%llu, spin %d\n",
                                 chaos_hooks::held(), io.waiters(), io.operations_in_flight(),
                                 (unsigned long long)events.counters().arms,
                                 (unsigned long long)events.counters().events,
                                 to_string(*second_mode),
                                 (unsigned long long)second.counters().arms,
                                 (unsigned long long)second.counters().events, 0);
                    // Where each thread is (its kernel stack; gdb's backtraces, bounded).
                    watchdog::where_each_thread_waits();
                    std::abort();
                }
            }
        });
        // Bursts of short timers, more than the 16-entry completion ring holds.
        bool finished = false;
        auto bursts = [&]() -> task<void> {
            while (!finished) {
                std::vector<task<void>> timers;
                for (int i = 0; i < 48; ++i)
                    timers.push_back(nap(io, 200us));
                co_await when_all(std::move(timers));
                co_await sleep_for(io, 5ms);
            }
        };
        auto all_pairs = [&]() -> task<void> {
            std::vector<task<void>> runs;
            for (auto& p : ps)
                runs.push_back(s.run_pair(*p));
            co_await when_all(std::move(runs));
            finished = true;
        };
        auto watch_async = [&]() -> task<void> {
            while (!finished) {
                try {
                    async_event e = co_await async.next(wait_options(20ms));
                    async_log.push_back(std::string(e.name()) + " qp " + std::to_string(e.qp_num) +
                                        (e.routed ? " (routed)" : ""));
                } catch (const std::system_error&) {
                }
            }
        };
        // Busy: the second channel's CQs polled by a coroutine of the user's (try_next), as a
        // busy-polling consumer does (the pass polls them too, whenever the consumer's last
        // poll left completions behind). Every completion there belongs to a per-request
        // await, so it takes none itself (consumer_took stays 0) and only dispatches them.
        auto consumer = [&]() -> task<void> {
            ibv_wc wcs[8];
            while (!finished) {
                for (cq* c : {&c2, &c3}) {
                    try {
                        consumer_took += c->try_next_batch(wcs);
                        ++consumer_polls;
                    } catch (const std::system_error& e) {
                        s.t.other(std::string("try_next_batch: ") + e.what());
                    }
                }
                co_await io.yield();
            }
        };
        io.spawn(watch_async());
        io.spawn(bursts());
        if (*second_mode == polling_mode::busy) io.spawn(consumer());
        try {
            io.run(all_pairs());
        } catch (const std::exception& e) {
            finished = true;
            FAIL_CHECK("soak: the run threw (seed " << seed << "): " << std::string(e.what()));
        }
        io.run(); // the bursts' last round, flush timers still in flight
        done = true;
        chaos_hooks::enable(false);

        sq_full = io.counters().sq_full;
        cq_overflows = io.counters().cq_overflows;
        injected = chaos_hooks::counts();
        held_at_end = chaos_hooks::held_completions();
        issued = s.t.issued.load();
        ended = s.t.ended.load();
        duplicated = s.t.duplicated;
        corrupted = s.t.corrupted;
        delivered_unacknowledged = s.t.delivered_unacknowledged;
        cut_off = s.t.cut_off;
        other_errors = s.t.other_errors;
        ok = s.t.ok, flushed = s.t.flushed, timed_out = s.t.timed_out;
        cancelled = s.t.cancelled, never_flushed = s.t.never_flushed;
        other_error = s.t.other_error, not_posted = s.t.not_posted;
        for (auto& p : ps) {
            CHECK(p->a->pending() == 0);
            CHECK(p->b->pending() == 0);
        }
        ps.clear();
        for (int i = 0; i < 1000 && io.waiters() > 0; ++i)
            io.run_once(false);
        CHECK(io.waiters() == 0);
    }
    set_diagnostics_sink(default_sink);
    const int qps_after = kernel_qps_of_this_process();
    const std::uint64_t lost = issued - ended;
    const std::uint64_t diagnostics = diagnostics_seen.load();
    std::printf("soak: %llu diagnostics from the library (sink), the first ones:\n",
                static_cast<unsigned long long>(diagnostics));
    for (std::uint64_t i = 0;
         i < std::min<std::uint64_t>(diagnostics, std::size(first_diagnostics)); ++i)
        std::printf("soak:   %s\n", first_diagnostics[i]);
    std::printf("soak: %llu requests: %llu ok, %llu flushed, %llu timed out, %llu cancelled, "
                "%llu never flushed, %llu sends cut off in flight, %llu other errors, %llu posts "
                "refused; lost %llu, duplicated %llu, corrupted %llu; delivered but the send "
                "failed %llu\n",
                (unsigned long long)issued, (unsigned long long)ok, (unsigned long long)flushed,
                (unsigned long long)timed_out, (unsigned long long)cancelled,
                (unsigned long long)never_flushed, (unsigned long long)cut_off,
                (unsigned long long)other_error, (unsigned long long)not_posted,
                (unsigned long long)lost, (unsigned long long)duplicated,
                (unsigned long long)corrupted, (unsigned long long)delivered_unacknowledged);
    for (const std::string& e : other_errors)
        std::printf("soak:   other error: %s\n", e.c_str());
    for (const ibv_wc& wc : held_at_end)
        std::printf("soak:   held by a fault at the end: qp %u, %s, wr_id %#llx\n", wc.qp_num,
                    ibv_wc_status_str(wc.status), static_cast<unsigned long long>(wc.wr_id));
    const std::pair<const char*, std::uint64_t> kinds[] = {
        {"flush_hidden", injected.flush_hidden},
        {"flush_delayed", injected.flush_delayed},
        {"arm_race", injected.arm_race},
        {"spurious_event", injected.spurious_event},
        {"notify_failed", injected.notify_failed},
        {"get_event_eintr", injected.get_event_eintr},
        {"post_failed", injected.post_failed},
        {"chain_failed", injected.chain_failed},
        {"sq_full", sq_full},
        {"cq_overflow", cq_overflows},
    };
    std::string json = "{\"requests\": " + std::to_string(issued) + ", \"event_read\": \"" +
                       to_string(*path) + "\", \"second_channel\": \"" + to_string(*second_mode) +
                       "\", \"injected\": {";
    for (std::size_t i = 0; i < std::size(kinds); ++i) {
        json += (i ? ", \"" : "\"") + std::string(kinds[i].first) +
                "\": " + std::to_string(kinds[i].second);
        std::printf("soak: injected %-16s %llu\n", kinds[i].first,
                    (unsigned long long)kinds[i].second);
    }
    json += "}, \"lost\": " + std::to_string(lost) +
            ", \"duplicated\": " + std::to_string(duplicated) +
            ", \"corrupted\": " + std::to_string(corrupted) +
            ", \"delivered_unacknowledged\": " + std::to_string(delivered_unacknowledged) +
            ", \"cut_off_in_flight\": " + std::to_string(cut_off) +
            ", \"hangs\": " + std::to_string(hangs) + ", \"seed\": " + std::to_string(seed) +
            ", \"try_next_polls\": " + std::to_string(consumer_polls) +
            ", \"kernel_qps_before\": " + std::to_string(qps_before) +
            ", \"kernel_qps_during\": " + std::to_string(qps_during) +
            ", \"kernel_qps_after\": " + std::to_string(qps_after) +
            ", \"diagnostics\": " + std::to_string(diagnostics) + "}\n";
    if (const char* path = std::getenv("RINGVERBS_FAULTS_JSON"); path != nullptr && *path != 0) {
        // The folder may not exist yet (a fresh build: the benchmarks make it later).
        std::error_code ec;
        std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
        std::ofstream out(path);
        out << json;
        out.close();
        CHECK_MESSAGE(out.good(), "could not write " << path);
        std::printf("soak: wrote %s\n", path);
    }
    std::fputs(json.c_str(), stdout);
    CHECK(issued >= target);
    CHECK(lost == 0);
    CHECK(duplicated == 0);
    CHECK(corrupted == 0);
    CHECK(other_error == 0);
    CHECK(held_at_end.size() == 0);
    CHECK(consumer_took == 0);
    if (*second_mode == polling_mode::busy) CHECK(consumer_polls > 0);
    for (std::size_t i = 0; i < std::size(kinds); ++i) {
        CAPTURE(kinds[i].first);
        CHECK(kinds[i].second > 0);
    }
    // The kernel's own count (iproute2 `rdma`, when present) saw our 8 QPs, then none left.
    MESSAGE("kernel's QPs of this process: before " << qps_before << ", during " << qps_during
                                                    << ", after " << qps_after);
    if (qps_before >= 0 && qps_after >= 0) {
        CHECK(qps_during == qps_before + 2 * pairs);
        CHECK(qps_after == qps_before);
    }
}
