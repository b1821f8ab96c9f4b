#include <ringverbs/rdma/completion_error.hpp>

#include <ringverbs/rdma/detail/outcome.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>

namespace ringverbs {

namespace {

// What a status usually means for the application, where ibv_wc_status_str alone is terse.
const char* explanation(ibv_wc_status status) noexcept {
    switch (status) {
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return "the peer had no receive posted (RNR) through every retry "
               "(verbs::rts_params::rnr_retry, cm_conn_options::rnr_retry_count)";
    case IBV_WC_RETRY_EXC_ERR:
        return "the peer did not acknowledge through every retry: gone, unreachable, or its QP "
               "not connected (verbs::rts_params::retry_cnt, cm_conn_options::retry_count)";
    case IBV_WC_REM_INV_REQ_ERR:
        return "the peer refused the request (e.g. a message larger than its receive)";
    case IBV_WC_REM_OP_ERR:
        return "the peer could not carry it out (e.g. its receive was smaller than the message: "
               "the receiving side then sees a local length or QP operation error)";
    case IBV_WC_LOC_LEN_ERR:
        return "on a receive: the message was larger than the receive's buffer; on a send: "
               "longer than the QP or port allows";
    case IBV_WC_LOC_QP_OP_ERR:
        return "the QP could not carry it out: on a receive, usually a message larger than the "
               "buffer (Soft-RoCE reports it so); on iWARP, a send the connection's end cut off";
    case IBV_WC_LOC_PROT_ERR:
        return "the local buffer is not inside its memory region (lkey, address, length) or "
               "lacks the access the request needs";
    case IBV_WC_WR_FLUSH_ERR:
        return "the QP was in the error state: an earlier request failed, the connection ended, "
               "or the QP was moved there";
    case IBV_WC_REM_ACCESS_ERR:
        return "the peer refused the access (rkey, address range or access rights)";
    default:
        return nullptr;
    }
}

// message(): ibv_wc_status_str, and what it usually means where that is terse.
class wc_category final : public std::error_category {
  public:
    const char* name() const noexcept override { return "ibv_wc_status"; }
    std::string message(int v) const override {
        const auto status = static_cast<ibv_wc_status>(v);
        std::string text = ibv_wc_status_str(status);
        if (const char* why = explanation(status)) text += std::string(": ") + why;
        return text;
    }
};

} // namespace

const std::error_category& wc_status_category() noexcept {
    static const wc_category category;
    return category;
}

completion_error::completion_error(const ibv_wc& wc, const char* operation)
    : std::system_error(make_error_code(wc.status),
                        std::string(operation) + " (status " + std::to_string(wc.status) +
                            ", vendor_err " + std::to_string(wc.vendor_err) + ")"),
      status_(wc.status), vendor_err_(wc.vendor_err), wr_id_(wc.wr_id), qp_num_(wc.qp_num) {}

completion_error::completion_error(const ibv_wc& wc, std::error_code code, const std::string& what)
    : std::system_error(code, what), status_(wc.status), vendor_err_(wc.vendor_err),
      wr_id_(wc.wr_id), qp_num_(wc.qp_num) {}

connection_reset::connection_reset(const ibv_wc& wc, const char* operation)
    : completion_error(wc, std::make_error_code(std::errc::connection_reset),
                       std::string(operation) + ": the connection was closed (flushed, status " +
                           std::to_string(wc.status) + ": " + ibv_wc_status_str(wc.status) +
                           "; the peer disconnected, or this side did)") {}

namespace detail {

void throw_failed_completion(const ibv_wc& wc, const std::string& what, bool closed) {
    if (wc.status == IBV_WC_WR_FLUSH_ERR && wc.vendor_err == device_lost_vendor_err)
        throw_system_error(ENODEV, what + ": the RDMA device is gone (removed, or failed for "
                                          "good): the request never completed; its buffer is "
                                          "free again");
    if (wc.status == IBV_WC_WR_FLUSH_ERR && wc.vendor_err == never_flushed_vendor_err)
        throw_system_error(EIO, what + ": never flushed by the device: the QP was in the error "
                                       "state for qp_options::flush_timeout with this request "
                                       "owed, and was reset; its buffer is free again");
    if (wc.status == IBV_WC_WR_FLUSH_ERR)
        if (const int err = channel_failed_errno(wc.vendor_err); err != 0)
            throw_system_error(
                err, what +
                         (channel_failed_via_srq(wc.vendor_err)
                              ? ": a completion channel of the srq's receive CQs failed"
                              : ": a completion channel of its QP's CQs failed") +
                         " (see channel::error()), so its completion could never be read: the "
                         "QP was reset, the request never completed; its buffer is free again");
    if (closed) throw connection_reset(wc, what.c_str());
    throw completion_error(wc, what.c_str());
}

} // namespace detail

} // namespace ringverbs
