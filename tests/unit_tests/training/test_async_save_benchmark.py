"""benchmarks/async_save.py compares each background save's steps with the quiet steps just
before it, leaving out the warm-up, the step that took the snapshot and the run's last save."""

import pytest

from benchmarks.async_save import save_windows


def test_each_save_window_is_compared_with_the_quiet_steps_before_it():
    # 14 iterations, warm-up 2; saves after 4 (in flight 5..7, 5 took the snapshot), after 9
    # (in flight 10..11) and after 14 (the last: it completes when the run closes).
    ms = {i: 100.0 for i in range(1, 15)} | {1: 900.0, 2: 500.0, 5: 700.0, 6: 110.0, 7: 130.0, 10: 650.0, 11: 90.0}
    ms |= {8: 200.0, 9: 200.0}  # the machine slowed down before the second save
    windows = save_windows(ms, [(4, 7), (9, 11), (14, 14)], warmup=2)
    assert [(w["start"], w["end"]) for w in windows] == [(4, 7), (9, 11)]
    assert windows[0]["quiet_ms"] == [100.0, 100.0] and windows[0]["busy_ms"] == [110.0, 130.0]
    assert windows[0]["snapshot_ms"] == 700.0 and windows[0]["ratio"] == pytest.approx(1.2)
    assert windows[1]["quiet_ms"] == [200.0, 200.0] and windows[1]["busy_ms"] == [90.0]
    assert windows[1]["ratio"] == pytest.approx(0.45)
