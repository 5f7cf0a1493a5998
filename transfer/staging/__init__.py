"""Staging memory: scattered pages gathered into a registered buffer, written
as a few large descriptors, scattered on the other side.

- :mod:`~transfer.staging.area`: the staging memory and its region allocator;
- :mod:`~transfer.staging.arenas`: a fenced decode rank's arenas (the write fence);
- :mod:`~transfer.staging.build`: a rank's staging, built in one place;
- :mod:`~transfer.staging.copies`: ``gather`` and ``scatter`` (torch index ops);
- :mod:`~transfer.staging.hostmem`: huge-page host memory.

The message flow of staged parts is the room layer's
(:mod:`transfer.rooms.staged_prefill`, :mod:`transfer.rooms.staged_decode`).
"""
