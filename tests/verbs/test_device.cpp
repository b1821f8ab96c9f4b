// Device discovery and the read-only queries of a context: ports, GIDs, completion vectors.
#include "verbs_test_util.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

using namespace ringverbs;
using ringverbs::test::catch_system_error;
using ringverbs::test::rdma_device;

TEST_CASE("the device list names the test device") {
    verbs::device_list list;
    REQUIRE_FALSE(list.empty());
    bool seen = false;
    for (verbs::device d : list) {
        CHECK_FALSE(d.name().empty());
        char guid[20];
        std::snprintf(guid, sizeof guid, "%016llx", static_cast<unsigned long long>(d.guid()));
        MESSAGE("device " << std::string(d.name()) << " guid " << std::string(guid));
        seen = seen || d.name() == rdma_device().name;
    }
    CHECK(seen);
    REQUIRE(list.find(rdma_device().name).has_value());
    CHECK(list.find(rdma_device().name)->native() != nullptr);
    CHECK_FALSE(list.find("no-such-device").has_value());

    const auto e = catch_system_error([&] { (void)list.at("no-such-device"); });
    CHECK(e.code() == std::errc::no_such_device);
    CHECK(std::string(e.what()).find("no-such-device") != std::string::npos);

    verbs::device_list moved = std::move(list);
    CHECK(list.empty());
    CHECK(moved.find(rdma_device().name).has_value());
}

TEST_CASE("a context opens by name and by device") {
    verbs::context by_name(rdma_device().name);
    CHECK(by_name.name() == rdma_device().name);
    CHECK(by_name.native() != nullptr);
    CHECK(by_name.get() == by_name.native());

    verbs::device_list list;
    verbs::context by_device(list.at(rdma_device().name));
    CHECK(by_device.name() == rdma_device().name);
    CHECK(by_device.native() != by_name.native());

    const auto e = catch_system_error([] { verbs::context c("no-such-device"); });
    CHECK(e.code() == std::errc::no_such_device);
    const std::string what = e.what();
    CHECK(what.find("ibv_open_device") != std::string::npos);
    CHECK(what.find("no-such-device") != std::string::npos);
}

TEST_CASE("the device reports sane limits") {
    verbs::context ctx(rdma_device().name);
    const ibv_device_attr attr = ctx.query_device();
    CHECK(attr.phys_port_cnt >= 1);
    CHECK(attr.phys_port_cnt == ctx.port_count());
    CHECK(attr.max_cqe > 0);
    CHECK(attr.max_qp_wr > 0);
    CHECK(attr.max_sge > 0);
    MESSAGE("max_qp_wr " << attr.max_qp_wr << ", max_sge " << attr.max_sge << ", max_cqe "
                         << attr.max_cqe << ", max_qp_rd_atom " << attr.max_qp_rd_atom
                         << ", max_qp_init_rd_atom " << attr.max_qp_init_rd_atom);
}

TEST_CASE("ports: the test port is active and a missing port is a clear error") {
    verbs::context ctx(rdma_device().name);
    const ibv_port_attr port = ctx.query_port(rdma_device().port);
    CHECK(port.state == IBV_PORT_ACTIVE);
    CHECK(port.active_mtu >= IBV_MTU_256);
    CHECK(port.active_mtu <= port.max_mtu);
    CHECK(port.gid_tbl_len > 0);
    CHECK(ctx.first_active_port() == std::optional<std::uint8_t>(rdma_device().port));
    MESSAGE("port " << int(rdma_device().port) << ": active_mtu " << port.active_mtu
                    << ", link_layer " << int(port.link_layer) << ", gid_tbl_len "
                    << port.gid_tbl_len);

    const auto bad = static_cast<std::uint8_t>(ctx.port_count() + 1);
    const auto e = catch_system_error([&] { (void)ctx.query_port(bad); });
    CHECK(e.code() == std::errc::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("ibv_query_port") != std::string::npos);
    CHECK(what.find("port " + std::to_string(bad)) != std::string::npos);
}

TEST_CASE("GIDs: the test GID is in the table and has the expected type") {
    verbs::context ctx(rdma_device().name);
    const std::uint8_t port = rdma_device().port;
    const auto table = ctx.gid_table();
    REQUIRE_FALSE(table.empty());
    for (const ibv_gid_entry& e : table)
        MESSAGE("port " << e.port_num << " gid[" << e.gid_index << "] " << verbs::to_string(e.gid)
                        << " type " << e.gid_type << " ifindex " << e.ndev_ifindex);

    const ibv_gid_entry mine = ctx.query_gid(port, rdma_device().gid_index);
    CHECK(mine.gid_index == rdma_device().gid_index);
    CHECK(mine.port_num == port);
    CHECK(std::any_of(table.begin(), table.end(), [&](const ibv_gid_entry& e) {
        return e.port_num == port && e.gid_index == mine.gid_index &&
               std::equal(std::begin(e.gid.raw), std::end(e.gid.raw), std::begin(mine.gid.raw));
    }));

    if (ctx.query_port(port).link_layer == IBV_LINK_LAYER_ETHERNET &&
        std::getenv("RINGVERBS_GID_INDEX") == nullptr) {
        CHECK(mine.gid_type == IBV_GID_TYPE_ROCE_V2);
        CHECK(verbs::is_ipv4_mapped(mine.gid));
        // Both VM harnesses export the address they put on the netdev under rxe.
        const char* addr = std::getenv("RINGVERBS_ADDR");
        if (addr == nullptr) addr = std::getenv("SOFTROCE_ADDR");
        if (addr != nullptr) CHECK(verbs::to_string(mine.gid) == std::string("::ffff:") + addr);
    }

    // An unused slot inside the table reads as ENODATA, one past it as an error too.
    const std::uint32_t len = static_cast<std::uint32_t>(ctx.query_port(port).gid_tbl_len);
    std::optional<std::uint32_t> empty_slot;
    for (std::uint32_t i = 0; i < len && !empty_slot; ++i)
        if (std::none_of(table.begin(), table.end(), [&](const ibv_gid_entry& e) {
                return e.port_num == port && e.gid_index == i;
            }))
            empty_slot = i;
    if (empty_slot) {
        const auto e = catch_system_error([&] { (void)ctx.query_gid(port, *empty_slot); });
        CHECK(e.code().value() == ENODATA);
        CHECK(std::string(e.what()).find("ibv_query_gid_ex") != std::string::npos);
    }
    const auto past = catch_system_error([&] { (void)ctx.query_gid(port, len); });
    CHECK(std::string(past.what()).find("ibv_query_gid_ex") != std::string::npos);
    MESSAGE("GID index past the table: " << std::string(past.what()));
}

TEST_CASE("completion vectors") {
    verbs::context ctx(rdma_device().name);
    CHECK(ctx.num_comp_vectors() >= 1);
    MESSAGE(rdma_device().name << " has " << ctx.num_comp_vectors() << " completion vectors");
}

TEST_CASE("a moved-from context is empty and the target works") {
    verbs::context a(rdma_device().name);
    ibv_context* raw = a.native();
    verbs::context b = std::move(a);
    CHECK_FALSE(a);
    CHECK(a.native() == nullptr);
    CHECK(b.native() == raw);
    verbs::context c(rdma_device().name);
    c = std::move(b);
    CHECK(c.native() == raw);
    CHECK(c.query_port(rdma_device().port).state == IBV_PORT_ACTIVE);
}
