// Everything of ringverbs in one include: the engine, the verbs wrappers, the completion
// runtime and rdma_cm (link ringverbs, which is all three libraries). A program that needs only
// a layer includes <ringverbs/engine.hpp>, <ringverbs/rdma.hpp> or <ringverbs/cm.hpp>.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/cm.hpp>
#include <ringverbs/engine.hpp>
#include <ringverbs/rdma.hpp>
#include <ringverbs/verbs.hpp>
