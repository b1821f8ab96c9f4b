// completion_error: a work completion that did not succeed, as an exception.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/error.hpp>

#include <infiniband/verbs.h>

#include <string>
#include <system_error>

namespace ringverbs {

// The std::error_category of ibv_wc_status values: message() is ibv_wc_status_str().
const std::error_category& wc_status_category() noexcept;

inline std::error_code make_error_code(ibv_wc_status s) noexcept {
    return {static_cast<int>(s), wc_status_category()};
}

// Thrown by a per-request await whose work completion failed. code() is the ibv_wc_status in
// wc_status_category(), whose message() is ibv_wc_status_str and, for the statuses whose text
// is terse (RNR and transport retries exceeded, remote access, operation and request errors,
// length, protection and QP operation errors, flushes), what it usually means; what() reads
// "<request> (status N, vendor_err M): <message>", e.g. "the send (ibv_post_send(SEND)) on qp
// 17 (status 13, vendor_err 0): RNR retry counter exceeded: the peer had no receive posted
// (RNR) through every retry (verbs::rts_params::rnr_retry, ...)".
// A request cancelled through its stop_token or timeout throws std::system_error with
// errc::operation_canceled / errc::timed_out instead, once its flush completion arrived.
class completion_error : public std::system_error {
  public:
    completion_error(const ibv_wc& wc, const char* operation);
    ibv_wc_status status() const noexcept { return status_; }
    std::uint32_t vendor_err() const noexcept { return vendor_err_; }
    std::uint64_t wr_id() const noexcept { return wr_id_; }
    // The QP the completion names (for a receive from an srq: the QP that took it; 0 for a
    // flush made up when no QP could deliver one).
    std::uint32_t qp_num() const noexcept { return qp_num_; }

  protected:
    completion_error(const ibv_wc& wc, std::error_code code, const std::string& what);

  private:
    ibv_wc_status status_;
    std::uint32_t vendor_err_;
    std::uint64_t wr_id_;
    std::uint32_t qp_num_;
};

// A request flushed because its connection ended: the peer disconnected (or its process went),
// or this side called cm_id::disconnect(). code() is errc::connection_reset, not the flush
// status, so that the end of a connection reads apart from a failed request (completion_error
// with another status) and from a timeout or stop (std::system_error, timed_out /
// operation_canceled); status() is still IBV_WC_WR_FLUSH_ERR, and a handler of
// completion_error still catches it. what(): "<operation>: the connection was closed (...)".
// Only for a qp made on a cm_id (cm_id::make_qp): a plain qp knows nothing of connections.
class connection_reset : public completion_error {
  public:
    connection_reset(const ibv_wc& wc, const char* operation);
};

} // namespace ringverbs

template <>
struct std::is_error_code_enum<ibv_wc_status> : std::true_type {};
