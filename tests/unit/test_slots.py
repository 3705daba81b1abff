"""When the standby slot may be overwritten in place (weightsync.slots.StandbyRelease)."""

from weightsync.slots import StandbyRelease


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_hold_counts_from_start_up_and_from_each_swap():
    clock = Clock()
    r = StandbyRelease(30.0, clock)
    assert not r.free(False)  # nothing known about swaps before start-up
    clock.t += 29.9
    assert not r.free(False)
    clock.t += 0.1
    assert r.free(False)
    r.swapped()
    assert not r.free(False)
    clock.t += 30
    assert r.free(False)


def test_a_confirmed_hook_releases_at_once_and_never_means_never():
    clock = Clock()
    assert StandbyRelease(3600.0, clock).free(True)
    never = StandbyRelease(None, clock)
    clock.t += 1e9
    assert not never.free(True) and not never.free(False)
    assert StandbyRelease(0.0, clock).free(False)
