#include <ringverbs/rdma/detail/object_registry.hpp>

#include <mutex>
#include <unordered_map>

namespace ringverbs::detail {

namespace {

struct registry {
    std::mutex lock;
    std::unordered_map<ibv_cq*, cq_state*> cqs;
    std::unordered_map<ibv_qp*, qp_state*> qps;
    std::unordered_map<ibv_srq*, srq_state*> srqs;
};

registry& the_registry() {
    static registry r; // constructed on first use, never destroyed before its users
    return r;
}

} // namespace

void register_object(ibv_cq* cq, cq_state* s) {
    std::lock_guard g(the_registry().lock);
    the_registry().cqs[cq] = s;
}
void register_object(ibv_qp* qp, qp_state* s) {
    std::lock_guard g(the_registry().lock);
    the_registry().qps[qp] = s;
}
void register_object(ibv_srq* srq, srq_state* s) {
    std::lock_guard g(the_registry().lock);
    the_registry().srqs[srq] = s;
}
void unregister_object(ibv_srq* srq) noexcept {
    std::lock_guard g(the_registry().lock);
    the_registry().srqs.erase(srq);
}
void unregister_object(ibv_cq* cq) noexcept {
    std::lock_guard g(the_registry().lock);
    the_registry().cqs.erase(cq);
}
void unregister_object(ibv_qp* qp) noexcept {
    std::lock_guard g(the_registry().lock);
    the_registry().qps.erase(qp);
}
void lock_registry() noexcept {
    the_registry().lock.lock();
}
void unlock_registry() noexcept {
    the_registry().lock.unlock();
}
srq_state* find_object(ibv_srq* srq) noexcept {
    auto& m = the_registry().srqs;
    auto it = m.find(srq);
    return it == m.end() ? nullptr : it->second;
}
cq_state* find_object(ibv_cq* cq) noexcept {
    auto& m = the_registry().cqs;
    auto it = m.find(cq);
    return it == m.end() ? nullptr : it->second;
}
qp_state* find_object(ibv_qp* qp) noexcept {
    auto& m = the_registry().qps;
    auto it = m.find(qp);
    return it == m.end() ? nullptr : it->second;
}

} // namespace ringverbs::detail
