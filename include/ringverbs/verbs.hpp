// Umbrella header: every RAII verbs wrapper (ringverbs::verbs).
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/access.hpp>
#include <ringverbs/verbs/completion_channel.hpp>
#include <ringverbs/verbs/completion_queue.hpp>
#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/device.hpp>
#include <ringverbs/verbs/memory_region.hpp>
#include <ringverbs/verbs/protection_domain.hpp>
#include <ringverbs/verbs/queue_pair.hpp>
#include <ringverbs/verbs/verb_error.hpp>
