"""``derive_proxy_layout``: the proxy keeps the source's degrees where it can and says what
changed."""

from __future__ import annotations

import factory
from factory.checks import run_rules
from factory.jobs.launch import check_launch
from factory.proxy import derive_proxy
from factory.proxy_layout import derive_proxy_layout
from factory.schemas.blueprint import Blueprint


def test_nano_on_two_ranks_keeps_what_fits_and_names_each_change() -> None:
    nano = factory.load_blueprint("nano")
    proxy, changes = derive_proxy_layout(nano, 2)
    par = proxy.parallelism
    assert (par.world_size, par.tp, par.ep, par.expert_tp, par.pp) == (2, 2, 2, 1, 1)
    assert par.sequence_parallel  # MoE with TP needs it
    assert changes == ["world_size 32 -> 2", "tp 4 -> 2", "ep 8 -> 2"]
    assert not [f for _, f in run_rules(proxy) if f.severity == "error"]
    check_launch(proxy, 2)  # the runtime launches it


def test_one_rank_is_the_plain_proxy_and_four_ranks_grow_the_batch_only_if_needed() -> None:
    nano = factory.load_blueprint("nano")
    assert derive_proxy_layout(nano, 1) == (derive_proxy(nano), [])
    data = nano.model_dump(exclude_unset=True)
    data["parallelism"].update(tp=1, ep=1, sequence_parallel=False)
    dense = Blueprint.model_validate(data)
    proxy, changes = derive_proxy_layout(dense, 8)
    assert proxy.parallelism.global_batch_size == 16  # 8 replicas x micro-batch 2
    assert "global_batch_size 8 -> 16 (dp 8)" in changes


def test_the_proxy_keeps_expert_tensor_parallelism_where_its_experts_divide() -> None:
    """Nano at EP 2 x ETP 2 on 4 ranks keeps both (the proxy's 176-wide experts split in two),
    and the runtime launches it; ETP 16 on 2 ranks becomes the largest that fits, 2."""
    data = factory.load_blueprint("nano").model_dump(exclude_unset=True)
    data["parallelism"].update(ep=2, etp=2)
    proxy, changes = derive_proxy_layout(Blueprint.model_validate(data), 4)
    par = proxy.parallelism
    assert (par.tp, par.ep, par.expert_tp, par.pp) == (2, 2, 2, 1)
    assert proxy.model.moe.expert_intermediate_size % 2 == 0
    assert changes == ["world_size 32 -> 4", "tp 4 -> 2"]
    check_launch(proxy, 4)
    data["parallelism"].update(ep=1, etp=16)
    proxy, changes = derive_proxy_layout(Blueprint.model_validate(data), 2)
    assert proxy.parallelism.expert_tp == 2 and "etp 16 -> 2" in changes


def test_a_blueprint_with_context_parallelism_keeps_its_long_sequences() -> None:
    """Nano at CP=2 and 32k tokens on 2 ranks (the issue's command): CP takes both ranks, so TP
    goes; the proxy keeps the sequences and trains one per micro-batch."""
    data = factory.load_blueprint("nano").model_dump(exclude_unset=True)
    data["parallelism"]["cp"] = 2
    data["data"]["seq_len"] = 32768
    proxy, changes = derive_proxy_layout(Blueprint.model_validate(data), 2)
    par = proxy.parallelism
    assert (par.cp, par.tp, par.ep, par.pp) == (2, 1, 2, 1)
    assert proxy.data.seq_len == 32768 and proxy.model.max_seq_len >= 32768
    assert (par.micro_batch_size, par.global_batch_size) == (1, 8)
    assert changes == ["world_size 32 -> 2", "tp 4 -> 1", "ep 8 -> 2"]
    check_launch(proxy, 2)
