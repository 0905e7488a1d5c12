#!/usr/bin/env bash
# LMCache's multi-process server with TieredL2Adapter striped over the drives
# given (one directory per NVMe drive), then vLLM with LMCacheMPConnector:
#
#   examples/lmcache_server.sh /mnt/nvme0/kv /mnt/nvme1/kv
#   vllm serve <model> --kv-transfer-config '{"kv_connector":"LMCacheMPConnector",
#     "kv_role":"kv_both","kv_connector_extra_config":{"lmcache.mp.host":"tcp://localhost",
#     "lmcache.mp.port":5555}}'
#
# Settings are docs/configuration.md's without the "tiered." prefix. Set
# PORT, L1_GB and WARM_GB to change the defaults. tests/test_examples.py runs
# this script and builds the adapter from its --l2-adapter through LMCache.
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 DIR [DIR...]  (one directory per NVMe drive)" >&2
  exit 2
fi
paths=$(printf '"%s",' "$@")
adapter=$(printf '{"type":"plugin","module_path":"lmcache_tiered.mp","class_name":"TieredL2Adapter","adapter_params":{"warm.paths":[%s],"warm.capacity_gb":%s}}' \
  "${paths%,}" "${WARM_GB:-500}")
exec lmcache server --port "${PORT:-5555}" --l1-size-gb "${L1_GB:-64}" \
  --eviction-policy LRU --l2-adapter "$adapter"
