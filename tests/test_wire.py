"""Specification of accordion.compress.wire: the collectives a message travels in and the
bytes one worker puts on the wire for them (ring algorithms)."""

from __future__ import annotations

import pytest

from accordion.accounting import wire_bytes
from accordion.compress.wire import (
    OPS,
    Message,
    allgather_bytes,
    allreduce_bytes,
    ring_bytes,
    two_phase_message_bytes,
)

WORKERS = (2, 3, 8, 64, 512, 1024)
# a large matrix: its per-row blocks are whole, so the ratios are the formulas'
SHAPE = (4096, 1024)


def test_the_ops_are_all_reduce_all_gather_and_two_phase() -> None:
    assert OPS == ("allreduce", "allgather", "twophase")


@pytest.mark.parametrize("workers", WORKERS)
def test_a_two_phase_payload_costs_an_all_reduce_of_it(workers: int) -> None:
    sent = ring_bytes([Message("twophase", "codes", 1000.0)], workers)
    assert sent == two_phase_message_bytes(1000.0, workers) == allreduce_bytes(1000.0, workers)
    assert sent == pytest.approx(2 * (workers - 1) / workers * 1000)


def test_a_two_phase_payload_costs_what_an_all_gather_does_at_two_workers() -> None:
    assert two_phase_message_bytes(1000.0, 2) == allgather_bytes(1000.0, 2) == 1000.0


def test_one_worker_sends_nothing_in_any_collective() -> None:
    assert ring_bytes([Message(op, "x", 1000.0) for op in OPS], 1) == 0.0


def test_ring_bytes_sums_each_collectives_payloads_then_applies_its_factor() -> None:
    messages = [Message("allreduce", "P", 100.0), Message("allgather", "values", 10.0),
                Message("twophase", "codes", 40.0), Message("twophase", "codes", 60.0)]  # fmt: skip
    assert ring_bytes(messages, 4) == pytest.approx(1.5 * 100 + 3 * 10 + 1.5 * 100)


def test_int8_wire_bytes_against_dense_are_flat_from_2_to_1024_workers() -> None:
    ratios = [wire_bytes(SHAPE, "int", 8, w) / wire_bytes(SHAPE, "dense", None, w) for w in WORKERS]
    assert all(r == pytest.approx(ratios[0], rel=1e-12) for r in ratios)
    assert ratios[0] == pytest.approx((1 + 2 / 64) / 4, rel=1e-12)  # 0.258x
    assert ratios[0] <= 0.27


@pytest.mark.parametrize("kind,level", [("topk", 0.01), ("sparseloco", 0.1)])
def test_all_gathered_compressors_still_grow_with_the_workers(kind: str, level: float) -> None:
    sent = [wire_bytes(SHAPE, kind, level, w) for w in WORKERS]
    assert all(a < b for a, b in zip(sent, sent[1:]))
    assert sent[-1] == pytest.approx(sent[0] * 1023)  # W - 1: 1 at two workers, 1023 at 1024


@pytest.mark.parametrize("op", ["all_reduce", "alltoall", "", "TWOPHASE"])
def test_a_message_in_an_unknown_collective_is_refused_naming_the_allowed_ones(op: str) -> None:
    with pytest.raises(ValueError, match="Message op must be one of"):
        Message(op, "x", 1.0)


@pytest.mark.parametrize("nbytes,error", [(-1.0, ValueError), ("8", TypeError), (True, TypeError),
                                          (float("nan"), ValueError)])  # fmt: skip
def test_a_message_of_a_bad_number_of_bytes_is_refused(nbytes: object, error: type) -> None:
    with pytest.raises(error, match="Message nbytes"):
        Message("allreduce", "x", nbytes)  # type: ignore[arg-type]
