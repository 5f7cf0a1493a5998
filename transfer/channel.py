"""Deprecated path: the zmq control channel lives in
:mod:`transfer.control.zmq_channel`; this module keeps ``ControlChannel``
importable from here."""

from transfer.control.zmq_channel import ControlChannel, ZmqChannel

__all__ = ["ControlChannel", "ZmqChannel"]
