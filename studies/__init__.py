"""Offline studies on request traces: the simulated warehouse and its native
replay core (``sim``, ``replay_core``), cluster replay through the placement
policies and its cost model (``replay``, ``replay_cost``), TTL x capacity x
policy sweeps (``sweep``), reuse features (``reuse``) and synthetic traces
(``trace_synth``).

They run the warehouse's own keys, eviction policies and trace formats, so the
policy code that serves traffic is the code that replays it; nothing that
serves imports this package."""
