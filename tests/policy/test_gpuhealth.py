"""When a GPU's readings warrant moving its jobs off it (torpor.policy.gpuhealth)."""

from __future__ import annotations

from torpor.policy.gpuhealth import HOT_FOR_S, Reading, judge, trim

UUID = "GPU-1"


def reading(at: float, temperature: float | None = 60.0, **rest: object) -> Reading:
    return Reading(UUID, at, temperature_c=temperature, slowdown_c=90.0, **rest)  # type: ignore[arg-type]


def test_a_healthy_gpu_is_left_alone() -> None:
    verdict = judge([reading(0), reading(5, ecc_uncorrected=0)], now=5)
    assert not verdict.evacuate and verdict.watching is None


def test_a_gpu_off_the_bus_is_evacuated_at_once() -> None:
    verdict = judge([reading(0), Reading(UUID, 5, lost=True)], now=5)
    assert verdict.evacuate and "fallen off the bus" in (verdict.reason or "")


def test_a_hardware_xid_evacuates_and_a_programs_own_does_not() -> None:
    assert judge([reading(0, xids=(79,))], now=0).evacuate
    assert "XID 48" in (judge([reading(0, xids=(13, 48)), reading(5)], now=5).reason or "")
    assert not judge([reading(0, xids=(13, 31, 43, 45))], now=0).evacuate


def test_uncorrectable_ecc_errors_since_the_first_reading_evacuate() -> None:
    assert not judge([reading(0, ecc_uncorrected=3), reading(5, ecc_uncorrected=3)], now=5).evacuate
    verdict = judge([reading(0, ecc_uncorrected=3), reading(5), reading(10, ecc_uncorrected=5)], now=10)
    assert verdict.evacuate and "2 uncorrectable ECC" in (verdict.reason or "")


def test_a_hot_spike_is_watched_and_only_a_lasting_one_evacuates() -> None:
    spike = [reading(0), reading(5, 92), reading(10, 95)]
    verdict = judge(spike, now=10)
    assert not verdict.evacuate and "hot for 5 s of 60 s" in (verdict.watching or "")
    passed = [*spike, reading(15, 80)]
    assert judge(passed, now=15).watching is None
    lasting = [reading(0), *(reading(t, 91) for t in range(5, 5 + int(HOT_FOR_S) + 5, 5))]
    verdict = judge(lasting, now=lasting[-1].at)
    assert verdict.evacuate and "hot for 60 s (91 °C, slowdown at 90 °C)" in (verdict.reason or "")


def test_a_reading_that_cannot_tell_the_temperature_breaks_a_hot_run() -> None:
    runs = [reading(0, 95), reading(30, None), *(reading(t, 95) for t in (40, 70, 89))]
    verdict = judge(runs, now=89)
    assert not verdict.evacuate and "hot for 49 s" in (verdict.watching or "")


def test_only_the_last_minutes_are_kept() -> None:
    kept = trim([reading(0), reading(500), reading(700)], now=700, keep_s=600)
    assert [r.at for r in kept] == [500, 700]
