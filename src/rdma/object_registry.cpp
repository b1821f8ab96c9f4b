#include <ringverbs/rdma/detail/object_registry.hpp>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace ringverbs::detail {

namespace {

template <typename State>
struct entry {
    State* state;
    std::uint64_t generation;
};

struct registry {
    std::mutex lock;
    std::uint64_t generations = 0; // the last one given
    std::unordered_map<ibv_cq*, entry<cq_state>> cqs;
    std::unordered_map<ibv_qp*, entry<qp_state>> qps;
    std::unordered_map<ibv_srq*, entry<srq_state>> srqs;
};

registry& the_registry() {
    static registry r; // constructed on first use, never destroyed before its users
    return r;
}

template <typename Map, typename Key>
auto* lookup(Map& m, Key key, std::uint64_t& generation) noexcept {
    auto it = m.find(key);
    if (it == m.end()) return decltype(it->second.state){nullptr};
    generation = it->second.generation;
    return it->second.state;
}

} // namespace

void register_object(ibv_cq* cq, cq_state* s) {
    std::lock_guard g(the_registry().lock);
    the_registry().cqs.insert_or_assign(cq, entry<cq_state>{s, ++the_registry().generations});
}
void register_object(ibv_qp* qp, qp_state* s) {
    std::lock_guard g(the_registry().lock);
    the_registry().qps.insert_or_assign(qp, entry<qp_state>{s, ++the_registry().generations});
}
void register_object(ibv_srq* srq, srq_state* s) {
    std::lock_guard g(the_registry().lock);
    the_registry().srqs.insert_or_assign(srq, entry<srq_state>{s, ++the_registry().generations});
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
namespace {
bool on_device(const ibv_context* c, const char* name) noexcept {
    return std::strcmp(c->device->name, name) == 0;
}
} // namespace

void objects_on(const char* device_name, device_objects& out) {
    registry& r = the_registry();
    // Registered objects are alive (unregistered before they are destroyed): their context
    // can be read.
    for (auto& [qp, e] : r.qps)
        if (on_device(qp->context, device_name)) out.qps.push_back({qp, e.state, e.generation});
    for (auto& [srq, e] : r.srqs)
        if (on_device(srq->context, device_name)) out.srqs.push_back({srq, e.state, e.generation});
    for (auto& [cq, e] : r.cqs)
        if (on_device(cq->context, device_name)) out.cqs.push_back({cq, e.state, e.generation});
}
srq_state* find_object(ibv_srq* srq, std::uint64_t& generation) noexcept {
    return lookup(the_registry().srqs, srq, generation);
}
cq_state* find_object(ibv_cq* cq, std::uint64_t& generation) noexcept {
    return lookup(the_registry().cqs, cq, generation);
}
qp_state* find_object(ibv_qp* qp, std::uint64_t& generation) noexcept {
    return lookup(the_registry().qps, qp, generation);
}

} // namespace ringverbs::detail
