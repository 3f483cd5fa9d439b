"""The engine core and its clients: in-process, or in a process of its own behind ZeroMQ (ARCHITECTURE §6)."""
