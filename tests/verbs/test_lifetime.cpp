// Creating and destroying every wrapper, in every order: children keep their parents alive, so
// any order is defined and nothing leaks (checked with fd counts and the kernel's object counts).
#include "verbs_test_util.hpp"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <numeric>

using namespace ringverbs;
using namespace ringverbs::test;

namespace {

enum obj { CTX, PD, CHANNEL, CQ, MR, QP, N_OBJ };
constexpr const char* obj_name[N_OBJ] = {"context", "pd", "channel", "cq", "mr", "qp"};

// What keeps what alive: an object lives while its wrapper or any object holding a share does.
bool kernel_alive(obj o, const std::array<bool, N_OBJ>& wrapper) {
    switch (o) {
    case QP:
        return wrapper[QP];
    case MR:
        return wrapper[MR];
    case CQ:
        return wrapper[CQ] || wrapper[QP];
    case CHANNEL:
        return wrapper[CHANNEL] || kernel_alive(CQ, wrapper);
    case PD:
        return wrapper[PD] || wrapper[MR] || wrapper[QP];
    case CTX:
        return wrapper[CTX] || kernel_alive(PD, wrapper) || kernel_alive(CHANNEL, wrapper);
    default:
        return false;
    }
}

struct objects {
    std::vector<std::byte> buf = std::vector<std::byte>(4096);
    std::optional<verbs::context> ctx;
    std::optional<verbs::protection_domain> pd;
    std::optional<verbs::completion_channel> channel;
    std::optional<verbs::completion_queue> cq;
    std::optional<verbs::memory_region> mr;
    std::optional<verbs::queue_pair> qp;

    objects() {
        ctx.emplace(rdma_device().name);
        pd.emplace(*ctx);
        channel.emplace(*ctx);
        cq.emplace(*ctx, 16, &*channel);
        mr.emplace(*pd, buf);
        qp.emplace(*pd, *cq, *cq);
    }
    void destroy(obj o) {
        switch (o) {
        case CTX:
            ctx.reset();
            break;
        case PD:
            pd.reset();
            break;
        case CHANNEL:
            channel.reset();
            break;
        case CQ:
            cq.reset();
            break;
        case MR:
            mr.reset();
            break;
        case QP:
            qp.reset();
            break;
        default:
            break;
        }
    }
};

std::size_t expected_fds(std::size_t base, const std::array<bool, N_OBJ>& w) {
    return base + (kernel_alive(CTX, w) ? 2 : 0) + (kernel_alive(CHANNEL, w) ? 1 : 0);
}

// Kernel objects of the test device relative to `base`, in the order pd, cq, qp, mr, ctx.
std::optional<std::array<long, 5>> kernel_counts(const std::map<std::string, long>& base) {
    const auto now = rdma_resource_counts(rdma_device().name);
    if (!now) return std::nullopt;
    std::array<long, 5> out{};
    const char* keys[5] = {"pd", "cq", "qp", "mr", "ctx"};
    for (int i = 0; i < 5; ++i) {
        auto it = now->find(keys[i]);
        auto b = base.find(keys[i]);
        out[static_cast<std::size_t>(i)] =
            it == now->end() ? -1 : it->second - (b == base.end() ? 0 : b->second);
    }
    return out;
}

std::array<long, 5> expected_counts(const std::array<bool, N_OBJ>& w) {
    // On siw the context holds one more CQ from its first CQ on: the guard of
    // verbs/detail/mmap_keys.hpp, destroyed when the context closes.
    const long guard = rdma_device().siw && kernel_alive(CTX, w) ? 1 : 0;
    return {kernel_alive(PD, w), kernel_alive(CQ, w) + guard, kernel_alive(QP, w),
            kernel_alive(MR, w), kernel_alive(CTX, w)};
}

// "pd 1 cq 0 qp 0 mr 1 ctx 1", so that a mismatch reads well in the test log.
std::string show(const std::optional<std::array<long, 5>>& c) {
    if (!c) return "(no counts)";
    const char* keys[5] = {"pd", "cq", "qp", "mr", "ctx"};
    std::string s;
    for (std::size_t i = 0; i < 5; ++i)
        s += std::string(i ? " " : "") + keys[i] + " " + std::to_string((*c)[i]);
    return s;
}

} // namespace

TEST_CASE("create and destroy every object in reverse order of creation") {
    const std::size_t fds = count_open_fds();
    {
        std::vector<std::byte> buf(8192);
        verbs::context ctx(rdma_device().name);
        verbs::protection_domain pd(ctx);
        verbs::completion_channel channel(ctx);
        verbs::completion_queue cq(ctx, 32, &channel);
        verbs::completion_queue cq_plain(ctx, 8);
        verbs::memory_region mr(pd, buf);
        verbs::queue_pair qp(pd, cq, cq_plain);
        CHECK(count_open_fds() == fds + 3);
        CHECK(pd.native()->context == ctx.native());
        CHECK(cq.native()->channel == channel.native());
        CHECK(cq_plain.native()->channel == nullptr);
        CHECK(qp.native()->send_cq == cq.native());
        CHECK(qp.native()->recv_cq == cq_plain.native());
        CHECK(qp.state() == IBV_QPS_RESET);
        CHECK(cq.capacity() >= 32);
        CHECK(qp.caps().max_send_wr >= 64);
        CHECK(mr.lkey() == mr.native()->lkey);
    }
    CHECK(count_open_fds() == fds);
}

TEST_CASE("every destruction order of context, PD, channel, CQ, MR and QP is defined") {
    const std::size_t fds = count_open_fds();
    const auto base = rdma_resource_counts(rdma_device().name);
    if (!base) MESSAGE("`rdma resource show` is unavailable: only fds are checked");

    std::array<int, N_OBJ> order{};
    std::iota(order.begin(), order.end(), 0);
    int permutations = 0;
    do {
        objects o;
        std::array<bool, N_OBJ> wrapper{};
        wrapper.fill(true);
        // The kernel's counts cost a process spawn (about half a second under emulation), so
        // they are checked on three orders only: creation order, and two from the middle.
        const bool check_kernel = base && permutations % 240 == 0;
        std::string trail;
        for (int i : order) {
            const obj which = static_cast<obj>(i);
            o.destroy(which);
            wrapper[static_cast<std::size_t>(i)] = false;
            trail += std::string(trail.empty() ? "" : ", ") + obj_name[i];
            INFO("destroyed so far: " << trail);
            REQUIRE(count_open_fds() == expected_fds(fds, wrapper));
            if (check_kernel) REQUIRE(show(kernel_counts(*base)) == show(expected_counts(wrapper)));
        }
        ++permutations;
    } while (std::next_permutation(order.begin(), order.end()));
    CHECK(permutations == 720);
    CHECK(count_open_fds() == fds);
    if (base) CHECK(show(kernel_counts(*base)) == show(std::array<long, 5>{}));
}

TEST_CASE("wrappers destroyed before their children: the children keep working") {
    std::vector<std::byte> src(1000), dst(1000);
    fill_pattern(src, 7);
    std::optional<verbs::context> ctx(std::in_place, rdma_device().name);
    std::optional<verbs::protection_domain> pd(std::in_place, *ctx);
    std::optional<verbs::completion_channel> channel(std::in_place, *ctx);
    verbs::completion_queue cq(*ctx, 16, &*channel);
    verbs::memory_region src_mr(*pd, src, verbs::access::none);
    verbs::memory_region dst_mr(*pd, dst);
    verbs::queue_pair a(*pd, cq, cq);
    verbs::queue_pair b(*pd, cq, cq);
    const int fd = channel->fd();

    const auto base = rdma_resource_counts(rdma_device().name);
    // verbs alone would refuse this (EBUSY) and leak the PD; here the PD just lives on.
    pd.reset();
    ctx.reset();
    if (base) CHECK(show_counts(rdma_resource_counts(rdma_device().name)) == show_counts(base));
    auto link = connect_pair(a, b);

    post_recv_into(b, dst_mr, 2);
    post_send_from(a, src_mr, 1);

    // The channel object goes too; the CQ still owns a share of it, so events still arrive.
    auto ev_channel = std::move(*channel);
    channel.reset();
    std::vector<ibv_wc> wcs = wait_completions(cq, ev_channel, 2);
    CHECK(find_wc(wcs, 1).status == IBV_WC_SUCCESS);
    CHECK(find_wc(wcs, 2).status == IBV_WC_SUCCESS);
    CHECK(std::equal(src.begin(), src.end(), dst.begin()));
    CHECK(fcntl(fd, F_GETFD) != -1);
}

TEST_CASE("move construction and assignment transfer ownership") {
    const std::size_t fds = count_open_fds();
    std::vector<std::byte> buf(64), buf2(64);
    verbs::context ctx(rdma_device().name);
    verbs::protection_domain pd(ctx);
    verbs::completion_channel ch1(ctx), ch2(ctx);
    CHECK(count_open_fds() == fds + 4);
    ibv_comp_channel* raw1 = ch1.native();
    ch2 = std::move(ch1); // the old ch2 is destroyed here
    CHECK_FALSE(ch1);
    CHECK(ch2.native() == raw1);
    CHECK(count_open_fds() == fds + 3);

    verbs::completion_queue cq(ctx, 8, &ch2);
    verbs::completion_queue cq2 = std::move(cq);
    CHECK_FALSE(cq);
    CHECK(cq.native() == nullptr);
    CHECK(cq2.native()->channel == raw1);

    verbs::memory_region mr(pd, buf);
    ibv_mr* raw_mr = mr.native();
    verbs::memory_region mr2(pd, buf2);
    mr2 = std::move(mr);
    CHECK(mr2.native() == raw_mr);
    CHECK(mr2.data() == buf.data());
    CHECK_FALSE(mr);

    verbs::queue_pair qp(pd, cq2, cq2);
    const std::uint32_t qpn = qp.qp_num();
    verbs::queue_pair qp2 = std::move(qp);
    CHECK_FALSE(qp);
    CHECK(qp2.qp_num() == qpn);

    verbs::protection_domain pd2 = std::move(pd);
    CHECK_FALSE(pd);
    CHECK(pd2.native() != nullptr);
}

TEST_CASE("destroying a CQ with unacked events does not hang") {
    std::optional<loopback> lp(std::in_place);
    std::vector<std::byte> src(16), dst(16);
    verbs::memory_region smr(lp->pd, src), dmr(lp->pd, dst);
    lp->cq.req_notify();
    send_recv(*lp, lp->a, lp->b, smr, dmr); // acks the events it waits for
    lp->cq.req_notify();
    post_recv_into(lp->b, dmr, 98);
    post_send_from(lp->a, smr, 99);
    auto ev = lp->channel.wait_event(10s);
    REQUIRE(ev.has_value());
    CHECK(lp->cq.unacked_events() == 1);

    const auto e = catch_system_error([&] { lp->cq.ack_events(2); });
    CHECK(e.code() == std::errc::invalid_argument);
    CHECK(std::string(e.what()).find("ibv_ack_cq_events") != std::string::npos);
    CHECK(lp->cq.unacked_events() == 1);

    // ibv_destroy_cq waits for every reported event to be acked; the wrapper acks it for us.
    lp.reset();
}

TEST_CASE("the completion channel fd is non-blocking and close-on-exec") {
    verbs::context ctx(rdma_device().name);
    verbs::completion_channel ch(ctx);
    CHECK((fcntl(ch.fd(), F_GETFL) & O_NONBLOCK) != 0);
    CHECK((fcntl(ch.fd(), F_GETFD) & FD_CLOEXEC) != 0);
    CHECK(ch.fd() == ch.native()->fd);
    verbs::completion_queue cq(ctx, 4, &ch);
    cq.req_notify();
    // Nothing completed: reading must return at once rather than block.
    CHECK_FALSE(ch.get_event().has_value());
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(ch.wait_event(50ms).has_value());
    CHECK(std::chrono::steady_clock::now() - t0 >= 50ms);
}

TEST_CASE("memory regions: least privilege by default, explicit rights, clear errors") {
    std::vector<std::byte> buf(4096);
    verbs::context ctx(rdma_device().name);
    verbs::protection_domain pd(ctx);

    verbs::memory_region def(pd, buf);
    CHECK(def.rights() == verbs::access::local_write);
    CHECK(def.native()->length == buf.size());
    CHECK(def.data() == buf.data());
    CHECK(def.remote_addr(10) == reinterpret_cast<std::uintptr_t>(buf.data()) + 10);

    verbs::memory_region ro(pd, buf, verbs::access::none);
    CHECK(ro.rights() == verbs::access::none);

    const auto all = verbs::access::local_write | verbs::access::remote_write |
                     verbs::access::remote_read | verbs::access::remote_atomic;
    verbs::memory_region rw(pd, buf, all);
    CHECK(verbs::has(rw.rights(), verbs::access::remote_read));

    const auto e =
        catch_system_error([&] { verbs::memory_region bad(pd, buf, verbs::access::remote_write); });
    CHECK(e.code() == std::errc::invalid_argument);
    CHECK(std::string(e.what()).find("ibv_reg_mr") != std::string::npos);
    CHECK(std::string(e.what()).find("local_write") != std::string::npos);

    // Memory that is not mapped cannot be pinned: the verb's own error comes through.
    void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(page != MAP_FAILED);
    REQUIRE(munmap(page, 4096) == 0);
    const auto unmapped = catch_system_error([&] {
        verbs::memory_region bad(pd, std::span<std::byte>(static_cast<std::byte*>(page), 4096));
    });
    CHECK(unmapped.code() == std::errc::bad_address);
    CHECK(std::string(unmapped.what()).find("ibv_reg_mr(4096 bytes, access 0x1)") !=
          std::string::npos);
    MESSAGE("registering unmapped memory: " << std::string(unmapped.what()));

    const ibv_sge whole = def.sge();
    CHECK(whole.addr == reinterpret_cast<std::uintptr_t>(buf.data()));
    CHECK(whole.length == buf.size());
    CHECK(whole.lkey == def.lkey());
    const ibv_sge part = def.sge(100, 200);
    CHECK(part.addr == whole.addr + 100);
    CHECK(part.length == 200);
    CHECK(def.sge(4096).length == 0);
    CHECK(catch_system_error([&] { (void)def.sge(4097); }).code() == std::errc::invalid_argument);
    CHECK(catch_system_error([&] { (void)def.sge(4000, 97); }).code() ==
          std::errc::invalid_argument);
}

// libsiw refuses the object whose queue starts at page offset 144 of its context (its mmap key
// equals SIW_INVAL_UOBJ_KEY), with errno 0: before the guard of verbs/detail/mmap_keys.hpp,
// the 144th one-page CQ of a context failed on siw ("ibv_create_cq(entries 4, comp_vector 0):
// Input/output error"), and every one after it. Every device must make all of these.
TEST_CASE("300 small CQs and 100 QPs on one context: every create succeeds (siw's mmap key "
          "0x90000 guarded)") {
    verbs::context ctx(rdma_device().name);
    verbs::protection_domain pd(ctx);
    std::vector<verbs::completion_queue> cqs;
    cqs.reserve(300);
    for (int i = 0; i < 300; ++i) {
        CAPTURE(i);
        cqs.emplace_back(ctx, 4);
    }
    std::vector<verbs::queue_pair> qps;
    qps.reserve(100);
    for (int i = 0; i < 100; ++i) {
        CAPTURE(i);
        qps.emplace_back(pd, cqs[static_cast<std::size_t>(i)], cqs[static_cast<std::size_t>(i)],
                         verbs::qp_caps{.max_send_wr = 64,
                                        .max_recv_wr = 64,
                                        .max_send_sge = 1,
                                        .max_recv_sge = 1,
                                        .max_inline_data = 0});
    }
    CHECK(cqs.size() == 300);
    CHECK(qps.size() == 100);
}
