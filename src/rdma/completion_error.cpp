#include <ringverbs/rdma/completion_error.hpp>

namespace ringverbs {

namespace {
class wc_category final : public std::error_category {
  public:
    const char* name() const noexcept override { return "ibv_wc_status"; }
    std::string message(int v) const override {
        return ibv_wc_status_str(static_cast<ibv_wc_status>(v));
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
      vendor_err_(wc.vendor_err), wr_id_(wc.wr_id) {}

} // namespace ringverbs
