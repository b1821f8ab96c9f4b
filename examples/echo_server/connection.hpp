// echo_server: one client's connection (connection.cpp).
#pragma once

#include "server.hpp"

namespace echo {

// One client's connection: a pool of buffers, its CQ and QP. Every buffer has its own echo
// loop, a coroutine that receives a message into it and sends it back from it, again and
// again; the first failure closes the connection and ends the other loops. With the SRQ (the
// default) the connection has no buffers or CQ of its own: the device's shared_echo_loops receive
// for every connection and echo through echo_shared().
class connection {
  public:
    // Throws std::system_error naming the verb that failed (memory region, CQ, QP).
    connection(worker& owner, device_resources& device, cm_id id);

    // Accepts the client and echoes until the connection is closed. When it returns, no
    // request is owed a completion: the connection may be destroyed.
    task<summary> serve();

    // With the SRQ, for the device's shared loops: a message arrived for this connection; its echo
    // (the await may outlive the connection: look it up again after); what the echo did; a
    // failure that closes the connection (through its own watch, which outlives the close).
    bool closing() const noexcept { return closing_; }
    void received() noexcept { last_message_ = std::chrono::steady_clock::now(); }
    qp::request echo(local_buffer message) noexcept { return qp_.send(message); }
    void echoed(std::uint32_t bytes) noexcept {
        ++summary_.messages;
        summary_.bytes += bytes;
    }
    void fail(std::string why);
    std::string receive_failure(ibv_wc_status status) const {
        return failure(request::receive, status);
    }
    // An echo's failed completion: the client's end may explain it (cut_off()).
    void echo_failed(const completion_error& e) {
        cut_off(std::string("echo send failed: ") + e.what(), grace_after(e.status()));
    }

  private:
    enum class request { receive, echo_send };

    task<void> accept();
    task<void> echo_loop(std::uint32_t slot);
    task<void> watch_idle();
    task<void> watch_disconnect();
    task<void> close(std::string why);
    task<void> disconnect();
    std::string failure(request failed, ibv_wc_status status) const;
    // The two waits for DISCONNECTED after a cut-off (grace_after).
    static constexpr std::chrono::seconds peer_grace{10}, own_end_grace{30};
    // Why an echo loop's request failed, and whether the client's end may explain it.
    struct loop_end {
        std::string why;
        bool explainable = false;
        std::chrono::seconds grace = peer_grace; // cut_off()'s, when explainable
    };
    loop_end ended_by(const std::exception_ptr& error, request current);
    void cut_off(std::string why, std::chrono::seconds grace);
    std::chrono::seconds grace_after(bool own_end) const noexcept;
    std::chrono::seconds grace_after(ibv_wc_status status) const noexcept;
    local_buffer buffer(std::uint32_t slot, std::uint32_t length);
    qp make_qp();

    worker& worker_;
    echo_server& server_;
    device_resources& device_;
    cm_id id_;
    const std::uint32_t max_size_; // bytes of each buffer: the largest message taken
    const std::uint32_t depth_;    // buffers, each with its own echo loop (0 with the SRQ)
    std::vector<std::byte> pool_;  // declared before the QP, so that it outlives it
    std::optional<verbs::memory_region> mr_;
    std::optional<cq> completions_;
    qp qp_;
    summary summary_;
    bool accepted_ = false;
    bool closing_ = false;
    std::stop_source
        ending_; // requested by close() and fail(): ends the idle and disconnect watches
    std::optional<std::string> failure_; // fail()'s reason
    bool cut_off_ = false; // failure_ is an echo cut off in flight: the client's end, if it came
    std::chrono::seconds grace_ = peer_grace; // cut_off()'s wait for DISCONNECTED
    bool watching_ = false;                   // watch_disconnect runs: it closes for a cut_off()
    std::uint32_t loops_running_ = 0;         // echo loops not ended yet (--no-srq)
    bool disconnect_seen_ = false; // --no-srq: watch_disconnect saw the client's disconnect
    // With the SRQ: no receive of this connection carries the server's stop, so the stop ends the
    // watches (and watch_disconnect closes the connection).
    struct request_stop_of {
        std::stop_source* source;
        void operator()() const noexcept { source->request_stop(); }
    };
    std::optional<std::stop_callback<request_stop_of>> forward_stop_;
    std::chrono::steady_clock::time_point last_message_ = std::chrono::steady_clock::now();
    std::size_t never_flushed_ = 0; // requests the device never flushed after the close
};

} // namespace echo
