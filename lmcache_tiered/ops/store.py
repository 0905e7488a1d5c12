"""What ``inspect`` says of a cold tier on a store (``tiered.cold.adapter``).

Read-only and quick: the store is asked only what LMCache's L2 adapter
interface offers without a scan. One lookup of this host's probe object
(the one its live tier writes) tells whether the store answers within
:data:`lmcache_tiered.storage.store_client.TIMEOUT_S`. The adapter's own
``report_status()`` is shown as it is: what it holds, for our own adapter;
its traffic counters are those of inspect's own adapter, which starts at
zero, so they say nothing of the server's. Where the adapter lists keys
(``list_l2_keys``: LMCache's S3 adapter, our own L2 adapter; not ``resp``),
the first page of our objects gives the chunks (payload and header both
there) and their payload bytes, "at least" when there are more pages.
Nothing is written, nothing is locked for longer than the lookup.

May touch: the store, through an adapter of its own (closed before return).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

from lmcache_tiered.config import ConfigError
from lmcache_tiered.storage import store_client
from lmcache_tiered.storage.files import printable
from lmcache_tiered.storage.store_client import (
    HEADER_GROUP,
    NAMESPACE,
    PAYLOAD_GROUP,
    answer,
    build_adapter,
    close_later,
    probe_key,
)

#: Objects of ours listed at most (one page); more make the counts "at least".
PAGE = 1000
#: Settings whose values are not shown (words in their names).
_SECRET = ("pass", "secret", "token", "credential")


def survey(spec: Mapping[str, Any], *, host_id: str) -> dict[str, Any]:
    """Everything ``inspect`` reports about the store ``spec`` names.
    ConfigError for a spec LMCache refuses; a store that cannot be built or
    does not answer is reported (``reachable`` false, ``error`` why)."""
    report: dict[str, Any] = {
        "adapter": spec["type"],
        "config": {
            k: "***" if any(w in k.lower() for w in _SECRET) else v
            for k, v in spec.items()
        },
        "reachable": False,
        "error": None,
        "status": None,
        "objects": None,
    }
    try:
        adapter = build_adapter(spec)
    except ConfigError:
        raise
    except Exception as exc:  # an adapter's own failure: a missing client...
        report["error"] = f"the adapter could not be built: {exc}"
        return report
    try:
        probe = probe_key(host_id)
        task = adapter.submit_lookup_and_lock_task([probe], {})
        timeout = store_client.TIMEOUT_S
        held = answer(lambda: adapter.query_lookup_and_lock_result(task), timeout)
        if held is None:
            report["error"] = f"no answer to a lookup within {timeout:.0f} s"
            return report
        if held.test(0):
            adapter.submit_unlock([probe])
        report["reachable"] = True
        report["status"] = json.loads(json.dumps(adapter.report_status(), default=str))
        report["objects"] = _listing(adapter)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        close_later(adapter).join(store_client.TIMEOUT_S)
    return report


def _listing(adapter: L2AdapterInterface) -> dict[str, Any] | None:
    """Our chunks on the first page of the adapter's key listing; None where
    the adapter lists nothing."""
    try:
        page = adapter.list_l2_keys(model_name=NAMESPACE, page_size=PAGE)
    except NotImplementedError:
        return None
    # a chunk is whole once its header is there (probe objects have none)
    whole = {
        e.key.chunk_hash_hex
        for e in page.entries
        if e.key.object_group_id == HEADER_GROUP
    }
    return {
        "chunks": len(whole),
        "payload_bytes": sum(
            e.size_bytes
            for e in page.entries
            if e.key.object_group_id == PAYLOAD_GROUP and e.key.chunk_hash_hex in whole
        ),
        "complete": page.next_page_token is None,
    }


def text(report: dict[str, Any]) -> str:
    """``report`` as ``inspect`` prints it."""
    kind, error = printable(report["adapter"]), printable(str(report["error"]))
    lines = [f"cold store {kind} {json.dumps(report['config'])}"]
    if not report["reachable"]:
        lines.append(f"  not reachable: {error}")
        return "\n".join(lines)
    lines.append("  reachable: answered a lookup")
    objects = report["objects"]
    if objects is None:
        lines.append(f"  chunks: not listed (the {kind} adapter offers no key listing)")
    else:
        least = "" if objects["complete"] else "at least "
        lines.append(
            f"  chunks: {least}{objects['chunks']} "
            f"({objects['payload_bytes'] / 2**20:.1f} MiB)"
        )
    lines.append(f"  adapter status: {json.dumps(report['status'], sort_keys=True)}")
    if report["error"] is not None:
        lines.append(f"  error: {error}")
    return "\n".join(lines)
