"""End to end on a Redis Cluster (3 masters, a replica each) with real vLLM CPU engines:
prefill (kv_producer) -> Cluster -> decode (kv_consumer), equal to one engine without the
connector; then a decode during which a master is killed: every output is still right, no
request outlives its deadline by more than its compute, and loads resume by themselves once
the replica has taken over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testing.e2e import finish, one_per_phase, release, start_engine, tokens, wait_at_gate
from testing.redis_server import ClusterServers

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.vllm, pytest.mark.default_vllm_only]

BLOCK = 128
PLAIN = {f"p{i}": tokens(700, 100 + i) for i in range(4)}
FAULT = {f"f{i}": tokens(700, 200 + i) for i in range(14)}
PROMPTS = {**PLAIN, **FAULT}
DEADLINE_S = 3.0
KILL_BEFORE, RECOVERED_BEFORE = 1, 7  # FAULT phases: kill before 1, promotion done before 7


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("e2e-cluster")
    with ClusterServers() as cluster:
        url = cluster.url
        ids = list(PROMPTS)
        phases = one_per_phase(PROMPTS, ids)
        base = start_engine(tmp, "base", tiny_model, phases, core=0)
        prod = start_engine(
            tmp, "prod", tiny_model, phases, core=1, role="kv_producer", url=url,
            extra={"namespace": "pd"},
        )  # fmt: skip
        res: dict[str, Any] = {"base": finish(base), "prod": finish(prod)}
        res["keys_per_master"] = [
            len(cluster.client(m).keys("kv:pd:*")) for m in cluster.master_nodes()
        ]
        for master in cluster.master_nodes():  # the blocks are on the replicas before any crash
            cluster.client(master).wait(1, 5000)
        params = {k: v["kv_transfer_params"] for k, v in res["prod"]["prompts"].items()}
        # load_policy async: this is about the load path through a failover; under auto the
        # loads slowed by the outage teach the consumer that loading is slow, and it rightly
        # recomputes (probing now and then) -- f12 loaded, f13 did not, in one CI run
        extra = {
            "namespace": "pd",
            "deadline_s": DEADLINE_S,
            "breaker_probe_s": 0.2,
            "load_policy": "async",
        }
        cons = start_engine(
            tmp, "cons", tiny_model, one_per_phase(PROMPTS, list(PLAIN)),
            core=0, role="kv_consumer", url=url,
            extra=extra, params=params,
        )  # fmt: skip
        kill, recovered = tmp / "kill", tmp / "recovered"
        fault = start_engine(
            tmp, "fault", tiny_model, one_per_phase(PROMPTS, list(FAULT)),
            core=1, role="kv_consumer", url=url,
            extra=extra, params=params, gates={KILL_BEFORE: kill, RECOVERED_BEFORE: recovered},
        )  # fmt: skip
        res["cons"] = finish(cons)
        wait_at_gate(kill)
        cluster.master_nodes()[0].kill()  # every prompt has blocks on every master
        release(kill)  # phases KILL_BEFORE.. load while the master is gone and being replaced
        wait_at_gate(recovered)
        cluster.wait_healthy(timeout_s=30)
        release(recovered)
        res["fault"] = finish(fault)
        (tmp / "results.json").write_text(json.dumps(res, indent=1, default=str))
        return res


def test_prefill_blocks_spread_over_every_master(e2e: dict) -> None:
    assert len(e2e["keys_per_master"]) == 3 and min(e2e["keys_per_master"]) > 0, e2e


def test_decode_through_the_cluster_equals_a_single_instance(e2e: dict) -> None:
    for i in PLAIN:
        got = e2e["cons"]["prompts"][i]
        assert got["token_ids"] == e2e["base"]["prompts"][i]["token_ids"], i
        assert got["num_cached_tokens"] >= (len(PROMPTS[i]) - 1) // BLOCK * BLOCK, i
    assert e2e["cons"]["metrics"]["vllm:redis_kv_blocks_load_failed"] == 0


def test_a_master_killed_mid_decode_costs_recomputes_only(e2e: dict) -> None:
    fault = e2e["fault"]["prompts"]
    for i in FAULT:
        assert fault[i]["token_ids"] == e2e["base"]["prompts"][i]["token_ids"], i
        # a request waits at most its deadline for KV, then computes it (~1 s here)
        assert fault[i]["elapsed_s"] < DEADLINE_S + 10, (i, fault[i]["elapsed_s"])
    ids = list(FAULT)
    assert fault[ids[0]]["num_cached_tokens"] > 0  # before the crash: loaded
    # while the master was gone, something was recomputed that would have been loaded
    during = ids[KILL_BEFORE:RECOVERED_BEFORE]
    full = [(len(PROMPTS[i]) - 1) // BLOCK * BLOCK for i in during]
    assert any(fault[i]["num_cached_tokens"] < f for i, f in zip(during, full, strict=True))
    # after the replica took over, loads resumed with no restart. The first requests after the
    # promotion may still find the engine's breaker open: it learns the new master by its own
    # probe (every 0.2 s), which the test cannot wait on. Measured: f7 recomputed and f8 on
    # loaded on an idle machine; on a busy one (a fresh-clone run) f7 and f8 recomputed, the
    # breaker resuming about a second after the Cluster was healthy. Seven requests follow the
    # promotion, the last two must load.
    assert all(fault[i]["num_cached_tokens"] > 0 for i in ids[-2:]), [
        fault[i]["num_cached_tokens"] for i in ids
    ]
