"""What the instances of a namespace share beyond values: handoff records between a producer and
its consumer (``handoff``), namespace generations and resets (``generations``), presence, sizes
and TTLs of stored blocks (``inventory``, ``survey``), and the access rules each role gets
(``access``)."""
