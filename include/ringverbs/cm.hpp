// rdma_cm connections in one include: the cm_channel and its cm_ids (resolve, listen, connect,
// accept, disconnect), the qps made on them, and connect() / listener above them. Needs the
// completion runtime and librdmacm (link ringverbs-cm).
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/cm/cm_channel.hpp>
#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/cm/connection.hpp>
#include <ringverbs/rdma.hpp>
