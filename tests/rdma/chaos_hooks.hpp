// chaos_hooks: seeded random faults between the runtime and the real device (through
// verbs::detail::verbs_hooks), each fair: it makes the device look like one that is slow, loses
// flushes or is interrupted, never like one that breaks the verbs contract. Loop thread only.
#pragma once

#include <ringverbs/verbs/detail/verbs_hooks.hpp>

#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace rt {

struct chaos_counts {
    std::uint64_t flush_hidden = 0;    // a flush that never comes (ended by the bounded flush)
    std::uint64_t flush_delayed = 0;   // a flush held back until the next poll of its CQ
    std::uint64_t arm_race = 0;        // completions already in the CQ when it was armed
    std::uint64_t spurious_event = 0;  // completions taken right after the arm: their event
                                       // then finds the CQ empty
    std::uint64_t notify_failed = 0;   // ibv_req_notify_cq failed with EAGAIN (not armed)
    std::uint64_t get_event_eintr = 0; // an event read interrupted (EINTR, nothing read):
                                       // ibv_get_cq_event, or a read queued on the ring
    std::uint64_t post_failed = 0;     // ibv_post_send/recv failed with ENOMEM, nothing posted
    std::uint64_t chain_failed = 0;    // a chain posted only up to its k-th request
};

class chaos_hooks {
  public:
    explicit chaos_hooks(std::uint64_t seed) {
        rng() = std::mt19937_64(seed);
        counts() = {};
        hidden().clear();
        stash().clear();
        reset_qps().clear();
        auto& h = ringverbs::verbs::detail::hooks();
        h.modify_qp = &modify_qp;
        h.poll_cq = &poll;
        h.req_notify_cq = &notify;
        h.get_cq_event = &get_event;
        h.start_event_read = &start_read;
        h.post_send = &post_send;
        h.post_recv = &post_recv;
    }
    ~chaos_hooks() {
        ringverbs::verbs::detail::hooks() = ringverbs::verbs::detail::real_verbs();
        stash().clear();
    }
    // Completions a fault still holds back (0 once the runtime polled them all).
    static std::size_t held() {
        std::size_t n = 0;
        for (auto& [cq, s] : stash())
            n += s.size();
        return n;
    }
    // The same, themselves (for the log: whose they are).
    static std::vector<ibv_wc> held_completions() {
        std::vector<ibv_wc> all;
        for (auto& [cq, s] : stash())
            all.insert(all.end(), s.begin(), s.end());
        return all;
    }
    chaos_hooks(const chaos_hooks&) = delete;
    chaos_hooks& operator=(const chaos_hooks&) = delete;

    static chaos_counts& counts() {
        static chaos_counts c;
        return c;
    }
    // Flushes of this QP are dropped from now on (until forget()).
    static void hide_flushes_of(std::uint32_t qp_num) { hidden().insert(qp_num); }
    static void forget(std::uint32_t qp_num) { hidden().erase(qp_num); }
    // The next ibv_post_recv of a chain posts its first k requests only, then fails.
    static void fail_next_chain_at(int k) { chain_cut() = k; }
    // Fault rates; 0 turns a kind off (e.g. while a test sets up).
    static void enable(bool on) { enabled() = on; }

  private:
    static std::mt19937_64& rng() {
        static std::mt19937_64 r;
        return r;
    }
    static bool& enabled() {
        static bool on = true;
        return on;
    }
    static std::set<std::uint32_t>& hidden() {
        static std::set<std::uint32_t> s;
        return s;
    }
    // QPs the runtime moved to RESET (and did not post to since). A device produces nothing
    // for a QP after RESET, and what it produced before is in the CQ, which the runtime polls
    // right after the reset: delaying a flush of such a QP past that poll would deliver a
    // completion after the reset, which no device does (the runtime has already ended the
    // request). So their completions are never delayed; what was delayed before the reset
    // is in the stash, handed out first by that poll.
    static std::set<std::uint32_t>& reset_qps() {
        static std::set<std::uint32_t> s;
        return s;
    }
    static std::map<ibv_cq*, std::vector<ibv_wc>>& stash() {
        static std::map<ibv_cq*, std::vector<ibv_wc>> m;
        return m;
    }
    static int& chain_cut() {
        static int k = 0;
        return k;
    }
    static bool chance(double p) {
        return enabled() && std::uniform_real_distribution<double>(0, 1)(rng()) < p;
    }
    static const ringverbs::verbs::detail::verbs_hooks& real() {
        return ringverbs::verbs::detail::real_verbs();
    }

    // Takes what the CQ holds now into its stash: the next poll hands it out first.
    static int take_into_stash(ibv_cq* cq) {
        ibv_wc wc[16];
        const int n = real().poll_cq(cq, 16, wc);
        if (n <= 0) return 0;
        auto& s = stash()[cq];
        s.insert(s.end(), wc, wc + n);
        return n;
    }

    static int poll(ibv_cq* cq, int n, ibv_wc* out) noexcept {
        int got = 0;
        // First what a fault held back (in the order the device gave it).
        if (auto it = stash().find(cq); it != stash().end() && !it->second.empty()) {
            auto& s = it->second;
            const int k = std::min<int>(n, static_cast<int>(s.size()));
            std::copy_n(s.begin(), k, out);
            s.erase(s.begin(), s.begin() + k);
            got = k;
            if (got == n) return got;
        }
        std::vector<ibv_wc> delayed;
        std::set<std::uint32_t> delaying; // QPs with a delayed flush: the rest of theirs waits too
        for (;;) {
            const int want = n - got;
            const int r = real().poll_cq(cq, want, out + got);
            if (r < 0) return got > 0 ? got : r;
            int kept = got;
            for (int i = got; i < got + r; ++i) {
                const ibv_wc& wc = out[i];
                if (wc.status == IBV_WC_WR_FLUSH_ERR && hidden().count(wc.qp_num) != 0) {
                    ++counts().flush_hidden;
                } else if (delaying.count(wc.qp_num) != 0) {
                    delayed.push_back(wc); // a queue completes in order: keep it so
                } else if (wc.status == IBV_WC_WR_FLUSH_ERR && reset_qps().count(wc.qp_num) == 0 &&
                           chance(0.2)) {
                    ++counts().flush_delayed;
                    delaying.insert(wc.qp_num);
                    delayed.push_back(wc);
                } else {
                    out[kept++] = wc;
                }
            }
            got = kept;
            // A short real batch means the CQ is empty: stop, as the caller will.
            if (r < want || got == n) break;
        }
        // A delayed flush waits for the next poll of this CQ. If the caller stops polling
        // now, only a later event or the bounded flush's own poll of the CQ brings it: the
        // runtime must not rely on anything else. (Order among one QP's completions is kept:
        // all of its later ones in this call were delayed with it.)
        if (!delayed.empty()) {
            auto& s = stash()[cq];
            s.insert(s.end(), delayed.begin(), delayed.end());
        }
        return got;
    }

    static int notify(ibv_cq* cq, int solicited_only) noexcept {
        if (chance(0.01)) {
            ++counts().notify_failed;
            return EAGAIN; // not armed
        }
        // The arm race: completions already in the CQ when it is armed raise no event; the
        // runtime finds them only because it polls after arming.
        if (chance(0.03) && take_into_stash(cq) > 0) ++counts().arm_race;
        const int rc = real().req_notify_cq(cq, solicited_only);
        if (rc != 0) return rc;
        // Spurious: completions taken right after the arm raised an event that will find the
        // CQ empty (they are handed out by the runtime's poll after arming).
        if (chance(0.03) && take_into_stash(cq) > 0) ++counts().spurious_event;
        return 0;
    }

    static int get_event(ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept {
        if (chance(0.02)) {
            ++counts().get_event_eintr;
            errno = EINTR;
            return -1;
        }
        return real().get_cq_event(ch, cq, ctx);
    }

    static int start_read(ibv_comp_channel* ch) noexcept {
        if (chance(0.02)) {
            ++counts().get_event_eintr;
            return -EINTR;
        }
        return real().start_event_read(ch);
    }

    static int modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) noexcept {
        const int rc = real().modify_qp(qp, attr, mask);
        if (rc == 0 && (mask & IBV_QP_STATE) != 0) {
            if (attr->qp_state == IBV_QPS_RESET)
                reset_qps().insert(qp->qp_num);
            else
                reset_qps().erase(qp->qp_num);
        }
        return rc;
    }

    static int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
        reset_qps().erase(qp->qp_num); // connected again (a reset QP refuses posts)
        if (wr->next == nullptr && chance(0.0001)) {
            ++counts().post_failed;
            *bad = wr;
            return ENOMEM;
        }
        return real().post_send(qp, wr, bad);
    }

    static int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
        reset_qps().erase(qp->qp_num);
        if (wr->next != nullptr && chain_cut() > 0) {
            const int k = std::exchange(chain_cut(), 0);
            ibv_recv_wr* cut = wr;
            for (int i = 1; i < k && cut->next; ++i)
                cut = cut->next;
            if (cut->next != nullptr) {
                ibv_recv_wr* rest = cut->next;
                cut->next = nullptr;
                const int rc = real().post_recv(qp, wr, bad);
                cut->next = rest;
                if (rc != 0) return rc;
                ++counts().chain_failed;
                *bad = rest;
                return ENOMEM;
            }
        }
        if (wr->next == nullptr && chance(0.0001)) {
            ++counts().post_failed;
            *bad = wr;
            return ENOMEM;
        }
        return real().post_recv(qp, wr, bad);
    }
};

} // namespace rt
