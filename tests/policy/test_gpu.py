"""Which GPU jobs may be checkpointed here, and onto which GPUs a checkpoint goes (torpor.policy.gpu)."""

from __future__ import annotations

import pytest

from torpor.policy.gpu import Gpu, Placement, checkpoint_refusal, driver_major, place

H200 = ("NVIDIA H200", 143_771_090_944)
H100 = ("NVIDIA H100 80GB HBM3", 85_520_809_984)


def gpu(n: int, kind: tuple[str, int] = H200, mig: bool = False) -> Gpu:
    return Gpu(f"GPU-{n:08x}-0000-0000-0000-000000000000", kind[0], kind[1], mig=mig)


@pytest.mark.parametrize(
    ("version", "major"), [("570.86.15", 570), ("535.104.05", 535), ("", None), (None, None)]
)
def test_the_drivers_branch(version: str | None, major: int | None) -> None:
    assert driver_major(version) == major


def test_a_driver_before_r570_a_mig_gpu_and_mps_are_refused_and_nothing_else() -> None:
    assert checkpoint_refusal("570.86.15", [gpu(1)], mps=False) is None
    assert "needs r570" in (checkpoint_refusal("550.54.14", [gpu(1)], mps=False) or "")
    assert "needs r570" in (checkpoint_refusal(None, [], mps=False) or "")
    assert "MIG" in (checkpoint_refusal("575.51.03", [gpu(1), gpu(2, mig=True)], mps=False) or "")
    assert "MPS" in (checkpoint_refusal("575.51.03", [gpu(1)], mps=True) or "")


def test_a_checkpoint_goes_back_onto_its_own_gpus_without_a_map() -> None:
    assert place([gpu(1), gpu(2)], [gpu(3), gpu(2), gpu(1)]) == Placement()
    assert place([], [gpu(1)]) == Placement()


def test_onto_other_gpus_of_the_same_type_every_gpu_is_named_in_the_map() -> None:
    placed = place([gpu(1), gpu(2)], [gpu(2), gpu(7)])
    # gpu 2 stays where it was; gpu 1 goes to gpu 7; the driver is told the whole map
    assert placed.pairs == ((gpu(1).uuid, gpu(7).uuid), (gpu(2).uuid, gpu(2).uuid))
    assert placed.refusal is None


def test_the_same_gpu_is_not_taken_by_another_before_its_own_is_placed() -> None:
    # gpu 1 is here too, but the first saved GPU (9) must not take it from the second (1)
    placed = place([gpu(9), gpu(1)], [gpu(1), gpu(5)])
    assert dict(placed.pairs) == {gpu(9).uuid: gpu(5).uuid, gpu(1).uuid: gpu(1).uuid}


def test_another_type_fewer_gpus_or_less_memory_is_refused_saying_what_each_side_has() -> None:
    other = place([gpu(1)], [gpu(2, H100)])
    assert other.pairs == ()
    assert other.refusal is not None
    assert "1 × NVIDIA H200 (134 GiB)" in other.refusal and "1 × NVIDIA H100 80GB HBM3" in other.refusal
    fewer = place([gpu(1), gpu(2)], [gpu(1)])
    assert fewer.refusal is not None and "2 × NVIDIA H200" in fewer.refusal
    smaller = place([gpu(1)], [Gpu("GPU-x", H200[0], H200[1] - 1)])
    assert smaller.refusal is not None
    assert "no GPU" in (place([gpu(1)], []).refusal or "")


def test_a_gpu_in_mig_mode_is_not_a_place_to_restore_onto() -> None:
    placed = place([gpu(1)], [gpu(1, mig=True)])
    assert placed.refusal is not None and "MIG mode" in placed.refusal


def test_the_facts_a_checkpoint_keeps_read_back_and_nothing_else_does() -> None:
    assert Gpu.from_json(gpu(1).to_json()) == gpu(1)
    with pytest.raises(ValueError, match="not a GPU"):
        Gpu.from_json({"uuid": "GPU-1", "name": "x"})
