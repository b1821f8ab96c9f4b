// detail::blocking_connect: rdma_connect on iWARP, on a thread of its own (see below). Shared by
// cm_channel.cpp (an id's state ends it) and cm_id.cpp (the connect step starts it, migration
// moves it). Private to src/cm/.
#pragma once

#include <ringverbs/cm/detail/cm_hooks.hpp>
#include <ringverbs/cm/detail/cm_state.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace ringverbs::detail {

// rdma_connect on iWARP, on a thread of its own. siw's connect (Linux 6.1, siw_connect) makes
// its TCP connection in blocking mode inside the rdma_connect call: to an address nobody has,
// the call returns only when TCP gives up on its SYNs (about 130 s with the default
// tcp_syn_retries), with the thread blocked in it and the step's bound unable to fire; to a
// port nothing listens on, the call itself fails (ECONNREFUSED). So on iWARP the call runs
// here and the loop waits for the step's outcome as always, bounded: the thread's failure is
// handed to the step waiter through an eventfd the loop watches (the call's success needs
// nothing: ESTABLISHED or REJECTED follows as an event).
// Invariants: while the call runs, the loop makes no librdmacm call on the id and no verbs
// call on its QP (the kernel holds the id's lock, and siw the QP's state lock, for the whole
// connect: rdma_disconnect, rdma_destroy_id, ibv_modify_qp or ibv_destroy_qp would block the
// loop until it ends; measured: a stopped connect() took 129 s to return). A QP or an id
// whose owner goes first is destroyed by the thread when the call returns (`destroy_qp`,
// `destroy_id`), with shares of the event channel, the PD and the CQs kept until then.
struct blocking_connect {
    rdma_cm_id* id = nullptr;
    std::shared_ptr<rdma_event_channel> channel;
    rdma_conn_param param{};
    std::vector<std::byte> data; // the private data, owned here for the thread
    int efd = -1;
    fd_watch* watch = nullptr;               // loop side: the poll on efd
    cm_id_state* owner = nullptr;            // loop side: null once the state went
    std::mutex m;                            // guards the three below
    bool done = false;                       // rdma_connect returned
    int error = 0;                           // its errno, 0 on success
    bool destroy_id = false;                 // the state went first: the thread destroys the id
    bool destroy_qp = false;                 // the qp went first: the thread destroys the QP
    std::vector<std::shared_ptr<void>> keep; // what the QP needs until then (PD, CQs)

    ~blocking_connect() {
        if (efd >= 0) ::close(efd);
    }

    // The loop learns that rdma_connect returned: a failure ends the step.
    static void ready(void* self, unsigned) noexcept {
        auto* job = static_cast<blocking_connect*>(self);
        std::uint64_t n = 0;
        [[maybe_unused]] const auto r = ::read(job->efd, &n, sizeof n);
        int err = 0;
        {
            const std::lock_guard lock(job->m);
            if (!job->done) return;
            err = job->error;
        }
        cm_id_state* s = job->owner;
        if (s == nullptr || err == 0) return;
        cm_event_data d;
        if (err == ECONNREFUSED) {
            d.type = RDMA_CM_EVENT_REJECTED;
            d.nothing_listens = true;
        } else {
            d.type = RDMA_CM_EVENT_CONNECT_ERROR;
        }
        d.status = -err;
        if (waiter* w = s->step_waiters.pop_front()) {
            static_cast<cm_step_waiter*>(w)->result = std::move(d);
            w->fulfil(0);
        }
    }
    static void failed(void*, int) noexcept {} // the step's bound still ends the wait

    // Starts the thread. Throws std::system_error (eventfd, the poll, the thread).
    static std::shared_ptr<blocking_connect> start(cm_id_state& s, const rdma_conn_param& p) {
        auto job = std::make_shared<blocking_connect>();
        job->id = s.id;
        job->channel = s.channel->channel;
        job->param = p;
        if (p.private_data != nullptr) {
            const auto* b = static_cast<const std::byte*>(p.private_data);
            job->data.assign(b, b + p.private_data_len);
            job->param.private_data = job->data.data();
        }
        job->efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (job->efd < 0) throw_system_error(errno, "eventfd (for rdma_connect's thread)");
        job->owner = &s;
        job->watch = fd_watch::start(*s.channel->ctx, job->efd, job, job.get(), ready, failed);
        try {
            std::thread([job] {
                errno = 0;
                const int ret = rdma_cm_hooks().connect.load()(job->id, &job->param);
                const int err = ret == 0 ? 0 : (errno != 0 ? errno : EIO);
                bool destroy = false;
                std::vector<std::shared_ptr<void>> released;
                {
                    const std::lock_guard lock(job->m);
                    job->done = true;
                    job->error = err;
                    destroy = job->destroy_id;
                    // Under the lock: the loop's abandon() / take_qp() see `done` only once
                    // the QP is gone, so the loop never destroys the id (or the QP) while
                    // this thread is still in rdma_destroy_qp.
                    if (job->destroy_qp) {
                        rdma_destroy_qp(job->id);
                        released = std::move(job->keep);
                    }
                }
                released.clear();
                if (destroy) {
                    rdma_destroy_id(job->id);
                    return;
                }
                const std::uint64_t one = 1;
                [[maybe_unused]] const auto n = ::write(job->efd, &one, sizeof one);
            }).detach();
        } catch (const std::system_error&) {
            job->abandon(); // the call never ran: nothing for a thread to destroy
            throw;
        }
        return job;
    }

    // rdma_connect has not been seen to return on its thread (loop side). The kernel may be
    // done with it already: see cm_id::start_disconnect.
    bool running() noexcept {
        const std::lock_guard lock(m);
        return !done;
    }

    // The id's qp goes (loop side): true when the thread now owns the QP (and `k`). Not once
    // the id is connected: the kernel's call has returned then (see start_disconnect), and the
    // loop may disconnect the id, which touches the QP, at any time: the loop destroys it.
    bool take_qp(std::vector<std::shared_ptr<void>> k, bool connected) noexcept {
        const std::lock_guard lock(m);
        if (done || connected) return false;
        destroy_qp = true;
        keep = std::move(k);
        return true;
    }

    // The state goes (loop side): stop watching; true when the thread now owns the id.
    bool abandon() noexcept {
        owner = nullptr;
        if (watch != nullptr) std::exchange(watch, nullptr)->release();
        const std::lock_guard lock(m);
        if (!done) destroy_id = true;
        return destroy_id;
    }
};

} // namespace ringverbs::detail
