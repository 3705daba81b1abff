"""When the standby slot may be overwritten in place (weightsync.service.slots.StandbyRelease)."""

from weightsync.service.slots import StandbyRelease


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_without_a_hook_the_hold_counts_from_start_up_and_from_each_swap():
    clock = Clock()
    r = StandbyRelease(30.0, False, clock)
    assert not r.free()  # nothing known about swaps before start-up
    clock.t += 29.9
    assert not r.free()
    clock.t += 0.1
    assert r.free()
    r.swapped()
    assert not r.free()
    clock.t += 30
    assert r.free()
    assert StandbyRelease(0.0, False, clock).free()


def test_with_a_hook_only_the_success_of_the_latest_swaps_hook_releases():
    clock = Clock()
    r = StandbyRelease(0.0, True, clock)
    clock.t += 1e6
    assert not r.free()  # no swap (and no hook) since start-up, whatever the hold
    first = r.swapped()
    assert not r.free()  # its hook is running
    r.confirm(first)
    assert r.free()
    second = r.swapped()
    clock.t += 1e6
    assert not r.free()  # running, failed or cancelled: the server may still read the old slot
    r.confirm(first)  # a late outcome of an earlier swap counts for nothing
    assert not r.free()
    r.confirm(second)
    assert r.free()


def test_never_means_never():
    clock = Clock()
    for hooked in (False, True):
        r = StandbyRelease(None, hooked, clock)
        r.confirm(r.swapped())
        clock.t += 1e9
        assert not r.free()
