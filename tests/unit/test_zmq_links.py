"""transfer.control.zmq_links: libzmq's monitor event bits as pyzmq names
them, and a DEALER's link as its monitor's events move it."""

import zmq

from transfer.control import zmq_links
from transfer.control.base import Link
from transfer.control.zmq_links import MONITORED, LinkState


def test_the_event_bits_are_libzmqs():
    assert zmq_links._UP == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert zmq_links._DOWN == (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert zmq_links._RETRY == zmq.EVENT_CONNECT_RETRIED and zmq_links._CONNECTED == zmq.EVENT_CONNECTED
    assert not MONITORED & zmq.EVENT_MONITOR_STOPPED  # the channel reads that one apart


def test_up_down_and_gone():
    state = LinkState()
    state.on_event(zmq.EVENT_CONNECT_RETRIED)  # not up yet: retrying is not gone
    assert state.link is Link.UNKNOWN
    state.on_event(zmq.EVENT_CONNECTED)
    state.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert state.link is Link.UP
    state.on_event(zmq.EVENT_DISCONNECTED)
    assert state.link is Link.DOWN
    state.on_event(zmq.EVENT_CONNECT_RETRIED)  # the retry that follows the loss
    assert state.link is Link.DOWN
    state.on_event(zmq.EVENT_CONNECT_RETRIED)  # an attempt failed: the address refuses
    assert state.link is Link.GONE
    state.on_event(zmq.EVENT_CONNECTED)
    state.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # back
    assert state.link is Link.UP and state.retries == 0
