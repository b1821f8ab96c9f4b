// The completion runtime in one include: completion channels, cqs, qps whose requests are
// awaited, device events, completion errors. Needs the engine and libibverbs (link
// ringverbs-rdma).
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine.hpp>
#include <ringverbs/rdma/buffers.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/completion_error.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/device_events.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/rdma/recv_ring.hpp>
#include <ringverbs/rdma/srq.hpp>
#include <ringverbs/verbs.hpp>
