"""The stop request behind Ctrl-C and SIGTERM (dapo_ray/stopping.py), with real signals to this process."""

import os
import signal

import pytest

from dapo_ray.stopping import StopRequest


def test_the_first_signal_asks_the_second_interrupts_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    said = []
    with StopRequest(said.append) as stop:
        assert stop.signal is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == "SIGTERM" and "stopping after the step in progress" in said[0]
        with pytest.raises(KeyboardInterrupt, match="SIGINT after SIGTERM"):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_outside_the_main_thread_it_installs_nothing():
    import threading

    seen = []

    def body():
        with StopRequest(print) as stop:
            seen.append((stop.signal, signal.getsignal(signal.SIGTERM)))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [(None, signal.getsignal(signal.SIGTERM))]
